"""Searches over the planner's grid: the least hardware for a job, and what to change to fit.

Both evaluate through ``calc.plan.engine`` (the compiled, vectorised peaks of
``calc.plan.grid``), so every peak they report equals ``calc.estimate``'s for the same job.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from calc.config.jobs import DEVICES, Inference, Training, check_choice, check_size
from calc.config.model_spec import ModelSpec
from calc.data.gpus import GPU, gpu_catalog
from calc.plan import engine
from calc.plan.axes import TRAINING, Axis, Context, axes_for
from calc.plan.result import Change, Evaluated, LeastHardware, Task, rank


def _counts(global_batch: int, max_count: int) -> list[int]:
    """GPU counts tried: powers of two that divide the global batch (each GPU takes whole
    sequences; every count compiles its layouts' replays, so only the counts clusters come in)."""
    out, n = [], 1
    while n <= min(global_batch, max_count):
        if global_batch % n == 0:
            out.append(n)
        n *= 2
    return out


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
    report: Mapping | None = None,
    error_bars: bool = True,
) -> LeastHardware:
    """The smallest count of ``gpu`` on which some configuration of the grid fits (powers of
    two that divide ``global_batch``, up to ``max_count``; training on 2+ GPUs enumerates the
    parallel layouts of ``calc.plan.layouts``), and the smallest single GPU: the least peak
    over the grid on one GPU, and the catalog GPU with the least usable memory above it."""
    kind = engine.kind_of(task)
    engine.check_plannable(model, kind)
    check_choice("device", device, DEVICES)
    check_size("max_count", max_count, 1, 1 << 16)
    gpu_obj = engine.gpu_of(gpu)
    cases = engine.verified_cases_of(report, error_bars)
    base_fields = engine.base_fields_of(kind, base, task)

    def held(count: int) -> tuple[str, ...]:
        return engine.held_axes(model, kind, count)

    def rows_at(count: int, target: GPU) -> list[Evaluated]:
        ctx = engine.context(kind, seq_len, global_batch, count)
        entries = engine.grid_entries(
            kind, ctx, engine.axis_values(kind, ctx, fixed, base_fields, held(count)), base_fields
        )
        return engine.Evaluator(model, ctx, target, device, cases).run(entries)

    one = rows_at(1, gpu_obj)
    modelled = [e for e in one if e.modelled]
    min_best = min(modelled, key=lambda e: (e.peak_bytes, -e.throughput_proxy), default=None)
    min_peak = min_best.peak_bytes if min_best is not None else None
    smallest = None
    if min_peak is not None:
        smallest = next((g for g in gpu_catalog().values() if g.usable_bytes >= min_peak), None)
    notes = []
    counts = _counts(global_batch, max_count)
    min_count, min_count_best = None, None
    for count in counts:
        rows = one if count == 1 else rows_at(count, gpu_obj)
        fitting = rank(tuple(e for e in rows if e.fits), "throughput")
        if fitting:
            min_count, min_count_best = count, fitting[0]
            break
    else:
        notes.append(f"no configuration fits on up to {counts[-1]} x {gpu_obj.id}")
    return LeastHardware(
        gpu=gpu_obj, min_count=min_count, min_count_best=min_count_best, smallest_gpu=smallest,
        min_peak_bytes=min_peak, min_peak_best=min_best, note="; ".join(notes),
    )  # fmt: skip


def _changed(
    kind: str, job: Training | Inference, ctx: Context, changes: Mapping[Axis, object],
    layout: object = None,
) -> Training | Inference | str:  # fmt: skip
    fields = {
        f: getattr(job, f)
        for f in job.__slots__
        if f not in ("micro_batch", "seq_len", "grad_accum", "batch", "context")
    }
    if layout is not None:  # the (new) layout first: grad_accum is per data-parallel replica
        fields["parallel"] = next((v for a, v in changes.items() if a.name == "parallel"), layout)
    for axis in axes_for(kind):  # keep the job's micro-batch unless it is changed
        if axis.size:
            axis.apply(fields, changes.get(axis, axis.current(job)), ctx)
    for axis, value in changes.items():
        if not axis.size:
            axis.apply(fields, value, ctx)
    try:
        return engine.make_job(kind, fields, ctx)
    except ValueError as exc:
        return f"invalid: {exc}"


def changes_to_fit(
    model: ModelSpec,
    job: Training | Inference,
    *,
    gpu: str | GPU,
    gpu_count: int = 1,
    max_results: int = 10,
    knobs: Sequence[str] | None = None,
    device: str = "cuda",
    report: Mapping | None = None,
    error_bars: bool = True,
    parallel: str | None = None,
) -> tuple[Change, ...]:
    """The smallest changes that make ``job`` fit on ``gpu``: first one knob at a time, then
    pairs of knobs (only pairs neither of whose single changes fits alone), each with its new
    peak. Per knob (or pair of knobs) the value with the best throughput proxy, then the most
    headroom, is kept; singles come before pairs, each group ranked by proxy then headroom.

    ``knobs`` names the axes that may change (default: the axes a plan enumerates by default,
    ``parallel`` (the layout, on 2+ GPUs), ``precision``, ``optimizer``, ``recompute``,
    ``micro_batch``, whose structures a plan of the same job has already compiled; add e.g.
    ``attention`` or ``optimizer_impl``). The global
    batch is kept (``micro_batch x grad_accum x gpu_count``): a smaller micro-batch means more
    accumulation steps. ``parallel``: the job's layout on 2+ GPUs (``calc.plan.layouts``
    label; default DDP), kept by every change. A job that already fits returns ``()``."""
    if not isinstance(job, Training | Inference):
        raise ValueError(f"job must be calc.Training or calc.Inference, got {type(job).__name__}")
    kind = TRAINING if isinstance(job, Training) else "inference"
    engine.check_plannable(model, kind)
    check_choice("device", device, DEVICES)
    check_size("max_results", max_results, 1, 1 << 16)
    gpu_obj = engine.gpu_of(gpu)
    ctx = engine.job_context(job, gpu_count, parallel)
    cases = engine.verified_cases_of(report, error_bars)
    ev = engine.Evaluator(model, ctx, gpu_obj, device, cases, layout=parallel)
    current = ev.run([(ev.choices(job), job)])[0]
    if current.fits:
        return ()
    allowed = {a.name: a for a in axes_for(kind) if a.knob}
    if knobs is None:  # a derived model's training holds its structural axes unless named
        held = engine.held_axes(model, kind, 1)
        chosen = [a for a in allowed.values() if a.enumerated and a.name not in held]
    else:
        for name in knobs:
            if name not in allowed:
                raise ValueError(f"knobs: {name!r} is not one of {', '.join(allowed)}")
        chosen = [a for a in allowed.values() if a.name in knobs]
    active = chosen
    now = ev.choices(job)  # the job's value on each axis (its layout resolved)
    options = {a: [v for v in a.values(ctx) if v != now[a.name]] for a in active}

    def run(combos: list[dict]) -> list[tuple[dict, Evaluated]]:
        entries = []
        for combo in combos:
            new = _changed(kind, job, ctx, combo, now.get("parallel"))
            choices = ev.choices(new) if not isinstance(new, str) else {}
            for a, v in combo.items():
                if a.name == "parallel":  # a job does not carry its layout: the row does
                    choices["parallel"] = v
            entries.append((choices, new))
        return list(zip(combos, ev.run(entries), strict=True)) if entries else []

    single_rows = run([{a: v} for a in active for v in options[a]])
    fitting_alone = {
        (a.name, v) for combo, row in single_rows if row.fits for a, v in combo.items()
    }
    pair_rows = run(
        [
            {a1: v1, a2: v2}
            for a1, a2 in itertools.combinations(active, 2)
            for v1 in options[a1]
            for v2 in options[a2]
            if (a1.name, v1) not in fitting_alone and (a2.name, v2) not in fitting_alone
        ]
    )
    ordered = _order(_best_per_axes(now, single_rows)) + _order(_best_per_axes(now, pair_rows))
    return tuple(ordered[:max_results])


def _best_per_axes(now: Mapping, rows: list[tuple[dict, Evaluated]]) -> list[Change]:
    """The fitting change of best proxy (then headroom) for each set of changed axes."""
    out: dict[tuple, Change] = {}
    for combo, row in rows:
        if not row.fits:
            continue
        key = tuple(a.name for a in combo)
        if key not in out or _better(row, out[key].evaluated):
            out[key] = Change(
                changes={a.name: (now[a.name], v) for a, v in combo.items()}, evaluated=row
            )
    return list(out.values())


def _better(a: Evaluated, b: Evaluated) -> bool:
    return (a.throughput_proxy, a.headroom_bytes or 0) > (b.throughput_proxy, b.headroom_bytes or 0)


def _order(changes: Iterable[Change]) -> list[Change]:
    return sorted(
        changes,
        key=lambda c: (-c.evaluated.throughput_proxy, -(c.evaluated.headroom_bytes or 0)),
    )
