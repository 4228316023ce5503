"""``calc`` calls for the pages: cached across reruns and sessions (``st.cache_resource``) where
a result is costly to rebuild, so that a rerun that changes nothing recomputes nothing. The
estimate itself is not: ``calc.estimate`` keeps its compiled expressions, and a first recording
of transformers' code shows its progress on the page (`recording_progress`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import streamlit as st

import calc
from calc.data import gpus
from calc.data.cards import load_verify_report
from calc.estimate import device_fit
from calc.estimate.device_fit import DeviceFit
from calc.plan import evidence
from calc.plan import planner as plan
from calc.plan.evidence import VerifiedCase
from calc.present import display
from calc.present.sweep import Sweep, doubling_values, sweep
from webapp.model_source import Model


def model_key(model: Model) -> str:
    """A hashable name of the model: the card id, or the custom config's canonical JSON."""
    if model.config is None:
        return f"card:{model.label}"
    return "config:" + json.dumps(model.config, sort_keys=True, separators=(",", ":"))


SPINNER = (
    "compiling the expressions of this job (a torch.compile'd step records Inductor's generated "
    "code first: up to about 2 minutes for a large model)..."
)
"""What the page says while a first estimate compiles (after st.spinner's half-second delay)."""


def recording_text(p: calc.Progress) -> str:
    """The progress bar's caption of a recording of transformers' code."""
    return f"{p.title}: {p.done} of {p.total} runs"


@contextlib.contextmanager
def recording_progress() -> Iterator[None]:
    """While inside, a recording (`calc.reporting`) draws a progress bar where the page is,
    removed when the block ends; an estimate that records nothing draws nothing."""
    bar: list = []

    def draw(p: calc.Progress) -> None:
        if not bar:
            bar.append(st.empty())
        bar[0].progress(p.fraction, text=recording_text(p))

    try:
        with calc.reporting(draw):
            yield
    finally:
        if bar:
            bar[0].empty()


def estimate(
    model: Model,
    job: calc.Training | calc.Inference,
    parallel: calc.Parallelism | None,
    device: str,
    gpu_id: str | None = None,
) -> calc.Estimate:
    """``calc.estimate`` of the job; with ``parallel`` the most-loaded rank's, every rank's
    peak in ``rank_peaks``; ``gpu_id``: that GPU's cuBLAS workspaces (as the planner's verdict
    charges them). Not cached by Streamlit: ``calc.estimate`` keeps the compiled expressions
    (and a recording of transformers' code on disk), so a rerun costs microseconds, and a first
    recording draws its progress here (a cached function could not write to the page)."""
    with st.spinner(SPINNER), recording_progress():
        return calc.estimate(model.spec, job, parallel, device=device, gpu=gpu_id)


@st.cache_resource(show_spinner=False)
def verified_cases() -> tuple[VerifiedCase, ...]:
    """The compared cases of the committed verify report (read once per server)."""
    return evidence.verified_cases(load_verify_report())


def estimate_verdict(
    model: Model,
    job: calc.Training | calc.Inference,
    est: calc.Estimate,
    gpu: gpus.GPU,
    parallel: calc.Parallelism | None = None,
) -> tuple[bool, str]:
    """Whether the estimate's peak (a parallel layout's: the most-loaded rank's) fits one GPU,
    in the words of a planner row
    (``calc.plan.result.Evaluated.verdict``), with the error ``python -m verify`` observed on
    the nearest verified cases (``calc.plan.evidence.error_bar``: chosen by the job's fields; the
    parallel layout is not one of the similarity fields). Usable: ``GPU.usable_for(parallel)``
    (the total less the memory outside PyTorch, NCCL's buffers included)."""
    gib = display.gib
    usable = gpu.usable_for(parallel)
    headroom = usable - est.peak_bytes
    fits = headroom >= 0
    if fits:
        pct = 100.0 * headroom / usable
        text = (
            f"fits with {pct:.1f}% headroom ({gib(headroom):.2f} GiB of "
            f"{gib(usable):.2f} GiB usable on {gpu.id}) on every rank"
        )
    else:
        text = (
            f"does not fit: peak of rank {est.rank} {gib(est.peak_bytes):.2f} GiB > "
            f"{gib(usable):.2f} GiB usable on {gpu.id}, needs {gib(-headroom):.2f} "
            "GiB more"
        )
    bar = evidence.error_bar(job, model.spec, verified_cases())
    if bar is not None:
        text += f"; {bar.text()} (cases chosen by the job's fields, not the layout)"
    return fits, text


@st.cache_resource(max_entries=32, show_spinner="replaying the caching allocator...")
def device_fits(
    _model: Model, key: str, job: calc.Training | calc.Inference, gpu_id: str
) -> list[DeviceFit]:
    """`calc.estimate.device_fit.device_fits` of the one-GPU CUDA job on ``gpu_id`` (its cuBLAS
    workspace size; seconds: every layer replayed through the allocator)."""
    gpu = gpus.get_gpu(gpu_id)
    return device_fit.device_fits(calc.estimate(_model.spec, job, gpu=gpu), gpu)


@st.cache_resource(max_entries=256, show_spinner=False)
def evaluate(
    _model: Model, key: str, job: calc.Training | calc.Inference, gpu_id: str, device: str
) -> plan.Evaluated:
    """``calc.plan.planner.evaluate``: the job against one GPU, its verdict with the error observed on
    the nearest verified cases (the same sentence as a planner row)."""
    return plan.evaluate(_model.spec, job, gpu=gpu_id, device=device)


@st.cache_resource(max_entries=256, show_spinner=False)
def size_sweep(
    _model: Model, key: str, job: calc.Training | calc.Inference, field: str, current: int,
    high: int, device: str,
) -> Sweep:  # fmt: skip
    """``calc.present.sweep.sweep`` over doubling values of ``field`` around ``current``."""
    values = doubling_values(current, high=high, points=9)
    return sweep(_model.spec, job, field, values, device=device)
