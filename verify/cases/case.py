"""What a verification case is: `Case` (one process) and `DistCase` (torchrun ranks), plain data.

A case names a card, how to scale it (`verify.cases.scale.scaled_spec`), the job that runs and
the tolerance. `train` and `infer` build single-process cases with the defaults every case
shares; `training_job` is the ``calc.Training`` of those defaults, used by the distributed ones.
Tolerances are per implementation (reference 1 %, hf 3 %), fixed here and never widened to make
a case pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from calc.compress.structured import pruned_spec
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.data.cards import load_card
from verify.cases.scale import DEFAULT_MAX_POSITIONS, scaled_spec

TOLERANCE_PCT: dict[str, float] = {
    "reference": 1.0,
    "hf": 3.0,
    "derived": 3.0,
    "torchtune": 1.0,
    "torchtitan": 1.0,
    "litgpt": 1.0,
}
"""|error| allowed per implementation, in percent of the measured peak."""
DEFAULT_STEPS = 3
"""Optimizer steps a distributed case measures: step 1 creates optimizer states, step 2
rebuilds DDP's buckets, step 3 is steady."""

LLAMA = "llama-2-7b"
LLAMA3 = "llama-3.1-8b"
MISTRAL = "mistral-7b-v0.1"
QWEN2 = "qwen2.5-0.5b"
QWEN3 = "qwen3-32b"
GPT2 = "gpt2"
"""The cards the cases scale down, one per architecture family."""
Q = ("quick",)
"""The tag of the CI subset."""

JOB_DEFAULTS: dict[str, Any] = {
    "micro_batch": 2,
    "seq_len": 32,
    "precision": "fp32",
    "optimizer": "adamw",
    "optimizer_impl": "foreach",
}
"""The training job of a case unless it says otherwise."""


def pairs(mapping: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """``mapping`` as sorted (key, value) pairs, so that a case stays hashable."""
    return tuple(sorted((mapping or {}).items()))


def training_job(implementation: str = "reference", **job: Any) -> Training:
    """``calc.Training`` of `JOB_DEFAULTS` overridden by ``job``."""
    return Training(**{**JOB_DEFAULTS, "implementation": implementation, **job})


def _check(name: str, impl: str, job: Training | Inference, tolerance_pct: float) -> None:
    if impl != job.implementation:
        raise ValueError(
            f"case {name}: impl={impl!r} differs from job.implementation={job.implementation!r}"
        )
    if tolerance_pct <= 0:
        raise ValueError(f"case {name}: tolerance_pct={tolerance_pct} must be > 0")


def _scaled(card: str, scale: tuple[tuple[str, Any], ...], seq: int) -> ModelSpec:
    kw = dict(scale)
    kw.setdefault("max_positions", max(DEFAULT_MAX_POSITIONS, seq))
    return scaled_spec(card, **kw)


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One verification case, run in this process."""

    name: str
    """Unique name, used by ``--cases`` filters and in reports."""
    card: str
    """Model card id whose structure the scaled model keeps."""
    scale: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments of `verify.cases.scale.scaled_spec` (as pairs, so the case stays hashable)."""
    job: Training | Inference
    """What runs; ``job.implementation`` equals ``impl``."""
    impl: str
    """``reference`` or ``hf``."""
    tolerance_pct: float
    """Largest |predicted - measured| / measured allowed, in percent."""
    tags: tuple[str, ...] = ()
    """Labels: ``quick``, the option a case is about (``precision``, ``optimizer``, ...)."""
    note: str = ""
    """Why the case exists, or which side is wrong when it misses."""
    seed: int = 0
    """Seed for weights and token ids."""
    structured: tuple[tuple[str, int], ...] = ()
    """Keyword arguments of `calc.pruned_spec` applied to the scaled model (structured
    pruning: kept heads, KV heads, FFN channels, layers), as pairs."""
    config: str = ""
    """A tiny Hugging Face ``config.json`` (JSON text) to run instead of scaling ``card``: the
    architectures without a hand-written graph, whose replay calc derives (`calc.derive`)."""
    full_size: bool = False
    """Run ``card`` itself, unscaled: the regime real models live in (a 150k-token vocabulary's
    logits dominate the step), at the cost of GBs and a minute per case."""

    def __post_init__(self) -> None:
        _check(self.name, self.impl, self.job, self.tolerance_pct)
        if self.full_size and (self.scale or self.config or self.structured):
            raise ValueError(f"case {self.name}: a full-size case takes no scale/config/structure")

    @property
    def kind(self) -> str:
        return "training" if isinstance(self.job, Training) else "inference"

    @property
    def isolated(self) -> bool:
        """Run in a child process of its own (`verify.__main__`): a full-size or full-width
        (``wide``) case holds GBs, which the next case's run must not inherit."""
        return self.full_size or "wide" in self.tags

    @property
    def seq(self) -> int:
        """Longest sequence the case runs (training seq_len or inference context)."""
        return self.job.seq_len if isinstance(self.job, Training) else self.job.context

    def spec(self) -> ModelSpec:
        """The scaled model (before the job's dropout is applied)."""
        if self.config:
            return ModelSpec.from_json(self.config, name=f"{self.card}-tiny")
        if self.full_size:
            return load_card(self.card)
        spec = _scaled(self.card, self.scale, self.seq)
        if self.structured:
            spec = pruned_spec(spec, **dict(self.structured))
        return spec

    def label(self) -> str:
        """The option that colours this case in the plot: its precision."""
        return self.job.precision


def train(name: str, card: str, **kw: Any) -> Case:
    """A training case: `training_job` of the job fields in ``kw`` (`single_case`)."""
    return single_case(name, card, "training", **kw)


def infer(name: str, card: str, **kw: Any) -> Case:
    """An inference case: ``calc.Inference`` of the job fields in ``kw`` (`single_case`)."""
    return single_case(name, card, "inference", **kw)


def single_case(
    name: str,
    card: str,
    kind: str,
    *,
    impl: str = "reference",
    tags: tuple[str, ...] = (),
    scale: Mapping[str, Any] | None = None,
    note: str = "",
    full_size: bool = False,
    **job: Any,
) -> Case:
    """A ``kind`` (``training`` or ``inference``) case of ``card`` scaled by ``scale``, run by
    ``impl`` at its tolerance, tagged ``kind`` and ``tags``; ``job`` holds the job's fields."""
    made = (
        training_job(impl, **job) if kind == "training" else Inference(implementation=impl, **job)
    )
    return Case(
        name=name,
        card=card,
        scale=pairs(scale),
        job=made,
        impl=impl,
        tolerance_pct=TOLERANCE_PCT[impl],
        tags=(kind, *tags),
        note=note,
        full_size=full_size,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class DistCase:
    """One distributed verification case: a scaled card, a per-rank job, a parallel layout and
    the engine that realises it on torch.distributed (`verify.dist.launch.ENGINES`)."""

    name: str
    """Unique name (``--cases`` filters match substrings of it)."""
    card: str
    """Model card id whose structure the scaled model keeps."""
    scale: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments of `verify.cases.scale.scaled_spec`, as pairs."""
    job: Training
    """What each rank runs (micro_batch is per rank)."""
    parallel: Parallelism
    """The layout calc predicts; ``parallel.world_size`` equals ``nproc``."""
    engine: str
    """Key of `verify.dist.launch.ENGINES`: how the model is wrapped (``ddp``, ``zero1``,
    ``fsdp2``, ``tp``, ``pp``, ...)."""
    tolerance_pct: float = 1.0
    """Largest |predicted - measured| / measured allowed, in percent."""
    tags: tuple[str, ...] = ()
    """Labels: ``quick`` marks the CI subset."""
    note: str = ""
    """Why the case exists; for a 3 % tolerance, which communication buffers are not visible."""
    seed: int = 0
    """Seed of the weights (every rank builds the same) and, plus the rank, of the batch."""
    steps: int = DEFAULT_STEPS
    """Optimizer steps measured."""
    options: tuple[tuple[str, Any], ...] = ()
    """Engine-specific options (as pairs)."""
    config: str = ""
    """A tiny Hugging Face ``config.json`` (JSON text) to run instead of scaling ``card`` (a
    derived architecture, as `Case.config`)."""
    full_size: bool = False
    """Run ``card`` itself on every rank, unscaled (`Case.full_size`)."""
    meter: str = ""
    """How each rank measures: ``tracker`` (the storage tracker) or ``profiler`` (the
    profiler's allocation events, `verify.dist.profiled`); empty: ``profiler`` for a compiled
    job (the tracker cannot see Inductor's buffers), else ``tracker``."""

    def __post_init__(self) -> None:
        _check(self.name, self.impl, self.job, self.tolerance_pct)
        if self.meter not in ("", "tracker", "profiler"):
            raise ValueError(
                f"case {self.name}: meter={self.meter!r}: allowed '', 'tracker', 'profiler'"
            )
        if self.full_size and (self.scale or self.config):
            raise ValueError(f"case {self.name}: a full-size case takes no scale/config")
        if self.steps < 1:
            raise ValueError(f"case {self.name}: steps={self.steps} must be >= 1")

    @property
    def impl(self) -> str:
        """``reference`` or ``hf``: the job's implementation."""
        return self.job.implementation

    @property
    def profiled(self) -> bool:
        """Whether the ranks measure with the profiler's allocation events (`meter`)."""
        if self.meter:
            return self.meter == "profiler"
        return isinstance(self.job, Training) and self.job.compile != "none"

    @property
    def nproc(self) -> int:
        """Processes the case runs on."""
        return self.parallel.world_size

    @property
    def kind(self) -> str:
        """``distributed`` (`Case.kind` is ``training`` or ``inference``)."""
        return "distributed"

    def spec(self) -> ModelSpec:
        """The scaled model (or the model of ``config``)."""
        if self.config:
            return ModelSpec.from_json(self.config, name=f"{self.card}-tiny")
        if self.full_size:
            return load_card(self.card)
        return _scaled(self.card, self.scale, self.job.seq_len)

    def label(self) -> str:
        return self.engine

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


GLOO_ASYNC_PCT = 3.0
"""Tolerance of the FSDP2 cases on gloo (`GLOO_ASYNC_NOTE`)."""
GLOO_ASYNC_NOTE = (
    "3 %: gloo runs FSDP2's reduce-scatter on a worker thread whose work object can keep the "
    "previous group's reduce-scatter input alive past the point FSDP2 drops it (seen on one rank "
    "in one step of three: +66 KB on 2.65 MB); calc models the release FSDP2 performs, which is "
    "what the CUDA caching allocator counts"
)
