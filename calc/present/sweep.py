"""Peak memory as one size of a job varies: the data of the web calculator's sweep charts.

A sweep changes one integer field of a job (``seq_len`` or ``micro_batch`` of a
``calc.Training``; ``context`` or ``batch`` of a ``calc.Inference``) and keeps every other
field. The sizes are symbols of the compiled expressions (``calc.estimate``), so a sweep replays
nothing: each point is one compiled evaluation (about 0.1 ms), not a sympy computation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.estimate.api import estimate

SWEEP_FIELDS: dict[type, tuple[str, ...]] = {
    Training: ("seq_len", "micro_batch"),
    Inference: ("context", "batch"),
}
"""The fields a sweep may vary, per job class: the sequence-like size, then the batch-like one."""

MAX_POINTS = 64
"""Most points one sweep evaluates (a chart needs a few dozen)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    """Peak bytes of a job at each value of one of its sizes."""

    field: str
    """The job field that varies (``seq_len``, ``micro_batch``, ``context`` or ``batch``)."""
    values: tuple[int, ...]
    """The values of ``field`` evaluated, ascending."""
    peak_bytes: tuple[int | None, ...]
    """Predicted peak at each value; None where the job is invalid or not modelled there."""
    errors: tuple[str, ...]
    """One message per value that has no peak (``field=value: reason``)."""


def doubling_values(current: int, low: int = 1, high: int = 1 << 20, points: int = 12) -> list[int]:
    """Powers of two from ``low`` up to ``high`` (at most ``points`` of them, centred on
    ``current`` where the range allows), plus ``current`` itself, ascending."""
    if points < 1 or points > MAX_POINTS:
        raise ValueError(f"points={points} is out of range: allowed [1, {MAX_POINTS}]")
    if not 1 <= low <= high:
        raise ValueError(f"low={low}, high={high}: need 1 <= low <= high")
    powers = []
    p = 1
    while p <= high:
        if p >= low:
            powers.append(p)
        p *= 2
    if not powers:
        return [current] if low <= current <= high else []
    # The window of `points` powers whose centre is nearest to `current`.
    below = sum(1 for v in powers if v < current)
    start = max(0, min(below - points // 2, len(powers) - points))
    chosen = set(powers[start : start + points])
    if low <= current <= high:
        chosen.add(current)
    return sorted(chosen)


def sweep(
    model: ModelSpec,
    job: Training | Inference,
    field: str,
    values: Sequence[int],
    device: str = "cuda",
) -> Sweep:
    """Peak bytes of ``job`` with ``field`` set to each of ``values`` (``calc.estimate`` per
    point; every point of one sweep shares one compiled structure unless a value crosses a
    structural boundary, e.g. an inference context reaching the model's sliding window).

    Raises ``ValueError`` for a field that is not sweepable for this job or too many values.
    """
    allowed = SWEEP_FIELDS.get(type(job), ())
    if field not in allowed:
        raise ValueError(f"field={field!r} is not one of {allowed} for {type(job).__name__}")
    if len(values) > MAX_POINTS:
        raise ValueError(f"values has {len(values)} entries: allowed at most {MAX_POINTS}")
    ordered = sorted(set(values))
    peaks: list[int | None] = []
    errors: list[str] = []
    for value in ordered:
        try:
            point = _with_size(job, field, value)
            peaks.append(int(estimate(model, point, device=device).peak_bytes))
        except (ValueError, NotImplementedError, OverflowError) as exc:
            peaks.append(None)
            errors.append(f"{field}={value}: {exc}")
    return Sweep(field=field, values=tuple(ordered), peak_bytes=tuple(peaks), errors=tuple(errors))


def _with_size(job: Training | Inference, field: str, value: int) -> Training | Inference:
    """``job`` with ``field`` set to ``value``; an inference prompt longer than the swept
    context is shortened to it (a prompt cannot exceed the context)."""
    if isinstance(job, Inference) and field == "context" and job.prompt is not None:
        return replace(job, context=value, prompt=min(job.prompt, value))
    size: dict[str, Any] = {field: value}  # a field of SWEEP_FIELDS, checked by `sweep`
    return replace(job, **size)
