"""Run one case under a measuring backend and compare it with ``calc.estimate``.

Backends, behind one interface (``mark(phase)`` plus peaks afterwards):

* ``cpu``: `verify.measure.tracker.StorageTracker` (``count_late=False``, no baseline scan: the token ids
  are registered with ``track`` and everything else is built inside it), the quantity
  ``calc.estimate(..., device="cpu")`` predicts;
* ``cuda``: ``torch.cuda.max_memory_allocated`` with synchronisation at every phase boundary and
  the ``requested_bytes``/``active_bytes``/``reserved_bytes`` peaks of ``memory_stats``, less
  what the process held before the case began (``extra["baseline"]``); an out-of-memory error
  is recorded as status ``oom``.

Statuses: ``ok`` (|error| within the case's tolerance), ``fail``, ``not-modelled`` (calc raised
``NotImplementedError`` or has no ``estimate`` yet), ``not-runnable`` (a harness helper is
missing), ``error`` (the measurement raised), ``oom``, ``measured`` (measured without a
prediction: ``python -m verify --measure-only``, for a GPU machine whose torch is not the pin;
`verify.gpu_check` compares calc with the recorded file afterwards).
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import calc
from calc.config.jobs import Training
from verify.cases.case import Case
from verify.cases.scale import with_dropout
from verify.measure.tracker import StorageTracker
from verify.models import hf as hf_model
from verify.models.build import NotRunnable, build_model, build_optimizer
from verify.run.compiled import CompiledCpuMeter
from verify.run.step import make_batch, make_prompts, pins_for, prefill, train_two_steps

STATUSES = ("ok", "fail", "not-modelled", "not-runnable", "error", "oom", "measured")
FAILING = ("fail", "error")
"""Statuses that make ``python -m verify`` exit 1."""


@dataclass(slots=True)
class Record:
    """The outcome of one case."""

    name: str
    card: str
    impl: str
    kind: str
    label: str
    tags: list[str]
    tolerance_pct: float
    device: str
    status: str = "error"
    measured_peak: int | None = None
    measured_phases: dict[str, int] = field(default_factory=dict)
    measured_peak_phase: str = ""
    measured_peak_op: str = ""
    measured_categories: dict[str, int] = field(default_factory=dict)
    predicted_peak: int | None = None
    predicted_phases: dict[str, int] = field(default_factory=dict)
    predicted_peak_phase: str = ""
    predicted_peak_event: str = ""
    predicted_breakdown: dict[str, int] = field(default_factory=dict)
    predicted_notes: list[str] = field(default_factory=list)
    error_pct: float | None = None
    message: str = ""
    pins: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def set_prediction(self, est: Any) -> None:
        """Copy a ``calc.Estimate``'s peak, phases, breakdown and notes into the record."""
        self.predicted_peak = int(est.peak_bytes)
        self.predicted_phases = {k: int(v) for k, v in est.phases.items()}
        self.predicted_peak_phase = est.peak_phase
        self.predicted_peak_event = est.peak_event
        self.predicted_breakdown = {k: int(v) for k, v in est.breakdown.items()}
        self.predicted_notes = list(est.notes)


# ---------------------------------------------------------------------- prediction


class PredictionError(Exception):
    """``calc.estimate`` raised something other than ``NotImplementedError``."""


def predict(case: Case, device: str) -> tuple[Any | None, str]:
    """``(calc.estimate(spec, job, device), "")``, or ``(None, why)`` when not modelled: calc
    raised ``NotImplementedError``, or a calc module it imports is not written yet. Any other
    exception raises `PredictionError` (a bug in calc: the case errors)."""
    try:
        return calc.estimate(case.spec(), case.job, device=device), ""
    except NotImplementedError as exc:
        return None, f"not modelled: {exc}"
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("calc."):
            return None, f"not modelled: {exc.name} is not written yet"
        raise PredictionError(f"{type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise PredictionError(f"{type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------- measurement


def _build_and_run(case: Case, device: str, meter: Any, ids: torch.Tensor, targets: Any):
    """Inside the meter: build model (+ optimizer), mark ``setup``, reset the peak, run.
    ``targets`` are the training targets, or an inference's prompt mask (`_batch`)."""
    job = case.job
    training = isinstance(job, Training)
    spec = with_dropout(case.spec(), job.dropout) if training else case.spec()
    pins = pins_for(spec, job, seed=case.seed, device=device)
    meter.mark("setup")
    model, loss_fn = build_model(spec, job, seed=case.seed, device=device)
    if hasattr(model, "set_rope") and not spec.learned_positions:
        model.set_rope(case.seq)
    bundle = build_optimizer(model, job, device=device) if training else None
    meter.setup_done(model, bundle, ids, targets)
    if training:
        train_two_steps(loss_fn, bundle, ids, targets, job, pins, meter, device_type=device)
    else:
        prefill(model, ids, job, pins, meter, mask=targets)
    return model, bundle, pins


class CpuMeter:
    """The CPU backend: a `StorageTracker` driven through the protocol."""

    def __init__(self) -> None:
        self.tracker = StorageTracker(scan_baseline=False, count_late=False)

    def mark(self, phase: str) -> None:
        self.tracker.mark(phase)

    def setup_done(self, model: Any, bundle: Any, ids: torch.Tensor, targets: Any) -> None:
        opt = bundle.optimizer if bundle is not None else None
        inputs = [t for t in (ids, targets) if t is not None]
        # the model's every storage counts, also one made outside dispatch during the build
        # (torchao's to_nf4 makes each NF4Tensor's 16-entry table with torch.tensor: "late")
        self.tracker.track(model)
        self.tracker.classify(model=model, optimizer=opt, inputs=inputs)
        self.tracker.reset_peak()

    def measure(self, case: Case, rec: Record) -> None:
        ids, targets = _batch(case, "cpu")
        inputs = [t for t in (ids, targets) if t is not None]
        with self.tracker as tr:
            tr.track(*inputs)
            model, bundle, pins = _build_and_run(case, "cpu", self, ids, targets)
        opt = bundle.optimizer if bundle is not None else None
        if bundle is not None and bundle.extra_states:
            tr.classify(optimizer_states=bundle.extra_states)  # fp32 masters of bf16-master
        rec.pins = pins.as_dict()
        rec.measured_phases = {p: b for p, b in tr.phase_peaks.items() if p != "setup"}
        rec.measured_peak = max(rec.measured_phases.values())
        rec.measured_peak_phase = tr.peak_phase
        rec.measured_peak_op = tr.peak_op
        rec.measured_categories = tr.attribute(model=model, optimizer=opt, inputs=inputs)
        rec.extra = {"top_ops_at_peak": dict(list(tr.peak_by_op().items())[:8])}


def _batch(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids and targets for training; for inference the prompt ids and their attention
    mask (``None`` unless the prompts are left-padded: `make_prompts`). Both are inputs: made
    before the measured part, as a tokenizer's output is."""
    job = case.job
    if isinstance(job, Training):
        return make_batch(case.spec(), job.micro_batch, job.seq_len, seed=case.seed, device=device)
    return make_prompts(case.spec(), job, seed=case.seed, device=device)


class CudaMeter:
    """The CUDA backend: allocator statistics per phase, synchronised at every boundary."""

    _STATS = ("allocated_bytes", "requested_bytes", "active_bytes", "reserved_bytes")

    def __init__(self) -> None:
        self.phase = ""
        self.phase_peaks: dict[str, dict[str, int]] = {}
        self.measuring = False

    def _close_phase(self) -> None:
        torch.cuda.synchronize()
        if self.measuring and self.phase and self.phase != "setup":  # the build is not the job
            stats = torch.cuda.memory_stats()
            peaks = {k: int(stats.get(f"{k}.all.peak", 0)) for k in self._STATS}
            peaks["max_memory_allocated"] = int(torch.cuda.max_memory_allocated())
            old = self.phase_peaks.get(self.phase, {})
            self.phase_peaks[self.phase] = {k: max(v, old.get(k, 0)) for k, v in peaks.items()}
        torch.cuda.reset_peak_memory_stats()

    def mark(self, phase: str) -> None:
        self._close_phase()
        self.phase = phase

    def setup_done(self, model: Any, bundle: Any, ids: torch.Tensor, targets: Any) -> None:
        self._close_phase()
        # the build's transients (an fp32 init cast to bf16) are not the job's: their cached
        # segments go back, so the reserved peak starts from the loaded model
        torch.cuda.empty_cache()
        self.measuring = True

    def measure(self, case: Case, rec: Record) -> None:
        # what earlier cases of this process left allocated (a GPU run measured up to 17.8 MB
        # kept by earlier LoRA and optimizer-in-backward builds) is not this case's: it is
        # read here, after a collection, and taken off every peak (the CPU tracker likewise
        # counts only the storages made inside it)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = {
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
        }
        ids, targets = _batch(case, "cuda")
        try:
            _model, _bundle, pins = _build_and_run(case, "cuda", self, ids, targets)
            rec.pins = pins.as_dict()
        finally:
            self._close_phase()
        for peaks in self.phase_peaks.values():
            for key in peaks:
                peaks[key] -= base["reserved" if key == "reserved_bytes" else "allocated"]
        phases = {p: v["max_memory_allocated"] for p, v in self.phase_peaks.items()}
        rec.measured_phases = phases
        rec.measured_peak = max(phases.values())
        rec.measured_peak_phase = max(phases, key=phases.__getitem__)
        free, total = torch.cuda.mem_get_info()  # after the step, before empty_cache
        # read together with mem_get_info: total - free - reserved is the memory outside
        # PyTorch's allocator (context, kernel images, libraries) at this point of the process
        reserved_now, allocated_now = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        rec.extra = {"stat_peaks": {k: max(v[k] for v in self.phase_peaks.values())
                                    for k in next(iter(self.phase_peaks.values()))},
                     "mem_get_info": [int(free), int(total)],
                     "reserved_now": int(reserved_now), "allocated_now": int(allocated_now),
                     "baseline": base, **cuda_environment()}  # fmt: skip


def cuda_environment() -> dict[str, Any]:
    """GPU name, driver-visible versions, allocator settings and cuBLAS workspace size."""
    env: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
    }
    size_fn = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    if callable(size_fn):
        try:
            env["cublas_workspace_size"] = int(size_fn())
        except Exception as exc:
            env["cublas_workspace_size"] = f"unavailable: {exc}"
    return env


# ---------------------------------------------------------------------- one case


def preload(case: Case) -> None:
    """Import, outside any meter, what building the case imports lazily (transformers' modeling
    module for its model type), so import-time tensors never count."""
    if case.impl in ("hf", "derived") and hf_model.available():
        attention = "eager" if case.job.attention == "eager" else "sdpa"  # gemma2: eager only
        hf_model.build_hf_on_meta(case.spec(), attention)


def run_case(case: Case, device: str = "cpu", *, predict_peak: bool = True) -> Record:
    """Measure ``case`` on ``device`` (``cpu`` or ``cuda``), predict it, and compare; with
    ``predict_peak=False`` only measure (status ``measured``)."""
    start = time.perf_counter()
    job = case.job
    rec = Record(
        name=case.name,
        card=case.card,
        impl=case.impl,
        kind=case.kind,
        label=case.label(),
        tags=list(case.tags),
        tolerance_pct=case.tolerance_pct,
        device=device,
        spec=asdict(case.spec()),
        job={k: getattr(job, k) for k in job.__slots__},
    )
    try:
        est, why = predict(case, device) if predict_peak else (None, "")
    except PredictionError as exc:
        est, why = None, ""
        rec.message = f"calc.estimate raised {exc}"
    if est is not None:
        rec.set_prediction(est)
    meter = CpuMeter() if device == "cpu" else CudaMeter()
    if device == "cpu" and getattr(job, "compile", "none") != "none":
        meter = CompiledCpuMeter()  # the tracker's dispatch mode would run it eagerly
    try:
        preload(case)
        meter.measure(case, rec)
    except NotRunnable as exc:
        rec.status, rec.message = "not-runnable", str(exc)
    except torch.OutOfMemoryError as exc:
        rec.status, rec.message = "oom", str(exc).splitlines()[0]
    except Exception as exc:
        rec.status = "error"
        rec.message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
    else:
        if not predict_peak:
            rec.status = "measured"
        elif est is None and not why:
            rec.status = "error"  # calc raised: message set above
        elif est is None:
            rec.status, rec.message = "not-modelled", why
        else:
            rec.error_pct = (rec.predicted_peak - rec.measured_peak) / rec.measured_peak * 100
            rec.status = "ok" if abs(rec.error_pct) <= case.tolerance_pct else "fail"
    finally:
        gc.collect()
        if device == "cuda" and torch.cuda.is_available():
            # cuBLAS keeps a workspace per (handle, stream) for the life of the process
            # (CublasHandlePool.cpp); cleared, the next case starts as a fresh process does
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
    rec.seconds = time.perf_counter() - start
    return rec
