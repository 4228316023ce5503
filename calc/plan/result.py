"""What the capacity planner (``calc.plan``) returns: frozen results and their sentences.

Bytes stay bytes in every field; GiB (2**30 bytes) appear only in the ``text``/``verdict``
sentences.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from calc.config.jobs import Inference, Training
from calc.config.parallelism import Parallelism
from calc.data.gpus import GPU
from calc.estimate.result import GIB
from calc.plan.evidence import ErrorBar
from calc.plan.layouts import layout_of

Task = Literal["pretrain", "full-finetune", "lora", "qlora", "inference"]
TASKS: tuple[str, ...] = get_args(Task)
RankBy = Literal["throughput", "headroom"]
RANK_BYS: tuple[str, ...] = get_args(RankBy)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """One point of the planner's grid: a complete job for ``calc.estimate`` on some GPUs."""

    job: Training | Inference | None
    """The per-GPU job; ``calc.estimate(model, job, config.parallel)`` gives the same peak as
    the planner. None only for an invalid combination, which no job class accepts
    (``Evaluated.reason`` says why)."""
    gpu_count: int
    """GPUs the job runs on."""
    choices: Mapping[str, object]
    """The value of each axis (``{"precision": "bf16-master", ..., "micro_batch": 2}``), in
    axis order (``calc.plan.axes.AXES``): what a table of configurations shows."""
    grad_accum: int = 1
    """Micro-batches per optimizer step per data-parallel replica: ``global_batch / (dp x
    micro_batch)`` (training); 1 for inference."""

    @property
    def parallel(self) -> Parallelism | None:
        """The training layout over ``gpu_count`` GPUs (``calc.plan.layouts``); None for
        inference (each GPU serves its own share)."""
        label = self.choices.get("parallel")
        if label is None:
            return None
        return layout_of(label, self.gpu_count)


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluated:
    """One configuration with its peak and its verdict against the GPU."""

    config: Config
    """The configuration."""
    peak_bytes: int | None
    """Predicted peak per GPU in bytes (``calc.estimate(model, config.job).peak_bytes``); None
    when the cost model does not cover the configuration (see ``reason``)."""
    usable_bytes: int
    """What PyTorch's allocator may use on one GPU of this configuration
    (``GPU.usable_for(parallel)``: the total less the memory outside PyTorch, `calc.data.outside`,
    at the upper end of its sources' ranges)."""
    fits: bool
    """``peak_bytes <= usable_bytes``."""
    headroom_bytes: int | None
    """``usable_bytes - peak_bytes`` (negative: bytes missing); None when not modelled."""
    throughput_proxy: float
    """Relative throughput score (higher is better; ``calc.plan.throughput``): penalised for
    recomputed FLOPs and communication, rewarding bigger micro-batches. A ranking aid, not a
    time prediction."""
    reason: str
    """Why it is excluded (``peak 92.10 GiB > 78.65 GiB usable on h100-80gb: needs 13.45 GiB
    more``, ``not modelled: ...``, ``invalid: ...``); empty when it fits."""
    error_bar: ErrorBar | None = None
    """Observed error on the nearest verified cases; None if no case is near."""
    gpu_id: str = ""
    """Catalog id of the GPU the verdict is against."""
    peak_phase: str = ""
    """Phase of the step where the peak happens (``step2/backward``); empty if not modelled."""

    @property
    def headroom_pct(self) -> float | None:
        """Headroom as a percentage of usable memory (negative: missing)."""
        if self.headroom_bytes is None:
            return None
        return 100.0 * self.headroom_bytes / self.usable_bytes

    @property
    def modelled(self) -> bool:
        """False when the cost model does not cover this configuration or it is invalid."""
        return self.peak_bytes is not None

    def verdict(self) -> str:
        """``fits with 6.0% headroom (4.80 GiB of 80.00 GiB usable on h100-80gb); verified
        error on similar cases ≤1.2% (...)``, or why it does not fit."""
        if self.peak_bytes is None or self.headroom_bytes is None:
            return self.reason
        on = f" on {self.gpu_id}" if self.gpu_id else ""
        if self.fits:
            text = (
                f"fits with {self.headroom_pct:.1f}% headroom ({_gib(self.headroom_bytes)} of "
                f"{_gib(self.usable_bytes)} usable{on})"
            )
        else:
            text = (
                f"does not fit: peak {_gib(self.peak_bytes)} > {_gib(self.usable_bytes)} "
                f"usable{on}, needs {_gib(-self.headroom_bytes)} more"
            )
        if self.error_bar is not None:
            text += f"; {self.error_bar.text()}"
        return text


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """A change of one or two knobs that makes a configuration fit."""

    changes: Mapping[str, tuple[object, object]]
    """Axis -> (old value, new value); one entry, or two for a pair."""
    evaluated: Evaluated
    """The changed configuration with its new peak (it fits)."""

    def text(self) -> str:
        """``recompute: none -> full (peak 61.20 GiB, 17.45 GiB headroom)``."""
        knobs = ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in self.changes.items())
        ev = self.evaluated
        assert ev.peak_bytes is not None and ev.headroom_bytes is not None
        return f"{knobs} (peak {_gib(ev.peak_bytes)}, {_gib(ev.headroom_bytes)} headroom)"


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
    closest to fitting first, then the not modelled and the invalid ones."""
    rank_by: RankBy = "throughput"
    """The ranking key of ``fitting``."""
    n_configurations: int = 0
    """Configurations enumerated (``len(fitting) + len(excluded)``)."""
    axes: tuple[str, ...] = field(default_factory=tuple)
    """Names of the axes of ``Config.choices``, in order."""
    compiled_now: int = 0
    """Structures compiled for this answer (0 when every one came from the caches)."""

    @property
    def best(self) -> Evaluated | None:
        """The first fitting configuration, or None when nothing fits."""
        return self.fitting[0] if self.fitting else None

    def ranked(self, by: RankBy) -> tuple[Evaluated, ...]:
        """``fitting`` ranked by ``throughput`` (proxy, then headroom) or ``headroom``
        (headroom, then proxy)."""
        return rank(self.fitting, by)

    def verdict(self) -> str:
        """One line: the best configuration's verdict, or why nothing fits."""
        where = f"{self.gpu_count} x {self.gpu.id}"
        if self.best is not None:
            return f"{len(self.fitting)} of {self.n_configurations} configurations fit on {where}; best: {self.best.verdict()}"
        closest = next((e for e in self.excluded if e.modelled), None)
        if closest is None:
            reason = self.excluded[0].reason if self.excluded else "no configuration"
            return f"nothing fits on {where}: {reason}"
        return f"nothing fits on {where}; closest: {closest.verdict()}"


def rank(rows: tuple[Evaluated, ...], by: RankBy) -> tuple[Evaluated, ...]:
    """Fitting rows by throughput proxy then headroom, or by headroom then proxy (both
    descending); ties keep the grid order."""
    if by not in RANK_BYS:
        raise ValueError(f"rank_by={by!r} is not one of {', '.join(map(repr, RANK_BYS))}")
    if by == "throughput":
        return tuple(sorted(rows, key=lambda e: (-e.throughput_proxy, -(e.headroom_bytes or 0))))
    return tuple(sorted(rows, key=lambda e: (-(e.headroom_bytes or 0), -e.throughput_proxy)))


@dataclass(frozen=True, kw_only=True, slots=True)
class LeastHardware:
    """The least hardware that runs a job (any configuration of the grid)."""

    gpu: GPU
    """The GPU type asked about for ``min_count``."""
    min_count: int | None
    """Smallest count of ``gpu`` on which some configuration fits (None: none up to the
    largest count tried, or 2+ GPUs are not modelled for the task: see ``note``)."""
    min_count_best: Evaluated | None
    """The best configuration at ``min_count``."""
    smallest_gpu: GPU | None
    """The catalog GPU with the least usable memory on which some configuration fits on one
    GPU (None: none does)."""
    min_peak_bytes: int | None
    """The smallest single-GPU peak over the grid: the usable memory a GPU needs at least."""
    min_peak_best: Evaluated | None
    """The configuration with that smallest peak."""
    note: str = ""
    """What limited the search (counts tried, what is not modelled)."""
