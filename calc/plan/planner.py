"""`calc.plan`: the capacity planner. Which configurations of a job fit on which GPUs?

Given a model, a task, a sequence length, a global batch and a hardware budget (a GPU from the
catalog, ``calc.data.gpus``, and a count), the planner enumerates every configuration the cost model
covers (the axes of ``calc.plan.axes``: precision x optimizer x recompute x micro-batch on one
GPU; on 2+ GPUs training adds the parallel layout, ``calc.plan.layouts``; tasks ``lora`` and
``qlora`` train LoRA adapters over a 16-bit or nf4 base), evaluates the peak of all of them
with compiled, vectorised expressions (``calc.plan.grid``: the same timelines as
``calc.estimate``, persisted; on 2+ GPUs one table per class of ranks of each layout,
``calc.estimate.ranks.rank_replays``, with DDP's buckets as per-step constants; pipeline and context
parallelism, pruning and distillation on 2+ GPUs fall back to one ``calc.estimate`` call
each), so
every peak equals ``calc.estimate(model, config.job, config.parallel, gpu=gpu).peak_bytes``
(the GPU's cuBLAS workspace size, by compute capability: `calc.estimate.workspace`), and
returns those that fit, ranked by a throughput proxy (``calc.plan.throughput``) or by headroom, with the reason each
other one fails and the error observed on the nearest verified cases (``calc.plan.evidence``).

>>> import calc
>>> from calc import plan as P
>>> model = calc.load_card("qwen2.5-7b")
>>> p = P.plan(model, task="full-finetune", seq_len=2048, global_batch=8, gpu="h100-80gb")
>>> p.verdict()  # doctest: +SKIP
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace

from calc.config.jobs import DEVICES, Inference, Training, check_choice, check_size
from calc.config.model_spec import ModelSpec
from calc.data.gpus import GPU
from calc.estimate.core import SINGLE, ReplayOptions, too_large_message
from calc.plan import grid as plan_grid
from calc.plan.axes import TRAINING
from calc.plan.engine import (
    Evaluator,
    axis_values,
    base_fields_of,
    check_plannable,
    context,
    gpu_of,
    grid_entries,
    held_axes,
    job_context,
    kind_of,
    parallel_tables,
    split,
    verified_cases_of,
)
from calc.plan.evidence import ErrorBar
from calc.plan.result import (
    RANK_BYS,
    TASKS,
    Change,
    Config,
    Evaluated,
    LeastHardware,
    Plan,
    RankBy,
    Task,
)
from calc.plan.search import changes_to_fit, least_hardware

__all__ = [
    "TASKS", "Change", "Config", "ErrorBar", "Evaluated", "LeastHardware", "Plan", "Task",
    "changes_to_fit", "evaluate", "least_hardware", "plan", "precompile",
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# public functions


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
    report: Mapping | None = None,
    error_bars: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Plan:
    """Enumerate every configuration of ``task`` the cost model covers and rank those that fit.

    ``fixed`` pins axes to one value (``{"precision": "bf16-master"}``) or to a subset
    (``{"optimizer": ("adamw", "adam8bit")}``); an axis that is not enumerated by default
    (``optimizer_impl``, ``attention``, ``implementation``) is held at ``base``'s value unless
    ``fixed`` lists values for it. Other fields come from ``base`` (default: the job classes'
    defaults). Training: ``global_batch = gpu_count x micro_batch x grad_accum``; inference:
    each GPU serves ``global_batch / gpu_count`` sequences of ``seq_len`` tokens, in batches of
    ``micro_batch``. Error bars come from ``report`` (default: the latest verify report, read
    through ``calc.data.cards``). ``progress(done, total)`` is called per compiled structure.

    ``task="lora"``/``"qlora"``: the jobs get ``calc.LoRA(rank=16)`` (and ``calc.Quant(
    method="nf4")``) unless ``base`` sets them. Training on 2+ GPUs enumerates the layouts of
    ``calc.plan.layouts`` (axis ``parallel``) and holds ``precision`` and ``optimizer`` at
    ``base``'s values unless ``fixed`` lists them (``calc.plan.engine.HELD_ON_MANY_GPUS``: each
    layout compiles its own rank-class tables once; ``precompile(..., gpu_count=n)`` compiles
    them ahead, after which a plan in a new process reads them from the persistent cache).
    A derived model's training holds them on any GPU count (`calc.plan.engine.held_axes`:
    each job is a recording). Configurations the cost model does not cover are returned as excluded, ``not modelled:``.

    Raises ``ValueError`` for bad input (naming the field).
    """
    kind = kind_of(task)
    check_choice("device", device, DEVICES)
    check_choice("rank_by", rank_by, RANK_BYS)
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a calc.ModelSpec, got {type(model).__name__}")
    check_plannable(model, kind)
    if isinstance(base, Training) and base.compile != "none":
        raise ValueError(
            f"base.compile={base.compile!r}: the planner sweeps eager jobs; a compiled step is "
            "recorded per batch and sequence (seconds each), so estimate it with calc.estimate"
        )
    if isinstance(base, Inference) and base.padding != "none":
        raise ValueError(
            f"base.padding={base.padding!r}: the planner sweeps unpadded prompts; a padded "
            "batch is recorded from transformers' code per size, so estimate it with "
            "calc.estimate"
        )
    gpu_obj = gpu_of(gpu)
    ctx = context(kind, seq_len, global_batch, gpu_count)
    base_fields = base_fields_of(kind, base, task)
    grid_axes = axis_values(kind, ctx, fixed, base_fields, held_axes(model, kind, gpu_count))
    entries = grid_entries(kind, ctx, grid_axes, base_fields)
    ev = Evaluator(model, ctx, gpu_obj, device, verified_cases_of(report, error_bars), progress)
    rows = ev.run(entries)
    fitting, excluded = split(rows, rank_by)
    return Plan(
        model_name=model.name, task=task, seq_len=seq_len, global_batch=global_batch,
        gpu=gpu_obj, gpu_count=gpu_count, fitting=fitting, excluded=excluded, rank_by=rank_by,
        n_configurations=len(rows), axes=tuple(a.name for a, _ in grid_axes),
        compiled_now=ev.compiled_now,
    )  # fmt: skip


def precompile(
    model: ModelSpec,
    *,
    task: Task,
    seq_len: int = 2048,
    global_batch: int = 1,
    gpu_count: int = 1,
    fixed: Mapping[str, object] | None = None,
    base: Training | Inference | None = None,
    device: str = "cuda",
    progress: Callable[[int, int], None] | None = None,
    workers: int = 1,
) -> int:
    """Compile (into the persistent cache) every structure a plan of ``task`` on ``model``
    over ``gpu_count`` GPUs needs; returns how many were compiled now. ``progress(done,
    total)`` after each. Training on 2+ GPUs: the tables of every rank class of every layout
    (``calc.plan.engine.parallel_tables``); ``global_batch`` must then be a multiple of
    ``gpu_count`` (it decides the micro-batches, which do not change the structures).

    ``workers > 1`` compiles in that many processes (each structure is independent; the
    results meet in the persistent cache, so this needs a writable cache folder)."""
    kind = kind_of(task)
    check_plannable(model, kind)
    check_choice("device", device, DEVICES)
    check_size("workers", workers, 1, 1024)
    ctx = context(kind, seq_len, global_batch, gpu_count)
    base_fields = base_fields_of(kind, base, task)
    held = held_axes(model, kind, gpu_count)
    entries = grid_entries(kind, ctx, axis_values(kind, ctx, fixed, base_fields, held), base_fields)
    targets: dict = {}
    if kind == TRAINING and gpu_count > 1:
        targets = dict(parallel_tables(model, ctx, entries, device))
    else:
        for _, job in entries:
            if not isinstance(job, str):
                targets.setdefault(plan_grid.structure_id(model, job), (model, job, SINGLE))
        if kind == TRAINING:  # grad_accum 1 and >= 2 are two structures: compile both
            for _m, job, _o in list(targets.values()):
                other = replace(job, grad_accum=2 if job.grad_accum == 1 else 1)
                targets.setdefault(plan_grid.structure_id(model, other), (model, other, SINGLE))
    jobs = list(targets.values())
    if workers > 1 and len(jobs) > 1:
        return _precompile_parallel(jobs, device, progress, workers)
    compiled = 0
    for n, (local, job, opts) in enumerate(jobs):
        if progress is not None:
            progress(n, len(jobs))
        compiled += int(_compile_one(local, job, device, opts))
    if progress is not None:
        progress(len(jobs), len(jobs))
    return compiled


def _compile_one(
    model: ModelSpec, job: Training | Inference, device: str, opts: ReplayOptions = SINGLE
) -> bool:
    """Worker of ``precompile``: compile one structure into the persistent cache."""
    return plan_grid.structure_table(model, job, device, opts=opts)[1]


def _precompile_parallel(
    jobs: list, device: str, progress: Callable[[int, int], None] | None, workers: int,
) -> int:  # fmt: skip
    compiled = 0
    ctx = multiprocessing.get_context("spawn")  # no forked BLAS or sympy state
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_compile_one, m, job, device, opts) for m, job, opts in jobs]
        for n, fut in enumerate(as_completed(futures)):
            compiled += int(fut.result())
            if progress is not None:
                progress(n + 1, len(jobs))
    for m, job, opts in jobs:  # read the results back into this process (from the cache)
        plan_grid.structure_table(m, job, device, opts=opts)
    return compiled


def evaluate(
    model: ModelSpec,
    job: Training | Inference,
    *,
    gpu: str | GPU,
    gpu_count: int = 1,
    device: str = "cuda",
    report: Mapping | None = None,
    error_bars: bool = True,
    parallel: str | None = None,
) -> Evaluated:
    """One job against a GPU: the same ``Evaluated`` (peak, verdict, error bar) as a plan row.

    ``parallel``: a layout label of ``calc.plan.layouts`` for training on 2+ GPUs (default:
    DDP over all of them). The peak is ``calc.estimate(model, job, config.parallel,
    device, gpu=gpu).peak_bytes``."""
    if not isinstance(job, Training | Inference):
        raise ValueError(f"job must be calc.Training or calc.Inference, got {type(job).__name__}")
    check_choice("device", device, DEVICES)
    ctx = job_context(job, gpu_count, parallel)
    cases = verified_cases_of(report, error_bars)
    ev = Evaluator(model, ctx, gpu_of(gpu), device, cases, layout=parallel)
    try:
        return ev.run([(ev.choices(job), job)])[0]
    except OverflowError:  # the grid's exact-int64 guard (calc.plan.grid_eval)
        raise ValueError(too_large_message(model, job)) from None
