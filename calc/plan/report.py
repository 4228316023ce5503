"""The least per-GPU memory to serve, LoRA-, QLoRA- or fully fine-tune a model, and the recipe.

For each task and weight width (bf16, int8, int4) the report searches a small grid of
single-GPU recipes, estimates each with ``calc.estimate`` (the replay verify checks), and keeps
the one with the least peak. The grid (`candidates`) is the choices a user of one GPU has:

* serve (prefill of ``context`` tokens into the KV cache, then ready to decode): weight format
  (bf16; int8 per-row or fp8 per-row; int4 at groups of 128 or NF4 with double quantization)
  times KV cache (16-bit, int8, fp8);
* LoRA: a bf16 base with rank-``lora_rank`` adapters on all seven linears; QLoRA: the same over
  an int8 (per-row) or int4 (NF4, or int4 at groups of 128) base; full fine-tuning: ``bf16``
  (bf16 weights, grads and states) or ``bf16-master`` (fp32 master weights and states). Each
  times optimizer (AdamW, bitsandbytes-style 8-bit Adam) and recomputation (none, full).

A width that does not apply to a task is ``None`` (a quantized model cannot be fully
fine-tuned; a bf16 base is not QLoRA). Every estimate runs the ``reference`` implementation
(verify's plain-PyTorch model, whose quantized linears and adapters verify measures) with the
SDPA kernel CUDA picks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from calc.compress.quant import check_fits, library_of
from calc.config.compression import KVQuant, LoRA, Quant
from calc.config.jobs import (
    Attention,
    Inference,
    InferenceImplementation,
    Optimizer,
    Precision,
    Recompute,
    Training,
)
from calc.config.model_spec import ModelSpec
from calc.estimate.api import estimate

TASKS: tuple[str, ...] = ("serve", "lora", "qlora", "full")
"""The report's rows: serve, LoRA fine-tune, QLoRA fine-tune, full fine-tune."""
WIDTHS: tuple[str, ...] = ("bf16", "int8", "int4")
"""The report's columns: the width of the (frozen or served) weights."""
OPTIMIZERS: tuple[Optimizer, ...] = ("adamw", "adam8bit")
"""Optimizers searched for training (Adam-quality updates; SGD's zero state is not a recipe)."""
RECOMPUTES: tuple[Recompute, ...] = ("none", "full")
"""Activation recomputation searched for training."""
WEIGHT_FORMATS: dict[str, tuple[Quant | None, ...]] = {
    "bf16": (None,),
    "int8": (Quant(method="int8"), Quant(method="fp8", fp8_scaling="row")),
    "int4": (Quant(method="int4"), Quant(method="nf4")),
}
"""Weight formats per width (defaults of `calc.Quant`: int4 groups of 128, nf4 double-quant)."""
KV_FORMATS: tuple[KVQuant | None, ...] = (None, "int8", "fp8")
"""KV-cache formats searched for serving."""
IMPLEMENTATION: InferenceImplementation = "reference"
"""Every recipe runs verify's plain-PyTorch model (its quantized linears and adapters are what
verify measures)."""
ATTENTION: Attention = "sdpa"
"""Every recipe runs the SDPA kernel CUDA picks."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """The best recipe of one (task, width) cell."""

    task: str
    """``serve``, ``lora``, ``qlora`` or ``full``."""
    width: str
    """``bf16``, ``int8`` or ``int4``: the width of the weights."""
    job: Training | Inference
    """The job that reaches the least peak."""
    peak_bytes: int
    """Its predicted ``max_memory_allocated`` on one GPU, in bytes."""
    peak_phase: str
    """Phase of the peak (``prefill``, ``step2/backward``, ...)."""
    weights_bytes: int
    """Bytes of weights at the peak (quantized values, scales, adapters included)."""
    searched: int
    """How many candidate recipes were estimated for this cell."""
    parts: tuple[tuple[str, int], ...] = ()
    """The top level of the breakdown at the peak (``weights``, ``kv_cache``, ``activations``,
    ``optimizer``, ...), bytes, largest first."""


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A cell that applies but where no candidate could be estimated, and why."""

    task: str
    width: str
    reasons: tuple[str, ...]
    """One line per skipped candidate kind: a group size that does not divide the model's
    linears (``ValueError``), or what the cost model does not cover (``NotImplementedError``)."""


def candidates(
    task: str, width: str, *, batch: int, seq_len: int, lora_rank: int
) -> list[Training | Inference]:
    """The recipes searched for one cell (empty when the width does not apply)."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {TASKS}")
    if width not in WIDTHS:
        raise ValueError(f"width={width!r} is not one of {WIDTHS}")
    if task == "serve":
        return [
            Inference(
                batch=batch,
                context=seq_len,
                precision="bf16",
                quant=q,
                kv_quant=kv,
                implementation=IMPLEMENTATION,
                attention=ATTENTION,
            )
            for q in WEIGHT_FORMATS[width]
            for kv in KV_FORMATS
        ]
    if (task == "qlora") == (width == "bf16"):  # lora/full: bf16 only; qlora: int8/int4 only
        return []
    lora = LoRA(rank=lora_rank) if task in ("lora", "qlora") else None
    quants = WEIGHT_FORMATS[width] if task == "qlora" else (None,)
    precisions: tuple[Precision, ...] = ("bf16", "bf16-master") if task == "full" else ("bf16",)
    return [
        Training(
            micro_batch=batch,
            seq_len=seq_len,
            precision=p,
            optimizer=o,
            recompute=r,
            lora=lora,
            quant=q,
            implementation=IMPLEMENTATION,
            attention=ATTENTION,
        )
        for p in precisions
        for q in quants
        for o in OPTIMIZERS
        for r in RECOMPUTES
    ]


def best(
    model: ModelSpec, task: str, width: str, *, batch: int = 1, seq_len: int = 4096,
    lora_rank: int = 16, device: str = "cuda",
) -> Recipe | Unavailable | None:  # fmt: skip
    """The least-peak recipe of one cell; ``None`` where the width does not apply;
    `Unavailable` where it applies but no candidate can be estimated for this model.
    Candidates that cannot be (a group size that does not divide the model's linears, a
    combination the cost model does not cover) are skipped and named."""
    jobs = candidates(task, width, batch=batch, seq_len=seq_len, lora_rank=lora_rank)
    if not jobs:
        return None
    found: Recipe | None = None
    reasons: dict[str, None] = {}
    searched = 0
    for job in jobs:
        try:
            if job.quant is not None:
                check_fits(model, job.quant, library_of(job))
            est = estimate(model, job, device=device)
        except (ValueError, NotImplementedError) as exc:
            reasons[str(exc)] = None
            continue
        searched += 1
        if found is None or est.peak_bytes < found.peak_bytes:
            top = {k: int(v) for k, v in est.breakdown.items() if "/" not in k and k != "total"}
            parts = tuple(sorted(top.items(), key=lambda kv: -kv[1]))
            weights = top.get("weights", 0)
            found = Recipe(task, width, job, int(est.peak_bytes), est.peak_phase, weights, 0, parts)
    if found is None:
        return Unavailable(task, width, tuple(reasons))
    return replace(found, searched=searched)


def report(
    model: ModelSpec, *, batch: int = 1, seq_len: int = 4096, lora_rank: int = 16,
    device: str = "cuda", tasks: tuple[str, ...] = TASKS,
) -> dict[tuple[str, str], Recipe | Unavailable | None]:  # fmt: skip
    """Every cell of the report: ``(task, width) -> Recipe`` (``None``: does not apply;
    `Unavailable`: applies, but nothing could be estimated for this model)."""
    for name, value, high in (("batch", batch, 1 << 20), ("seq_len", seq_len, 1 << 24),
                              ("lora_rank", lora_rank, 1 << 16)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ValueError(f"{name}={value!r} must be an integer in [1, {high}]")
    out: dict[tuple[str, str], Recipe | Unavailable | None] = {}
    for task in tasks:
        for width in WIDTHS:
            out[(task, width)] = best(
                model, task, width, batch=batch, seq_len=seq_len, lora_rank=lora_rank,
                device=device,
            )  # fmt: skip
    return out


def describe(job: Training | Inference) -> str:
    """A one-line recipe: what differs from the defaults that matter for memory."""
    parts: list[str] = []
    q = job.quant
    if q is None:
        parts.append("bf16 weights")
    elif q.method == "nf4":
        parts.append(
            f"NF4 weights (blocks of {q.group}{', double-quant' if q.double_quant else ''})"
        )
    elif q.method == "fp8":
        parts.append(f"fp8 e4m3 weights (per-{q.fp8_scaling} scales)")
    else:
        g = f"groups of {q.group}" if q.group else "per-row"
        parts.append(f"{q.method} weights ({g}{', zero points' if q.has_zero_point else ''})")
    if isinstance(job, Inference):
        parts.append(f"{job.kv_quant or 'bf16'} KV cache")
        return ", ".join(parts)
    if job.lora is not None:
        parts.append(f"LoRA r={job.lora.rank} on {','.join(job.lora.modules)}")
    if job.precision == "bf16-master":
        parts.append("fp32 master weights")
    opt = job.optimizer or "no optimizer"
    parts.append({"adamw": "AdamW", "adam8bit": "8-bit Adam"}.get(opt, opt))
    recompute = {"full": "full", "selective": "selective", "op": "op-level selective"}
    parts.append(
        f"{recompute[job.recompute]} recompute" if job.recompute in recompute else "no recompute"
    )
    return ", ".join(parts)
