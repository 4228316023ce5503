"""`calc.plan`: the capacity planner. Which configurations of a job fit on which GPUs?

Given a model, a task, a sequence length, a global batch and a hardware budget (a GPU from the
catalog, ``calc.gpus``, and a count), the planner enumerates every configuration the cost model
covers (the axes of ``calc.plan_axes``: precision x optimizer x recompute x micro-batch today;
parallelism and compression add axes there), evaluates the peak of all of them at once with
compiled, vectorised expressions (``calc.plan_grid``), and returns those that fit, ranked, with
the reason each other one fails.

>>> import calc
>>> from calc import plan as P
>>> model = calc.load_card("qwen2.5-7b")
>>> p = P.plan(model, task="full-finetune", seq_len=2048, global_batch=8, gpu="h100-80gb")
>>> p.best.config.job  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from calc.gpus import GPU
from calc.jobs import Inference, Training
from calc.model_spec import ModelSpec

Task = Literal["pretrain", "full-finetune", "lora", "qlora", "inference"]
TASKS: tuple[str, ...] = get_args(Task)
RankBy = Literal["throughput", "headroom"]
RANK_BYS: tuple[str, ...] = get_args(RankBy)


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """One point of the planner's grid: a complete job for ``calc.estimate`` on some GPUs."""

    job: Training | Inference
    """The per-GPU job; ``calc.estimate(model, job)`` gives the same peak as the planner."""
    gpu_count: int
    """GPUs the job runs on (without parallelism axes, each holds a full replica)."""
    choices: Mapping[str, object]
    """The value of each enumerated axis (``{"precision": "bf16-master", "micro_batch": 2,
    ...}``), in axis order; what a table of configurations shows."""
    grad_accum: int = 1
    """Micro-batches per optimizer step per GPU: ``global_batch / (gpu_count x micro_batch)``
    (training); 1 for inference."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorBar:
    """The error ``python -m verify`` observed on the verified cases nearest to a config."""

    max_abs_error_pct: float
    """Largest absolute relative error (%) of the peak over those cases."""
    cases: tuple[str, ...]
    """Names of the verify cases used (``verify/reports/latest/report.json``)."""
    similarity: str
    """What the cases share with the config (e.g. ``implementation=hf, precision=bf16-master,
    optimizer=adamw, recompute=full``)."""
    measured_on: str
    """What the cases measured (``cpu`` storage tracker or ``cuda``), so the reader knows
    which terms the evidence covers."""

    def text(self) -> str:
        """``verified error on similar cases ≤1.2% (3 cases)``."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluated:
    """One configuration with its peak and its verdict against the GPU."""

    config: Config
    """The configuration."""
    peak_bytes: int | None
    """Predicted peak per GPU in bytes (``calc.estimate(model, config.job).peak_bytes``); None
    when the cost model does not cover the configuration (see ``reason``)."""
    usable_bytes: int
    """Usable memory of one GPU (``GPU.usable_bytes``)."""
    fits: bool
    """``peak_bytes <= usable_bytes``."""
    headroom_bytes: int | None
    """``usable_bytes - peak_bytes`` (negative: bytes missing); None when not modelled."""
    throughput_proxy: float
    """Relative throughput score (higher is better; ``calc.throughput``): tokens per unit of
    compute work, penalised for recomputed FLOPs and communication, rewarding bigger
    micro-batches. A ranking aid, not a time prediction."""
    reason: str
    """Why it is excluded (``peak 92.10 GiB > 79.20 GiB usable: needs 12.90 GiB more``, ``not
    modelled: ...``, ``invalid: ...``); empty when it fits."""
    error_bar: ErrorBar | None = None
    """Observed error on the nearest verified cases; None if no case is near."""

    @property
    def headroom_pct(self) -> float | None:
        """Headroom as a percentage of usable memory."""
        raise NotImplementedError

    def verdict(self) -> str:
        """``fits with 6.0% headroom (4.80 GiB of 80.00 GiB usable); verified error on similar
        cases ≤1.2%`` or ``does not fit: ...``."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """A change of one or two knobs that makes a configuration fit."""

    changes: Mapping[str, tuple[object, object]]
    """Axis -> (old value, new value); one entry, or two for a pair."""
    evaluated: Evaluated
    """The changed configuration with its new peak (it fits)."""

    def text(self) -> str:
        """``recompute: none -> full (peak 61.2 GiB, 18.8 GiB headroom)``."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The planner's answer for one request."""

    model_name: str
    """``ModelSpec.name`` of the model planned."""
    task: Task
    """The task planned."""
    seq_len: int
    """Tokens per sequence (training) or context tokens (inference)."""
    global_batch: int
    """Sequences per optimizer step over all GPUs (training) or sequences served (inference)."""
    gpu: GPU
    """The GPU type."""
    gpu_count: int
    """GPUs available."""
    fitting: tuple[Evaluated, ...]
    """Configurations that fit, best first (``rank_by``, ties broken by the other key)."""
    excluded: tuple[Evaluated, ...]
    """Configurations that do not fit or are not modelled, each with its ``reason``; those
    closest to fitting first."""
    rank_by: RankBy = "throughput"
    """The ranking key of ``fitting``."""
    n_configurations: int = 0
    """Configurations enumerated (``len(fitting) + len(excluded)``)."""
    axes: tuple[str, ...] = field(default_factory=tuple)
    """Names of the axes enumerated, in order."""

    @property
    def best(self) -> Evaluated | None:
        """The first fitting configuration, or None when nothing fits."""
        raise NotImplementedError

    def ranked(self, by: RankBy) -> tuple[Evaluated, ...]:
        """``fitting`` ranked by ``throughput`` (proxy, then headroom) or ``headroom``."""
        raise NotImplementedError

    def verdict(self) -> str:
        """One line: the best configuration's verdict, or why nothing fits."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True, slots=True)
class LeastHardware:
    """The least hardware that runs a job (any configuration of the grid)."""

    gpu: GPU
    """The GPU type asked about for ``min_count``."""
    min_count: int | None
    """Smallest count of ``gpu`` on which some configuration fits (None: none up to
    ``max_count``)."""
    min_count_best: Evaluated | None
    """The best configuration at ``min_count``."""
    smallest_gpu: GPU | None
    """The catalog GPU with the least usable memory on which some configuration fits on one
    GPU (None: none does)."""
    min_peak_bytes: int | None
    """The smallest single-GPU peak over the grid: the memory a GPU needs at least."""
    min_peak_best: Evaluated | None
    """The configuration with that smallest peak."""


def plan(
    model: ModelSpec,
    *,
    task: Task,
    seq_len: int,
    global_batch: int,
    gpu: str | GPU,
    gpu_count: int = 1,
    fixed: Mapping[str, object] | None = None,
    base: Training | Inference | None = None,
    rank_by: RankBy = "throughput",
    device: str = "cuda",
) -> Plan:
    """Enumerate every configuration of ``task`` the cost model covers and rank those that fit.

    ``fixed`` pins axes to one value (``{"precision": "bf16-master"}``) or to a subset
    (``{"optimizer": ("adamw", "adam8bit")}``); unknown axes or values raise ``ValueError``.
    Fields that are not axes come from ``base`` (default: the job classes' defaults). Peaks
    are ``calc.estimate``'s, evaluated in bulk (``calc.plan_grid``); error bars come from the
    latest verify report (``calc.evidence``).
    """
    raise NotImplementedError


def least_hardware(
    model: ModelSpec,
    *,
    task: Task,
    seq_len: int,
    global_batch: int,
    gpu: str | GPU,
    max_count: int = 1024,
    fixed: Mapping[str, object] | None = None,
    base: Training | Inference | None = None,
    device: str = "cuda",
) -> LeastHardware:
    """The smallest count of ``gpu`` (powers of two and divisors of ``global_batch`` up to
    ``max_count``) and the smallest single catalog GPU on which some configuration fits."""
    raise NotImplementedError


def changes_to_fit(
    model: ModelSpec,
    job: Training | Inference,
    *,
    gpu: str | GPU,
    gpu_count: int = 1,
    global_batch: int | None = None,
    max_results: int = 10,
    device: str = "cuda",
) -> tuple[Change, ...]:
    """The smallest changes that make ``job`` fit: every single-axis change that fits, then
    (only for axes no single change fixes) pairs, each with its new peak; ordered by the
    size of the change (one knob before two), then by throughput proxy, then headroom.

    A job that already fits returns ``()``. The global batch (default ``micro_batch x
    grad_accum x gpu_count``) is kept: a smaller micro-batch means more accumulation.
    """
    raise NotImplementedError
