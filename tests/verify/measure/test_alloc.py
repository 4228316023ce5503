"""AllocationMeter: the profiler's allocation events read with the storage tracker's rules.

Hand counts below (fp32: 4 B/element, each allocation rounded up to 512 B); the eager training
step is checked against `verify.measure.tracker.StorageTracker`, the independent measurement
every other case uses.
"""

from __future__ import annotations

import gc
import shutil

import pytest

torch = pytest.importorskip("torch")

from verify.cases.case import LLAMA, train  # noqa: E402
from verify.measure.alloc import AllocationMeter, storage_bytes  # noqa: E402
from verify.measure.tracker import StorageTracker  # noqa: E402
from verify.models.hf import build_hf  # noqa: E402


def test_outputs_count_wrapped_scalars_and_kernel_scratch_do_not() -> None:
    x = torch.ones(1000)  # allocated before profiling: part of the given baseline
    meter = AllocationMeter()
    with meter.profiling(baseline_bytes=4096, first_phase="a"):
        y = x * 2  # output 4,000 B -> 4,096; the scalar 2 becomes a tensor outside any op
        meter.mark("b")
        z = y.sum()  # 4 B -> 512
        del y  # frees 4,096
        meter.mark("c")
    res = meter.result
    # a: 4,096 + 4,096 = 8,192; b: 8,192 + 512 = 8,704; c: starts at 4,608 and stays there
    assert res.phase_peaks == {"a": 8192, "b": 8704, "c": 4608}
    assert res.phase_start_bytes == {"a": 4096, "b": 8192, "c": 4608}
    assert (res.peak_bytes, res.peak_phase) == (8704, "b")
    del z


def test_tensor_in_optimizer_step_is_not_counted() -> None:
    meter = AllocationMeter()
    with meter.profiling(baseline_bytes=0):
        with torch.profiler.record_function("Optimizer.step#Fake.step"):
            step = torch.tensor(0.0)  # Adam's step scalar: host-side on CUDA, "late" on CPU
            kept = torch.zeros(10)  # an op output: 40 B -> 512
    assert meter.result.peak_bytes == 512
    del step, kept


def test_tensor_literal_is_not_counted_anywhere() -> None:
    # torch.tensor() is made outside the dispatcher's view (the tracker's "late" storages):
    # Gemma's embed_scale buffer and its forward's normalizer; torch.empty() is an op
    meter = AllocationMeter()
    with meter.profiling(baseline_bytes=0):
        scale = torch.tensor(8.0, dtype=torch.bfloat16)
        made = torch.empty(10)  # 40 B -> 512
        cast = torch.tensor([1.0, 2.0]).to(torch.bfloat16)  # the literal no, its cast 4 B -> 512
    assert meter.result.peak_bytes == 1024
    del scale, made, cast


def test_a_kept_literal_counts_and_a_freed_one_at_its_address_does_not() -> None:
    # a model built inside profiling: its torch.tensor() buffer (Gemma's embed_scale) is the
    # model's, as StorageTracker.track(model) counts it; another literal does not count
    meter = AllocationMeter()
    with meter.profiling(baseline_bytes=0):
        scale = torch.tensor(8.0, dtype=torch.bfloat16)  # 2 B -> 512, kept
        other = torch.tensor([1.0, 2.0])  # 8 B: a literal, not kept
        meter.keep(scale)
    assert meter.result.peak_bytes == 512
    del other
    # the address of a literal freed inside profiling, reused by a kept one, counts once
    meter = AllocationMeter()
    with meter.profiling(baseline_bytes=0):
        gone = torch.tensor(1.0)
        del gone
        scale = torch.tensor(8.0, dtype=torch.bfloat16)
        meter.keep(scale)
    assert meter.result.peak_bytes == 512
    del scale


def test_fsdp_storage_resize_counts_and_a_collectives_buffers_do_not() -> None:
    # FSDP2 grows the unsharded parameters' storages with storage.resize_ (no aten op) inside
    # its FSDP:: ranges; what a c10d collective allocates inside itself is never returned
    gathered = torch.empty(1000)  # 4,000 B, allocated before profiling: the baseline
    gathered.untyped_storage().resize_(0)
    elsewhere = torch.empty(300)
    elsewhere.untyped_storage().resize_(0)
    meter = AllocationMeter()
    with meter.profiling(baseline_bytes=0):
        with torch.profiler.record_function("FSDP::all_gather (layers.0)"):
            gathered.untyped_storage().resize_(4000)  # counted: 4,096
        elsewhere.untyped_storage().resize_(1200)  # outside FSDP's ranges: a Python scalar's way
        with torch.profiler.record_function("c10d::allgather_"):
            staging = torch.ones(2000)  # the collective's own copy: not counted
        del staging
    assert meter.result.peak_bytes == 4096


def test_storage_bytes_counts_each_storage_once() -> None:
    x = torch.empty(1000)  # 4,000 -> 4,096
    assert storage_bytes(x, x[10:20], x.view(-1), torch.empty(0)) == 4096


def _step(model: torch.nn.Module, ids: torch.Tensor, mark: object) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for step in (1, 2):
        mark(f"s{step}/forward")  # type: ignore[operator]
        loss = model(input_ids=ids, labels=ids).loss
        mark(f"s{step}/backward")  # type: ignore[operator]
        loss.backward()
        del loss
        mark(f"s{step}/optimizer")  # type: ignore[operator]
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_eager_hf_step_matches_the_storage_tracker() -> None:
    pytest.importorskip("transformers")
    spec = train("t", LLAMA, impl="hf").spec()  # hidden 64, 2 layers, vocab 512
    ids = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    model = build_hf(spec)
    tracker = StorageTracker(scan_baseline=False, count_late=False)
    with tracker:
        tracker.track(ids, model)
        tracker.reset_peak()
        _step(model, ids, tracker.mark)
    del model
    gc.collect()

    torch.manual_seed(0)
    model = build_hf(spec)
    meter = AllocationMeter()
    base = storage_bytes(*model.parameters(), *model.buffers(), ids)
    with meter.profiling(base):
        _step(model, ids, meter.mark)
    tracked = {k: v for k, v in tracker.phase_peaks.items() if k.startswith("s")}
    measured = {k: v for k, v in meter.result.phase_peaks.items() if k.startswith("s")}
    assert len(tracked) == 6
    assert measured == tracked


@pytest.mark.slow
@pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
    reason="Inductor's CPU backend needs a C++ compiler",
)
def test_generated_code_buffers_count() -> None:
    # sin then cos of [1000] fp32 fuse into one kernel writing one buffer of 4,000 B -> 4,096,
    # allocated by the generated code (no aten op around it)
    fn = torch.compile(lambda t: t.sin().cos())
    x = torch.ones(1000)
    fn(x)  # compile outside the measured window
    meter = AllocationMeter()
    with meter.profiling(baseline_bytes=0):
        out = fn(x)
    assert meter.result.peak_bytes == 4096
    del out
