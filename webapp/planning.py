"""The planner page's calls into ``calc.plan``, cached across reruns (``st.cache_resource``)."""

from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

import calc
from calc import display
from calc import plan as planner
from webapp.cached import estimate, model_key
from webapp.model_source import Model

__all__ = ["COLUMNS", "Request", "changes_to_fit", "least_hardware", "model_key", "plan"]

COLUMNS = {
    "peak_gib": st.column_config.NumberColumn("peak GiB", format="%.2f"),
    "headroom_gib": st.column_config.NumberColumn("headroom GiB", format="%.2f"),
    "headroom_pct": st.column_config.NumberColumn("headroom %", format="%.1f"),
    "throughput_proxy": st.column_config.NumberColumn("throughput proxy", format="%.3f"),
}
"""How the planner's tables show their numbers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """One planner question (hashable: the cache key)."""

    model_key: str
    """``webapp.cached.model_key`` of the model."""
    task: str
    """A ``calc.plan.TASKS`` entry."""
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


def precompile(model: Model, request: Request) -> None:
    """Compile every structure the plan needs, once per server, with a progress bar (the first
    plan of a model compiles a few dozen structures, ~1.5 s each, unless calc's persistent
    cache already holds them)."""
    _precompile(model, request.model_key, request.task, request.device)


@st.cache_resource(max_entries=64, show_spinner=False)
def _precompile(_model: Model, key: str, task: str, device: str) -> bool:
    from calc import plan_grid

    bar = st.progress(0.0, text="compiling the planner's expressions (first use only)...")

    def progress(done: int, total: int) -> None:
        bar.progress(done / max(total, 1), text=f"compiling structure {done} of {total}...")

    plan_grid.precompile(_model.spec, task, progress=progress)
    bar.empty()
    return True


@st.cache_resource(max_entries=128, show_spinner="planning...")
def _plan(_model: Model, request: Request) -> planner.Plan:
    return planner.plan(
        _model.spec,
        task=request.task,
        seq_len=request.seq_len,
        global_batch=request.global_batch,
        gpu=request.gpu,
        gpu_count=request.gpu_count,
        rank_by=request.rank_by,
        device=request.device,
    )


def plan(model: Model, request: Request) -> planner.Plan:
    """``calc.plan.plan`` for the request."""
    return _plan(model, request)


@st.cache_resource(max_entries=128, show_spinner="looking for the least hardware...")
def _least(_model: Model, request: Request) -> planner.LeastHardware:
    return planner.least_hardware(
        _model.spec,
        task=request.task,
        seq_len=request.seq_len,
        global_batch=request.global_batch,
        gpu=request.gpu,
        device=request.device,
    )


def least_hardware(model: Model, request: Request) -> planner.LeastHardware:
    """``calc.plan.least_hardware`` for the request."""
    return _least(model, request)


def least_hardware_text(least: planner.LeastHardware, gpu: object) -> str:
    """Two bullet lines: the smallest count of the GPU, and the smallest single GPU."""
    name = least.gpu.name
    if least.min_count is None:
        count = f"- No count of {name} up to the search limit runs it."
    else:
        count = (
            f"- **{least.min_count} x {name}** is the smallest count on which a configuration fits"
        )
        if least.min_count_best is not None:
            count += f" ({least.min_count_best.verdict()})"
    if least.smallest_gpu is None:
        single = "- No single GPU of the catalog holds any configuration."
    else:
        single = f"- The smallest single GPU that fits: **{least.smallest_gpu.name}**"
    if least.min_peak_bytes is not None:
        single += f"; the least memory any configuration needs is {display.gib(least.min_peak_bytes):.2f} GiB"
    return f"{count}\n{single}"


@st.cache_resource(max_entries=128, show_spinner="looking for changes that fit...")
def _changes(
    _model: Model, request: Request, job: calc.Training | calc.Inference
) -> tuple[planner.Change, ...] | None:
    est = estimate(_model, request.model_key, job, request.device)
    usable = calc.gpus.get_gpu(request.gpu).usable_bytes
    fits, _ = display.fit_verdict(est.peak_bytes, usable, request.gpu)
    if fits:
        return None
    return planner.changes_to_fit(
        _model.spec, job, gpu=request.gpu, gpu_count=request.gpu_count, device=request.device
    )


def changes_to_fit(
    model: Model, request: Request, job: calc.Training | calc.Inference
) -> tuple[planner.Change, ...] | None:
    """``calc.plan.changes_to_fit`` for the sidebar's job on the request's GPUs; None when the
    job already fits."""
    return _changes(model, request, job)
