"""The planner's axes: every choice ``calc.plan`` enumerates, one ``Axis`` each, in one list.

An axis names the job field(s) it sets, the values it can take for a request, whether the
planner enumerates it unless told otherwise, and whether it is a *size* (evaluated in bulk
within a compiled structure, like the micro-batch) or a *structural* choice (each value is its
own compiled structure, like the optimizer). Training on 2+ GPUs adds the ``parallel`` axis
(``calc.plan.layouts``: dp x ZeRO stage / FSDP2 / offload x tp; ``shards=True``; its
``communication`` factor feeds the throughput proxy, ``calc.plan.throughput``); LoRA and QLoRA are
tasks (``calc.plan.engine.task_fields``), weight and KV-cache quantization are inference axes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from calc.config.compression import KV_QUANTS, QUANT_METHODS, Quant
from calc.config.jobs import (
    ATTENTIONS,
    HAND_RECOMPUTES,
    IMPLEMENTATIONS,
    INFERENCE_PRECISIONS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    Inference,
    Training,
)
from calc.models import torchtitan
from calc.plan.layouts import default_layout, layout_of, layouts
from calc.plan.throughput import communication_factor

TRAINING = "training"
INFERENCE = "inference"


@dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    """What the values of an axis may depend on: the request."""

    kind: str
    """``training`` or ``inference``."""
    seq_len: int
    """Tokens per sequence (training) or in the KV cache (inference)."""
    global_batch: int
    """Sequences per optimizer step over all GPUs, or sequences served at once."""
    gpu_count: int
    """GPUs of the request."""
    implementations: tuple[str, ...] = ()
    """The implementations the grid's jobs run (the recomputations depend on them); empty:
    not known."""

    @property
    def per_gpu_batch(self) -> int:
        """Sequences each GPU processes per step (``global_batch / gpu_count``; at least 1:
        a tensor-parallel group shares its sequences)."""
        return max(1, self.global_batch // self.gpu_count)


def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


@dataclass(frozen=True, kw_only=True, slots=True)
class Axis:
    """One choice the planner enumerates."""

    name: str
    """Key in ``Config.choices`` and in ``plan(fixed=...)``; the job field it sets, if one."""
    kinds: tuple[str, ...]
    """Job kinds it applies to (``training``, ``inference``)."""
    values: Callable[[Context], tuple]
    """Every value allowed for a request, in the order a table lists them."""
    enumerated: bool = True
    """Enumerated by default; otherwise held at the base job's value unless ``fixed`` lists
    values for it."""
    size: bool = False
    """A size evaluated in bulk within one compiled structure (the micro-batch)."""
    knob: bool = True
    """Offered by ``changes_to_fit`` (False for choices that are not the user's to change,
    e.g. which modeling code verify runs)."""
    shards: bool = False
    """Models how 2+ GPUs share a training job (data/tensor/pipeline parallel, ZeRO). While no
    such axis exists, training on 2+ GPUs is reported as not modelled."""
    communication: Callable[[object, Context], float] | None = None
    """The throughput proxy's communication factor of a value (>= 1), if the axis has one."""

    def current(self, job: Training | Inference) -> object:
        """The value ``job`` has on this axis (None for ``parallel``: a job does not carry its
        layout; the evaluator takes the default, ``calc.plan.layouts.default_layout``)."""
        if self.name == "parallel":
            return None
        if self.name == "quant":
            return "none" if job.quant is None else job.quant.method
        if self.name == "kv_quant":
            return getattr(job, "kv_quant", None) or "none"
        if self.name == "micro_batch":
            return job.micro_batch if isinstance(job, Training) else job.batch
        return getattr(job, self.name)

    def apply(self, fields: dict, value: object, ctx: Context) -> None:
        """Set the job fields for ``value`` (``fields`` is the job's field dict)."""
        if self.name == "quant":  # a method name; the base's Quant kept if it is that method
            quant = fields.get("quant")
            if quant is None or quant.method != value:
                # value is one of the axis's values, "none" or a QuantMethod
                quant = None if value == "none" else Quant(method=value)  # type: ignore[arg-type]
            fields["quant"] = quant
        elif self.name == "kv_quant":
            fields["kv_quant"] = None if value == "none" else value
        elif self.name != "micro_batch":
            fields[self.name] = value
        elif ctx.kind == TRAINING:  # grad_accum per data-parallel replica (tp shares one)
            label = fields.get("parallel") or default_layout(ctx.gpu_count)
            dp = layout_of(label, ctx.gpu_count).dp
            fields["micro_batch"] = value
            # value is one of the axis's values, an int (divisors of the per-GPU batch)
            fields["grad_accum"] = max(1, ctx.global_batch // (dp * int(value)))  # type: ignore[call-overload]
        else:
            fields["batch"] = value


def recomputes(ctx: Context) -> tuple[str, ...]:
    """The recomputations the grid takes: torchtitan's own when every job runs torchtitan's
    model (`calc.models.torchtitan.RECOMPUTES`: whole blocks or by op, no ``selective``), none
    for LitGPT's single-device fine-tuning, else those the hand graphs replay (``op`` of another model is recorded, seconds a job)."""
    if ctx.implementations and set(ctx.implementations) == {"torchtitan"}:
        return torchtitan.RECOMPUTES
    if ctx.implementations and set(ctx.implementations) == {"litgpt"}:
        return ("none",)  # its single-device fine-tuning checkpoints nothing
    return HAND_RECOMPUTES


def _training_or_inference(train: tuple, infer: tuple) -> Callable[[Context], tuple]:
    return lambda ctx: train if ctx.kind == TRAINING else infer


AXES: tuple[Axis, ...] = (
    Axis(
        name="parallel",
        kinds=(TRAINING,),
        values=lambda ctx: tuple(layouts(ctx.gpu_count)),
        shards=True,
        communication=lambda value, ctx: communication_factor(layout_of(value, ctx.gpu_count)),
    ),
    Axis(
        name="precision",
        kinds=(TRAINING, INFERENCE),
        values=_training_or_inference(PRECISIONS, INFERENCE_PRECISIONS),
    ),
    Axis(name="optimizer", kinds=(TRAINING,), values=lambda ctx: OPTIMIZERS),
    Axis(name="recompute", kinds=(TRAINING,), values=lambda ctx: recomputes(ctx)),
    Axis(
        name="optimizer_impl",
        kinds=(TRAINING,),
        values=lambda ctx: OPTIMIZER_IMPLS,
        enumerated=False,
    ),
    Axis(
        name="attention",
        kinds=(TRAINING, INFERENCE),
        values=lambda ctx: ATTENTIONS,
        enumerated=False,
    ),
    Axis(
        name="implementation",
        kinds=(TRAINING, INFERENCE),
        values=lambda ctx: IMPLEMENTATIONS,
        enumerated=False,
        knob=False,
    ),
    Axis(
        name="quant",
        kinds=(INFERENCE,),
        values=lambda ctx: ("none", *QUANT_METHODS),
        enumerated=False,
    ),
    Axis(
        name="kv_quant",
        kinds=(INFERENCE,),
        values=lambda ctx: ("none", *KV_QUANTS),
        enumerated=False,
    ),
    Axis(
        name="micro_batch",
        kinds=(TRAINING, INFERENCE),
        values=lambda ctx: divisors(ctx.per_gpu_batch),
        size=True,
    ),
)
"""Every axis, in the order tables show them. The layout (``parallel``, training: how the GPUs
share the job, ``calc.plan.layouts``) comes first, the size axis (micro-batch) last."""


def axes_for(kind: str) -> tuple[Axis, ...]:
    """The axes that apply to a job kind."""
    return tuple(a for a in AXES if kind in a.kinds)
