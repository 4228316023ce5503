"""StorageTracker on hand-made allocation sequences whose peaks are derived by hand below.

Sizes: fp32 is 4 B/element; every storage counts ceil(nbytes/512)*512 and an empty one counts 0.
Most tests use ``scan_baseline=False`` and build what they need inside the tracker (or ``track`` it),
so the numbers do not depend on what other tests left alive in the process.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from verify.measure.tracker import CATEGORIES, StorageTracker, round_block  # noqa: E402

W_BYTES = 128 * 256 * 4  # Linear(256, 128, bias=False).weight: 131,072 B, a multiple of 512
X_BYTES = 8 * 256 * 4  # input [8, 256]: 8,192 B
Y_BYTES = 8 * 128 * 4  # output [8, 128]: 4,096 B
SCALAR = 512  # any 0-dim fp32 tensor: 4 B rounded up


def _linear() -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(256, 128, bias=False), torch.randn(8, 256)


def test_round_block() -> None:
    # 0 -> 0 (empty), 1..512 -> 512, 513 -> 1024, 4000 -> 4096
    assert [round_block(n) for n in (0, 1, 512, 513, 4000)] == [0, 512, 512, 1024, 4096]


def test_views_small_tensor_and_free() -> None:
    with StorageTracker(scan_baseline=False) as tr:
        x = torch.empty(1000)  # 4,000 B -> 4,096
        assert tr.live_bytes == 4096
        v = x[10:20]  # a view: same storage, nothing new
        w = x.view(-1)
        assert tr.live_bytes == 4096
        y = torch.empty(1)  # 4 B -> 512
        assert tr.live_bytes == 4608
        del x, v, w  # last handles of the first storage gone -> freed
        assert tr.live_bytes == 512
        z = torch.empty(0)  # empty storage counts 0
        assert tr.live_bytes == 512
    # peak: 4,096 + 512 while both were alive
    assert tr.peak_bytes == 4608
    assert tr.peak_op == "empty.memory_format"
    assert [(s.nbytes, s.raw_nbytes) for s in tr.peak_live()] == [(4096, 4000), (512, 4)]
    del y, z


def test_inplace_allocates_nothing() -> None:
    with StorageTracker(scan_baseline=False) as tr:
        x = torch.ones(1000)  # 4,096
        x.add_(1)
        x.mul_(2)
        x.clamp_(max=3.0)
        assert tr.live_bytes == 4096
        y = x + 1  # out-of-place: a second 4,096
        assert tr.live_bytes == 8192
    assert tr.peak_bytes == 8192
    del x, y


def test_storage_resize_grows_and_shrinks() -> None:
    orig = torch.UntypedStorage.resize_
    with StorageTracker(scan_baseline=False) as tr:
        x = torch.empty(100)  # 400 B -> 512
        st = x.untyped_storage()
        st.resize_(4000)  # outside dispatch, followed by the patch: 4,096
        assert tr.live_bytes == 4096
        st.resize_(0)  # FSDP2-style free: 0
        assert tr.live_bytes == 0
        st.resize_(1000)  # FSDP2-style re-allocation: 1,024
        assert tr.live_bytes == 1024
        y = torch.empty(10)  # 512
        y.resize_(2000)  # Tensor.resize_ is a mutating op: 8,000 B -> 8,192
        assert tr.live_bytes == 1024 + 8192
    # peak: 1,024 + 8,192 = 9,216 (the earlier 4,096 was lower)
    assert tr.peak_bytes == 9216
    assert tr.peak_op == "resize_"
    assert torch.UntypedStorage.resize_ is orig  # patch removed on exit
    del x, y, st


def test_reset_peak_and_phases() -> None:
    with StorageTracker(scan_baseline=False) as tr:
        a = torch.empty(1024)  # 4,096 (phase "init")
        tr.mark("forward")  # starts at 4,096
        b = torch.empty(2048)  # 8,192 -> live 12,288
        del b  # live 4,096
        tr.mark("backward")  # starts at 4,096
        c = torch.empty(512)  # 2,048 -> live 6,144
        assert tr.peak_bytes == 12288 and tr.peak_phase == "forward"
        tr.reset_peak()  # peak := live = 6,144
        assert tr.peak_bytes == 6144
        assert tr.phase_peaks == {"backward": 6144}
        tr.mark("optimizer")  # starts at 6,144
        d = torch.empty(128)  # 512 -> 6,656
    assert tr.peak_bytes == 6656
    assert tr.peak_phase == "optimizer"
    assert tr.phase_peaks == {"backward": 6144, "optimizer": 6656}
    assert tr.phase_start_bytes == {"backward": 6144, "optimizer": 6144}
    # the snapshot after a reset includes storages from before it
    assert sorted(s.nbytes for s in tr.peak_live()) == [512, 2048, 4096]
    assert sum(s.nbytes for s in tr.peak_live()) == tr.peak_bytes
    del a, c, d


def test_phase_peaks_before_reset() -> None:
    with StorageTracker(scan_baseline=False) as tr:
        tr.mark("forward")
        a = torch.empty(1024)  # 4,096
        b = torch.empty(1024)  # 8,192
        del a, b
        tr.mark("backward")
        c = torch.empty(256)  # 1,024
    assert tr.phase_peaks == {"init": 0, "forward": 8192, "backward": 1024}
    assert tr.phase_start_bytes == {"init": 0, "forward": 0, "backward": 0}
    assert (tr.peak_bytes, tr.peak_phase) == (8192, "forward")
    del c


def test_linear_forward_backward() -> None:
    lin, x = _linear()
    with StorageTracker(scan_baseline=False) as tr:
        tr.track(lin, x)
        # baseline: W 131,072 + x 8,192 = 139,264
        assert tr.baseline_bytes == W_BYTES + X_BYTES == 139264
        tr.mark("forward")
        y = lin(x)  # mm(x, W.t()): y 4,096 (W.t() is a view); mm saves x
        loss = y.sum()  # 512
        # forward peak: 139,264 + 4,096 + 512 = 143,872
        tr.mark("backward")
        loss.backward()
        # backward: ones_like grad 512, expanded (view) to [8,128]; mm for W's grad makes
        # [256,128]^T = 131,072, stolen by AccumulateGrad. Peak at that mm:
        # 139,264 + 4,096 + 512 + 512 + 131,072 = 275,456. Then the ones grad is freed.
        assert tr.live_bytes == 139264 + Y_BYTES + SCALAR + W_BYTES == 274944
    assert tr.phase_peaks["forward"] == 143872
    assert tr.peak_bytes == 275456
    assert (tr.peak_phase, tr.peak_op) == ("backward", "mm")
    assert tr.tracked_bytes(lin.weight.grad) == W_BYTES
    del y, loss


def test_saved_tensor_lives_until_backward() -> None:
    with StorageTracker(scan_baseline=False) as tr:
        a = torch.randn(1000, requires_grad=True)  # 4,096
        b = a * 2  # 4,096, saved by b * b below
        c = (b * b).sum()  # b*b 4,096 (not saved by sum, freed after it), c 512
        # forward peak: a + b + b*b + c = 3 * 4,096 + 512 = 12,800
        assert tr.peak_bytes == 12800
        del b
        # b's handle is gone, but MulBackward0 still holds it: a + b + c = 8,704
        assert tr.live_bytes == 8704
        c.backward()
        # backward: ones 512; MulBackward0 makes grad*b and grad*b (2 x 4,096) with b alive:
        # a + c + ones + b + 2 x 4,096 = 4,096 + 512 + 512 + 4,096 + 8,192 = 17,408.
        # After it, b is released; the InputBuffer add (4,096) of the two grads gives
        # a + c + ones + 3 x 4,096 = 17,408 again; then grad*2 goes to a.grad, and the ones
        # grad (held by torch.autograd.backward) is freed when backward returns.
        # End: a + a.grad + c = 8,704.
        assert tr.live_bytes == 8704
    assert tr.peak_bytes == 17408
    assert tr.tracked_bytes(a.grad) == 4096
    del a, c


def test_saved_output_is_freed_with_its_graph() -> None:
    # exp saves its *output*; the saved-tensor hook must not create an uncollectable cycle.
    with StorageTracker(scan_baseline=False) as tr:
        a = torch.randn(1000, requires_grad=True)  # 4,096
        z = a.exp()  # 4,096
        assert tr.live_bytes == 8192
        del z  # drops ExpBackward too, and with it the saved output
        assert tr.live_bytes == 4096
    del a


def test_baseline_scan_counts_params_and_backward_grads() -> None:
    lin, x = _linear()
    lin(x).sum().backward()  # W.grad exists in C++ only: no Python object until touched
    with StorageTracker() as tr:  # scan_baseline=True
        assert tr.tracked_bytes(lin.weight) == W_BYTES
        assert tr.tracked_bytes(lin.weight.grad) == W_BYTES
        assert tr.tracked_bytes(x) == X_BYTES
        assert tr.baseline_bytes >= 2 * W_BYTES + X_BYTES
        assert tr.live_bytes == tr.baseline_bytes == tr.peak_bytes
        assert {s.phase for s in tr.peak_live()} == {"baseline"}


@pytest.mark.parametrize("count_late", [False, True])
def test_count_late(count_late: bool) -> None:
    early = torch.tensor(2.0)  # before entry: found by the scan, so never "late"
    with StorageTracker(count_late=count_late) as tr:
        assert tr.tracked_bytes(early) == SCALAR
        base = tr.live_bytes
        s = torch.tensor(3.0)  # bypasses Python dispatch; first seen as input of lift_fresh
        x = torch.ones(1000)  # 4,096, an op output: always counted
        y = x * s  # 4,096; s is an input here too
        late = SCALAR if count_late else 0
        assert tr.live_bytes - base == 2 * 4096 + late
        assert tr.tracked_bytes(s) == late
        del s
        assert tr.live_bytes - base == 2 * 4096
    del x, y, early


def test_track_overrides_late() -> None:
    with StorageTracker(scan_baseline=False) as tr:
        s = torch.tensor([1.0, 2.0])  # late, ignored
        assert tr.tracked_bytes(s) == 0
        tr.track(s)  # explicit: counted as baseline
        assert tr.tracked_bytes(s) == SCALAR and tr.baseline_bytes == SCALAR
    del s


def test_model_built_inside_tracker() -> None:
    with StorageTracker(scan_baseline=False) as tr:
        lin = torch.nn.Linear(256, 128, bias=False)  # empty + kaiming_uniform_ (in place)
        assert tr.tracked_bytes(lin.weight) == W_BYTES
        assert tr.live_bytes == W_BYTES
        assert tr.peak_op == "empty.memory_format"


def test_categories_sgd() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False), torch.nn.Tanh())
    x = torch.randn(8, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with StorageTracker(scan_baseline=False) as tr:
        tr.track(model, x)
        tr.classify(model=model, optimizer=opt, inputs=[x])
        tr.mark("forward")
        y = model(x)  # h = mm 4,096 (freed after tanh), y = tanh(h) 4,096, saved by tanh
        loss = y.sum()  # 512
        # forward peak at tanh: W + x + h + y = 131,072 + 8,192 + 2 x 4,096 = 147,456
        tr.mark("backward")
        loss.backward()
        # backward: ones 512 (held by torch.autograd.backward's grad_tensors for the whole call)
        # -> tanh_backward 4,096 -> mm for W.grad 131,072. Peak at that mm:
        # W + x + y + loss + ones + tanh grad + W.grad
        #   = 131,072 + 8,192 + 4,096 + 512 + 512 + 4,096 + 131,072 = 279,552
        tr.mark("optimizer")
        opt.step()  # p.add_(grad, alpha=-lr): in place, nothing new
        cats = tr.attribute()
    assert tr.phase_peaks["forward"] == 147456
    assert tr.peak_bytes == 279552 and tr.peak_op == "mm"
    assert cats == {
        "parameters": W_BYTES,
        "gradients": W_BYTES,
        "optimizer": 0,
        "inputs": X_BYTES,
        "activations": Y_BYTES,  # tanh's saved output
        "temporaries": 2 * SCALAR + Y_BYTES,  # loss, the ones grad and the tanh grad
    }
    assert sum(cats.values()) == tr.peak_bytes
    del y, loss


@pytest.mark.parametrize("count_late", [False, True])
def test_categories_adam_for_loop(count_late: bool) -> None:
    lin, x = _linear()
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3, foreach=False)
    with StorageTracker(scan_baseline=False, count_late=count_late) as tr:
        tr.track(lin, x)
        tr.classify(model=lin, optimizer=opt, inputs=[x])
        y = lin(x)  # 4,096
        loss = y.sum()  # 512
        loss.backward()  # W.grad 131,072
        tr.mark("optimizer")
        opt.step()
        # step 1 creates exp_avg, exp_avg_sq (2 x 131,072) and state['step'] = torch.tensor(0.)
        # (late: 512 only with count_late). Then denom = (exp_avg_sq.sqrt() / c).add_(eps): the
        # sqrt and the div (2 x 131,072) are alive together. Peak at that div:
        # W + grad + 2 states + sqrt + div + x + y + loss
        #   = 6 x 131,072 + 8,192 + 4,096 + 512 = 799,232  (+ 512 step scalar if counted)
        cats = tr.attribute()
    late = SCALAR if count_late else 0
    assert tr.peak_bytes == 799232 + late
    assert (tr.peak_phase, tr.peak_op) == ("optimizer", "div.Tensor")
    assert cats == {
        "parameters": W_BYTES,
        "gradients": W_BYTES,
        "optimizer": 2 * W_BYTES + late,
        "inputs": X_BYTES,
        "activations": 0,  # mm saved only x (an input) and W (a parameter)
        "temporaries": 2 * W_BYTES + Y_BYTES + SCALAR,  # sqrt, div, y, loss
    }
    assert sum(cats.values()) == tr.peak_bytes
    assert set(cats) == set(CATEGORIES)
    del y, loss


def test_grads_keep_category_after_zero_grad() -> None:
    lin, x = _linear()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with StorageTracker(scan_baseline=False) as tr:
        tr.track(lin, x)
        tr.classify(model=lin, optimizer=opt)
        lin(x).sum().backward()  # peak 275,456 as in test_linear_forward_backward, minus y/loss
        tr.mark("zero_grad")  # resolves W.grad's storage as a gradient before it is freed
        opt.zero_grad(set_to_none=True)
        cats = tr.attribute()
    assert cats["gradients"] == W_BYTES
    assert sum(cats.values()) == tr.peak_bytes


def test_free_on_another_thread_and_in_gc_cycle() -> None:
    with StorageTracker(scan_baseline=False) as tr:
        box = [torch.empty(1024)]  # 4,096
        cyc: list[object] = [torch.empty(2048)]  # 8,192, kept only by a reference cycle
        cyc.append(cyc)
        assert tr.live_bytes == 12288
        thread = threading.Thread(target=box.clear)  # the weakref callback fires on that thread
        thread.start()
        thread.join()
        assert tr.live_bytes == 8192
        del cyc
        gc.collect()
        assert tr.live_bytes == 0
    assert tr.peak_bytes == 12288


def test_exit_restores_and_stops_counting() -> None:
    with StorageTracker(scan_baseline=False) as tr:
        a = torch.empty(1024)
    torch.empty(4096)  # not seen
    assert tr.live_bytes == 4096 and tr.peak_bytes == 4096
    del a
    assert tr.live_bytes == 0


def test_snapshot_survives_log_compaction(monkeypatch: pytest.MonkeyPatch) -> None:
    import verify.measure.tracker as tracker_module

    monkeypatch.setattr(tracker_module, "_COMPACT_LOG_EVENTS", 10)
    with StorageTracker(scan_baseline=False) as tr:
        big = [torch.empty(1024) for _ in range(4)]  # peak: 4 x 4,096 = 16,384
        del big
        for _ in range(50):  # 100 alloc/free events: the log is compacted several times
            torch.empty(256)  # 1,024, freed at once
        keep = torch.empty(128)  # 512
    assert tr.peak_bytes == 16384
    assert [s.nbytes for s in tr.peak_live()] == [4096] * 4
    del keep


def test_overhead_500_ops() -> None:
    x = torch.ones(64)
    with StorageTracker(scan_baseline=False) as tr:
        start = time.perf_counter()
        for _ in range(500):
            x = x + 1  # one op, one 512 B output, one free
        elapsed = time.perf_counter() - start
    assert tr.peak_bytes == 1024  # the new x exists before the old one is freed
    assert elapsed < 1.0


@pytest.fixture
def gloo_world() -> object:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except Exception as exc:
        pytest.skip(f"cannot start a 1-process gloo group: {exc}")
    yield dist
    dist.destroy_process_group()


def test_dtensor_counts_local_storage(gloo_world: object) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    # A DTensor that claims a global [4000] but holds a local [1000]: its wrapper storage
    # reports the global 16,000 B, its real data is 4,000 B.
    local = torch.randn(1000)
    d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(4000,), stride=(1,))
    with StorageTracker() as tr:
        assert tr.tracked_bytes(d) == 4096  # the baseline scan found the local storage only
        before = tr.live_bytes
        e = d * 2  # new local [1000]: 4,000 B -> 4,096
        assert isinstance(e, DTensor)
        assert tr.live_bytes - before == 4096
        assert tr.tracked_bytes(e) == 4096
        del e
        assert tr.live_bytes == before


def test_fsdp2_unsharded_params_freed_by_resize(gloo_world: object) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with StorageTracker() as tr:  # entered before wrapping, as on GPU
        model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(2)))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        before = tr.live_bytes
        x = torch.randn(8, 256)  # 8,192
        loss = model(x).sum()
        # each layer all-gathers its 262,144 B weight into an unsharded storage and frees it
        # with storage.resize_(0) after its forward (outside dispatch). What stays:
        # x 8,192 + layer-0 output 8,192 (saved by layer 1's mm) + loss 512 = 16,896
        assert tr.live_bytes - before == 16896
        loss.backward()
    assert "UntypedStorage.resize_" in tr.peak_by_op()  # re-allocated for backward
