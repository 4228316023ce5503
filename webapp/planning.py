"""The planner page's calls into ``calc.plan``, cached across reruns (``st.cache_resource``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import streamlit as st

import calc
from calc.plan import planner
from calc.plan.axes import INFERENCE, TRAINING, axes_for
from calc.plan.engine import held_axes
from calc.present import display
from webapp.model_source import Model

COLUMNS = {
    "peak_gib": st.column_config.NumberColumn("peak GiB", format="%.2f"),
    "headroom_gib": st.column_config.NumberColumn("headroom GiB", format="%.2f"),
    "headroom_pct": st.column_config.NumberColumn("headroom %", format="%.1f"),
    "throughput_proxy": st.column_config.NumberColumn("throughput proxy", format="%.3f"),
}
"""How the planner's tables show their numbers."""


def enumerated_and_held(result: planner.Plan) -> tuple[list[str], dict[str, object]]:
    """The axes whose value differs between the plan's configurations (fitting or not), and the
    value of each other axis, the same in every row: what the planner really enumerated and held
    (on 2+ GPUs it enumerates the layout; a recipe the task fixes is held even when asked)."""
    rows = display.plan_rows([*result.fitting, *result.excluded])
    axes = [*result.axes, "grad_accum"]
    varying = [a for a in axes if len({repr(r.get(a)) for r in rows}) > 1]
    held = {a: rows[0].get(a) for a in axes if a not in varying} if rows else {}
    return varying, held


def kind(task: str) -> str:
    """``training`` or ``inference`` for a planner task."""
    return INFERENCE if task == "inference" else TRAINING


def explorable(task: str) -> tuple[str, ...]:
    """The axes the user may ask the planner to enumerate (``calc.plan.axes``; the micro-batch
    is always enumerated, in bulk)."""
    return tuple(a.name for a in axes_for(kind(task)) if a.enumerated and not a.size)


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """One planner question (hashable: the cache key)."""

    model_key: str
    """``webapp.cached.model_key`` of the model."""
    task: str
    """A ``calc.plan.planner.TASKS`` entry."""
    seq_len: int
    """Tokens per sequence (inference: context)."""
    global_batch: int
    """Sequences per optimizer step over all GPUs (inference: served)."""
    gpu: str
    """GPU catalog id."""
    gpu_count: int
    """GPUs available."""
    rank_by: str
    """``throughput`` or ``headroom``."""
    device: str
    """``cuda`` or ``cpu``."""
    base: calc.Training | calc.Inference | None
    """The sidebar's job when it is of the task's kind: the axes not explored keep its values."""
    fixed: tuple[tuple[str, object], ...]
    """Axes pinned to the base job's value (those the user did not ask to explore)."""

    @staticmethod
    def make(
        *, model_key: str, task: str, seq_len: int, global_batch: int, gpu: str,
        gpu_count: int, rank_by: str, device: str, job: calc.Training | calc.Inference,
        explore: tuple[str, ...], held: tuple[str, ...] = (),
    ) -> Request:  # fmt: skip
        """A request whose unexplored axes hold the sidebar job's values; so do those in
        ``held`` (`held_by`: a derived model's structural training axes), explored or not."""
        same_kind = isinstance(job, calc.Inference) == (kind(task) == INFERENCE)
        base = job if same_kind else None
        if isinstance(base, calc.Training) and base.compile != "none":
            base = replace(base, compile="none")  # the planner sweeps eager jobs
        if isinstance(base, calc.Inference) and base.padding != "none":
            base = replace(base, padding="none")  # and unpadded prompts
        # ``Axis.current``: the job's value on each axis (None for the layout, which a job does
        # not carry: the planner then enumerates the layouts of ``gpu_count`` GPUs).
        pinned = [a for a in axes_for(kind(task)) if a.name in explorable(task)]
        fixed = tuple(
            (a.name, a.current(base)) for a in pinned
            if (a.name not in explore or a.name in held) and a.current(base) is not None
        ) if base is not None else ()  # fmt: skip
        return Request(
            model_key=model_key, task=task, seq_len=seq_len, global_batch=global_batch,
            gpu=gpu, gpu_count=gpu_count, rank_by=rank_by, device=device, base=base, fixed=fixed,
        )  # fmt: skip


def default_task(sidebar_task: str) -> str:
    """The planner's task when the page has none yet: serving for an inference sidebar."""
    return "inference" if sidebar_task == "infer" else "full-finetune"


def held_by(model: calc.ModelSpec, task: str) -> tuple[str, ...]:
    """The axes ``task``'s plan of ``model`` holds at the sidebar's values even when explored
    (`calc.plan.engine.held_axes` on one GPU: a derived model's precision and optimizer, each
    value a recording of transformers' code)."""
    return held_axes(model, kind(task), 1)


def page_request(
    model_key: str, state: Mapping[str, object], sidebar_task: str, gpu: str,
    device: str, job: calc.Training | calc.Inference, spec: calc.ModelSpec | None = None,
) -> Request:  # fmt: skip
    """The request the planner page makes from the page state (its widgets' values); with
    ``spec``, the axes `held_by` the model stay at the sidebar's values."""
    seq_len = job.seq_len if isinstance(job, calc.Training) else job.context
    task = str(state["plan.task"] or default_task(sidebar_task))
    held = held_by(spec, task) if spec is not None else ()
    return Request.make(
        model_key=model_key, task=task,
        seq_len=seq_len, global_batch=int(state["plan.global_batch"]),  # type: ignore[call-overload]
        gpu=gpu, gpu_count=int(state["plan.gpu_count"]),  # type: ignore[call-overload]
        rank_by=str(state["plan.rank_by"]), device=device, job=job,
        explore=tuple(state["plan.explore"]), held=held,  # type: ignore[arg-type]
    )  # fmt: skip


def precompile_args(request: Request) -> dict[str, Any]:
    """`calc.plan.planner.precompile`'s keyword arguments for ``request`` (the page's
    precompile and the calculator's background one use the same)."""
    return dict(
        task=request.task, seq_len=request.seq_len, global_batch=request.global_batch,
        gpu_count=request.gpu_count, fixed=dict(request.fixed), base=request.base,
        device=request.device,
    )  # fmt: skip


def _progress_bar(text: str) -> tuple[Callable[[int, int], None], object]:
    bar = st.progress(0.0, text=text)

    def progress(done: int, total: int) -> None:
        bar.progress(done / max(total, 1), text=f"{text} {done} of {total}")

    return progress, bar


@st.cache_resource(max_entries=64, show_spinner=False)
def _precompile(_model: Model, request: Request) -> int:
    progress, bar = _progress_bar("compiling the planner's structures (first use only):")
    compiled = planner.precompile(_model.spec, **precompile_args(request), progress=progress)
    bar.empty()  # type: ignore[attr-defined]
    return compiled


def precompile(model: Model, request: Request) -> int:
    """Compile every structure the plan needs, with a progress bar (a structure, or a rank
    class of a multi-GPU layout, costs 0.3-0.8 s the first time, ``benchmarks/bench_compile.py``;
    calc's persistent cache keeps it for later servers)."""
    return _precompile(model, request)


@st.cache_resource(max_entries=128, show_spinner="planning...")
def _plan(_model: Model, request: Request) -> planner.Plan:
    return planner.plan(
        _model.spec, task=request.task, seq_len=request.seq_len,
        global_batch=request.global_batch, gpu=request.gpu, gpu_count=request.gpu_count,
        fixed=dict(request.fixed), base=request.base, rank_by=request.rank_by,
        device=request.device,
    )  # fmt: skip


def plan(model: Model, request: Request) -> planner.Plan:
    """``calc.plan.planner.plan`` for the request."""
    return _plan(model, request)


@st.cache_resource(max_entries=128, show_spinner="looking for the least hardware...")
def _least(_model: Model, request: Request) -> planner.LeastHardware:
    return planner.least_hardware(
        _model.spec, task=request.task, seq_len=request.seq_len,
        global_batch=request.global_batch, gpu=request.gpu, fixed=dict(request.fixed),
        base=request.base, device=request.device,
    )  # fmt: skip


def least_hardware(model: Model, request: Request) -> planner.LeastHardware:
    """``calc.plan.planner.least_hardware`` for the request."""
    return _least(model, request)


def least_hardware_text(least: planner.LeastHardware) -> str:
    """Markdown bullets: the smallest count of the GPU, and the smallest single GPU."""
    name = least.gpu.name
    if least.min_count is None:
        count = f"- No count of {name} up to the search limit runs it."
    else:
        count = f"- Smallest count of {name}: **{least.min_count}**"
        if least.min_count_best is not None:
            count += f" ({least.min_count_best.verdict()})"
    if least.smallest_gpu is None:
        single = "- No single GPU of the catalog holds any configuration."
    else:
        single = f"- Smallest single GPU that holds a configuration: **{least.smallest_gpu.name}**"
    if least.min_peak_bytes is not None:
        gib = display.gib(least.min_peak_bytes)
        single += f"; the least memory any configuration needs: {gib:.2f} GiB"
    note = f"\n- {least.note}" if least.note else ""
    return f"{count}\n{single}{note}"


@st.cache_resource(max_entries=128, show_spinner="looking for changes that make it fit...")
def _changes(
    _model: Model, request: Request, job: calc.Training | calc.Inference
) -> tuple[planner.Change, ...]:
    return planner.changes_to_fit(
        _model.spec, job, gpu=request.gpu, gpu_count=request.gpu_count, device=request.device
    )


def changes_to_fit(
    model: Model, request: Request, job: calc.Training | calc.Inference
) -> tuple[planner.Change, ...]:
    """``calc.plan.planner.changes_to_fit`` for the sidebar's job on the request's GPUs (``()`` when
    it already fits)."""
    return _changes(model, request, job)
