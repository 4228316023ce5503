"""One rank's steps measured by the profiler's allocation events (`verify.measure.alloc`).

A compiled job's rank (``Training(compile="regional")`` under FSDP2) cannot be measured by the
storage tracker: under its dispatch mode Dynamo runs the layers eagerly, and the buffers of
Inductor's generated code never reach a dispatch mode (`verify.run.compiled`). Such a rank is
measured as the single-GPU compiled protocol measures one process, with what distribution adds:

1. the profiler runs from **before** the model and its wrapper are built, like the tracker in
   `verify.dist.launch` (FSDP2 shards and pads the parameters at ``fully_shard``), from the live
   bytes of the batch;
2. the decoder layers' ``forward`` is compiled after wrapping, as the recording compiles it
   (`calc.derive.inductor.compile_model`): FSDP2's hooks stay outside the graph, as Dynamo's
   ``skip_fsdp_hooks`` (on by default) keeps them when a whole wrapped layer is compiled;
3. one warm-up forward and backward compiles both graphs (step 0, `WARMUP_STEP`), then
   every gradient is dropped (``zero_grad``), as a real run's first step would compile them;
4. ``case.steps`` steps of the protocol; each step's peak is the highest of its phases.

The wrapper's collectives run over a ``fake`` process group of the same ranks (torch's
``FakeProcessGroup``, ``torch/testing/_internal/distributed/fake_pg.py``: every collective a
no-op), not gloo: gloo frees a reduce-scatter's input on its worker thread, whose frees the
profiler does not record (its state is thread-local; ``profile_all_threads`` records no memory
events), so every such input would stay counted for good. What is measured is then exactly what
FSDP2 allocates and releases on the rank, on real tensors and with the real compiled code: what
the CUDA caching allocator counts, without gloo's late releases (the tracker cases' 3 %). Each
rank still holds its own shard (the fake group knows its rank) and its own batch. An eager
case measured this way (``DistCase.meter``) checks the meter against calc on the same layout.
"""

from __future__ import annotations

import gc
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from calc.derive.inductor import compile_model, compiles
from verify.cases.case import DistCase
from verify.dist.engine import Engine, RankContext, run_step
from verify.measure.alloc import AllocationMeter, storage_bytes
from verify.run.compiled import decoder_layers
from verify.run.step import Pins, forced_sdpa, micro_batches

WARMUP_STEP = 0
"""The compiling step's number: its phases are ``step0/forward`` and ``step0/backward``."""


def measure_profiled(
    case: DistCase,
    ctx: RankContext,
    engine: Engine,
    ids: torch.Tensor,
    targets: torch.Tensor,
    pins: Pins,
) -> dict[str, Any]:
    """Build, wrap (and compile) ``case``'s model on this rank and measure its steps; the
    rank's result in `verify.dist.launch`'s format (no per-op attribution: the profiler does
    not say which tensor an allocation became)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    job = case.job
    ctx = replace(ctx, group=dist.new_group(backend="fake"))
    meter = AllocationMeter()
    with meter.profiling(storage_bytes(ids, targets), "setup"):
        built = engine(case, case.spec(), ctx)
        meter.keep(*built.model.buffers())  # the model's every storage, as the tracker's
        with forced_sdpa(pins.sdpa_backend):
            if compiles(job):  # as the recording compiles: each layer's forward, hooks outside
                compile_model(built.model, decoder_layers(built.model), job)
                micro_batches(WARMUP_STEP, built.loss_fn, ids, targets, job, meter,
                              scale=built.scale, zero_grad=built.zero_grad,
                              backward=built.backward, device_type=ctx.device)  # fmt: skip
                built.zero_grad()
                gc.collect()
            dist.barrier()
            for step in range(1, case.steps + 1):
                run_step(step, built, ids, targets, job, meter, ctx.device)
    res = meter.result
    steps = [_step(res.phase_peaks, s) for s in range(1, case.steps + 1)]
    best = max(range(len(steps)), key=lambda i: steps[i]["peak"])
    warmup = f"step{WARMUP_STEP}/"
    setup = {p: b for p, b in res.phase_peaks.items() if p == "setup" or p.startswith(warmup)}
    return {
        "rank": ctx.rank,
        "world": ctx.world,
        "setup_bytes": res.phase_start_bytes.get("step1/forward", 0),
        "setup_peaks": setup,
        "meter": "profiler allocation events",
        "allocations_counted": res.counted,
        "allocations_skipped": res.skipped,
        "alive_at_end": res.alive_at_end[:40],
        "steps": steps,
        "peak": steps[best]["peak"],
        "peak_step": best + 1,
    }


def _step(phase_peaks: dict[str, int], step: int) -> dict[str, Any]:
    """Step ``step``'s peak and phases from the meter's phase peaks."""
    prefix = f"step{step}/"
    phases = {p: b for p, b in phase_peaks.items() if p.startswith(prefix)}
    if not phases:
        raise ValueError(f"no phase of step {step} was marked")
    top = max(phases, key=phases.__getitem__)
    return {"peak": phases[top], "peak_phase": top, "peak_op": "", "phases": phases,
            "top_ops_at_peak": {}, "live_at_peak": []}  # fmt: skip
