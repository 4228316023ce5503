"""Measuring a ``torch.compile``'d training step on CPU (``Training(compile="default")``).

The protocol of `verify.run.step` with three differences, all forced by ``torch.compile``:

* the meter is `verify.measure.alloc.AllocationMeter` (the profiler's allocation events read
  with the storage tracker's rules), because under the tracker's dispatch mode Dynamo runs the
  model eagerly and the generated code's buffers never reach a dispatch mode;
* the model is built, wrapped with ``torch.compile(model)`` (default mode) and run through one
  warm-up forward and backward before measuring, then its gradients are set to None: the
  compilation (seconds, Python objects, the generated code) happens outside the measured
  window, as in a real run's first step;
* the live bytes at the start (parameters, buffers, token ids) are counted from the storages,
  since the profiler only sees what is allocated while it runs. The optimizer is built after
  the warm-up, inside the measured window, so step 1 still creates its states.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

import calc
from calc.config.jobs import Training
from verify.cases.scale import with_dropout
from verify.measure.alloc import AllocationMeter, storage_bytes
from verify.models.build import build_model, build_optimizer
from verify.run.step import (
    AUTOCAST_DTYPE,
    forced_sdpa,
    make_batch,
    pins_for,
    train_two_steps,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from calc.config.model_spec import ModelSpec
    from verify.run.step import Pins

WARMUP_PHASE = "setup"
"""Phase name of the measured window before the first step (the optimizer's construction)."""


def compile_model(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    mode: str = "default",
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn`` with ``model`` compiled in place (``torch.compile``'s default mode):
    ``mode="default"``, the whole model (``nn.Module.compile``); ``"regional"``, each decoder
    layer by its own ``compile()`` (torchtune's ``training.compile_model`` calls ``m.compile()``
    on each layer; torchtitan compiles each block), the rest eager.

    ``loss_fn`` calls ``model`` by closure, so the same loss code runs the compiled graphs.
    """
    if mode == "default":
        model.compile()
    elif mode == "regional":
        for layer in decoder_layers(model):
            layer.compile()
    else:
        raise ValueError(f"compile mode {mode!r} is not measured")
    return loss_fn


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The ``ModuleList`` holding the model's ``config.num_hidden_layers`` decoder layers."""
    count = model.config.num_hidden_layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if not lists:
        raise ValueError(f"no list of {count} decoder layers in {type(model).__name__}")
    return lists[0]


def warm_up(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    model: torch.nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    job: Training,
    pins: Pins,
) -> None:
    """One forward and backward (compiles both graphs), then every gradient set to None."""
    amp = AUTOCAST_DTYPE.get(job.precision)
    ctx = torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()
    with forced_sdpa(pins.sdpa_backend):
        with ctx:
            loss = loss_fn(ids, targets)
        loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    gc.collect()


def measure_compiled(
    spec: ModelSpec, job: Training, ids: torch.Tensor, targets: torch.Tensor, *, seed: int
) -> tuple[AllocationMeter, Pins, dict[str, Any]]:
    """Build, compile and warm up ``spec``'s model, then measure the protocol's two steps.

    Returns the meter (``meter.result`` holds the peaks), the pins and extra facts for the
    record (the baseline bytes).
    """
    if job.compile == "none":
        raise ValueError("measure_compiled needs a job with compile != 'none'")
    pins = pins_for(spec, job, seed=seed, device="cpu")
    model, loss_fn = build_model(spec, job, seed=seed, device="cpu")
    if hasattr(model, "set_rope") and not spec.learned_positions:
        model.set_rope(job.seq_len)
    loss_fn = compile_model(model, loss_fn, job.compile)
    warm_up(loss_fn, model, ids, targets, job, pins)
    baseline = storage_bytes(*model.parameters(), *model.buffers(), ids, targets)
    meter = AllocationMeter()
    with meter.profiling(baseline, WARMUP_PHASE):
        bundle = build_optimizer(model, job, device="cpu")
        train_two_steps(loss_fn, bundle, ids, targets, job, pins, meter)
    extra = {"baseline_bytes": baseline, "meter": "profiler allocation events"}
    return meter, pins, extra


class CompiledCpuMeter:
    """The CPU backend of a ``compile`` case (`verify.run.runner.run_case` picks it)."""

    def measure(self, case: Any, rec: Any) -> None:
        """Measure ``case`` (a training `verify.cases.case.Case`) into ``rec`` (a
        `verify.run.runner.Record`): phases, peak and its phase; no categories (the profiler
        does not say which tensor an allocation became)."""
        job = case.job
        if not isinstance(job, Training):
            raise ValueError(f"case {case.name}: compile is measured for training only")
        spec = with_dropout(case.spec(), job.dropout)
        ids, targets = make_batch(spec, job.micro_batch, job.seq_len, seed=case.seed)
        meter, pins, extra = measure_compiled(spec, job, ids, targets, seed=case.seed)
        res = meter.result
        rec.pins = pins.as_dict()
        rec.measured_phases = {p: b for p, b in res.phase_peaks.items() if p != WARMUP_PHASE}
        rec.measured_peak = max(rec.measured_phases.values())
        rec.measured_peak_phase = max(rec.measured_phases, key=rec.measured_phases.__getitem__)
        starts = res.phase_start_bytes
        rec.extra = {**extra, "allocations_counted": res.counted,
                     # what the forward leaves for backward: saved tensors and the loss
                     "forward_kept_bytes": starts["step1/backward"] - starts["step1/forward"],
                     "allocations_skipped": res.skipped,
                     **eager_comparison(case.spec(), job, rec.measured_peak)}  # fmt: skip


def eager_comparison(spec: ModelSpec, job: Training, measured_peak: int) -> dict[str, Any]:
    """calc's estimate of the same job run eagerly, and its error against the compiled
    measurement (in percent): what a user who ignores ``torch.compile`` would be told."""
    try:
        est = calc.estimate(spec, replace(job, compile="none"), device="cpu")
    except NotImplementedError as exc:
        return {"eager_estimate": f"not modelled: {exc}"}
    peak = int(est.peak_bytes)
    return {
        "eager_estimate_peak": peak,
        "eager_estimate_phases": {k: int(v) for k, v in est.phases.items()},
        "eager_estimate_error_pct": (peak - measured_peak) / measured_peak * 100,
    }
