"""`calc.step.optimizer.optimizer_step` against hand derivations and against the real optimizers.

Sizes: every storage counts ``ceil(nbytes/512)*512`` (an empty one 0); fp32 4 B, bf16 2 B,
uint8 1 B per element; a 0-d tensor counts 512.

Measured tests build `verify.models.optimizers.build` for a small model, set ``p.grad`` before the
tracker baseline, run one step under `verify.measure.tracker.StorageTracker` and compare the peak above
the baseline and the bytes still alive after the step with the tape replay of the same step.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calc.config.jobs import Training
from calc.replay.tape import Tape, Tensor
from calc.step.optimizer import (
    OptimizerStates,
    existing_states,
    optimizer_step,
    paged_state_bytes,
    state_bytes_per_param,
)

torch = pytest.importorskip("torch")

from verify.measure.tracker import StorageTracker  # noqa: E402
from verify.models import optimizers as vopt  # noqa: E402

# ------------------------------------------------------------------------------ tape helpers


def _tape(specs: list[tuple[tuple[int, ...], int]]) -> tuple[Tape, list[Tensor], list[tuple]]:
    """A tape holding params (and their grads) of the given (shape, itemsize), tags p0, p1..."""
    tape = Tape()
    leaves, shapes = [], []
    for i, (shape, itemsize) in enumerate(specs):
        n = 1
        for d in shape:
            n *= d
        leaf = tape.existing(n, itemsize, f"p{i}", "weight", leaf=True, tag=f"p{i}")
        tape.grads[id(leaf.storage)] = tape.existing(n, itemsize, f"grad:p{i}", "grad", tag=f"p{i}")
        leaves.append(leaf)
        shapes.append(shape)
    return tape, leaves, shapes


def _live(tape: Tape) -> int:
    return sum(storage.size for storage in tape.live.values())


def _replay(
    tape: Tape,
    leaves: list[Tensor],
    shapes: list[tuple],
    job: Training,
    first: bool,
    states: OptimizerStates | None = None,
    device: str = "cpu",
) -> tuple[int, int, OptimizerStates]:
    """(peak above the live bytes at the call, bytes left alive by it, states)."""
    if not first and states is None:
        states = existing_states(
            tape,
            leaves,
            optimizer=job.optimizer,
            impl=job.optimizer_impl,
            precision=job.precision,
            device=device,
            shapes=shapes,
        )
    start, base = len(tape.events), _live(tape)
    st = optimizer_step(
        tape,
        leaves,
        optimizer=job.optimizer,
        impl=job.optimizer_impl,
        precision=job.precision,
        first_step=first,
        weight_decay=job.weight_decay,
        device=device,
        shapes=shapes,
        states=states,
    )
    peak = max([base] + [sum(k[3] * c for k, c in e.live) for e in tape.events[start:]])
    return peak - base, _live(tape) - base, st


# ------------------------------------------------------------------------------ hand-derived


def _job(optimizer: str, impl: str, precision: str = "fp32", wd: float = 0.0) -> Training:
    return Training(
        micro_batch=1,
        seq_len=1,
        optimizer=optimizer,
        optimizer_impl=impl,
        precision=precision,
        weight_decay=wd,
    )


def test_adamw_foreach_fp32_two_params_by_hand() -> None:
    # params of 1000 and 10 fp32 elements: 4000 B -> 4096, 40 B -> 512.
    # first step: exp_avg + exp_avg_sq per param = 2*(4096+512) = 9216 persistent;
    # then _foreach_sqrt over the group: 4096+512 = 4608 on top -> peak 13,824.
    tape, leaves, shapes = _tape([((1000,), 4), ((10,), 4)])
    peak, kept, _ = _replay(tape, leaves, shapes, _job("adamw", "foreach"), first=True)
    assert kept == 2 * (4096 + 512) == 9216
    assert peak == 9216 + 4096 + 512 == 13824


def test_adam_coupled_decay_foreach_by_hand() -> None:
    # Adam, wd != 0, second step (states pre-exist): _foreach_add copy of the grads 4608, deleted
    # before the sqrt 4608: the peak temporary stays one group, 4608; nothing kept.
    tape, leaves, shapes = _tape([((1000,), 4), ((10,), 4)])
    peak, kept, _ = _replay(tape, leaves, shapes, _job("adam", "foreach", wd=0.1), first=False)
    assert (peak, kept) == (4608, 0)


def test_adam_for_loop_by_hand() -> None:
    # for-loop, second step, no decay. param 0: sqrt 4096 + denom 4096 (8192), sqrt freed;
    # param 1: old denom 4096 still held + sqrt 512 + denom 512 = 5120. Peak 8192.
    tape, leaves, shapes = _tape([((1000,), 4), ((10,), 4)])
    peak, kept, _ = _replay(tape, leaves, shapes, _job("adam", "for-loop"), first=False)
    assert (peak, kept) == (8192, 0)
    # reversed order: 512+512, then old denom 512 + 4096 + 4096 = 8704
    tape, leaves, shapes = _tape([((10,), 4), ((1000,), 4)])
    peak, _, _ = _replay(tape, leaves, shapes, _job("adam", "for-loop"), first=False)
    assert peak == 8704


def test_fused_adam_cuda_step_tensors_by_hand() -> None:
    # fused: per param a 0-d fp32 step (512) + exp_avg + exp_avg_sq, no temporaries.
    # bf16 params of 1000 (2000 B -> 2048) and 10 (512): 2*512 + 2*(2048+512) = 6144.
    tape, leaves, shapes = _tape([((1000,), 2), ((10,), 2)])
    peak, kept, _ = _replay(
        tape, leaves, shapes, _job("adamw", "fused", "bf16"), first=True, device="cuda"
    )
    assert peak == kept == 6144


def test_sgd_momentum_first_step_by_hand() -> None:
    # for-loop, wd: param 0 grad.add(param) 4096, its clone (buffer) 4096 -> 8192, temp freed;
    # param 1: 4096 + 512 + 512 = 5120. Kept: buffers 4608.
    tape, leaves, shapes = _tape([((1000,), 4), ((10,), 4)])
    peak, kept, _ = _replay(
        tape, leaves, shapes, _job("sgd-momentum", "for-loop", wd=0.1), first=True
    )
    assert (peak, kept) == (8192, 4608)
    # foreach: group copy 4608, then both clones 4608 -> 9216 before the copy is released.
    tape, leaves, shapes = _tape([((1000,), 4), ((10,), 4)])
    peak, kept, _ = _replay(
        tape, leaves, shapes, _job("sgd-momentum", "foreach", wd=0.1), first=True
    )
    assert (peak, kept) == (9216, 4608)


def test_adafactor_for_loop_by_hand() -> None:
    # fp32 (3, 40, 50) param: row_var 3*40*4 = 480 -> 512, col_var 600 -> 1024 (1536 kept).
    # update: norm 512 (dropped); row_mean 512, col_mean 1024, var_estimate 24000 -> 24064,
    # row_var_mean 512: peak 512 + 1024 + 24064 + 512 = 26112 above the states.
    tape, leaves, shapes = _tape([((3, 40, 50), 4)])
    peak, kept, _ = _replay(tape, leaves, shapes, _job("adafactor", "for-loop"), first=True)
    assert kept == 1536
    assert peak == 1536 + 26112


def test_adam8bit_layout_by_hand() -> None:
    # 5000 elements: uint8 5000 -> 5120 twice, absmax ceil(5000/256)=20 fp32 = 80 -> 512 twice;
    # 100 elements (< 4096): fp32 400 -> 512 twice. CUDA adds two 1 KiB qmaps once.
    tape, leaves, shapes = _tape([((5000,), 4), ((100,), 4)])
    peak, kept, _ = _replay(
        tape, leaves, shapes, _job("adam8bit", "for-loop"), first=True, device="cuda"
    )
    assert peak == kept == 2 * 5120 + 2 * 512 + 2 * 512 + 2 * 1024


def test_adam32bit_and_paged_states_by_hand() -> None:
    # bitsandbytes Adam32bit: fp32 state1/state2 for every param (5000 x 4 = 20,000 -> 20,480
    # twice; 100 x 4 = 400 -> 512 twice), no qmaps, no temporaries (one in-place kernel).
    tape, leaves, shapes = _tape([((5000,), 2), ((100,), 2)])
    peak, kept, _ = _replay(tape, leaves, shapes, _job("adam32bit", "for-loop"), first=True)
    assert peak == kept == 2 * 20480 + 2 * 512
    # Paged: a param of 100,000 elements or more keeps its state1/state2 out of PyTorch's
    # allocator; its absmax (8-bit) stays. 200,000 elements, 8-bit: absmax ceil(200000/256) =
    # 782 fp32 = 3,128 -> 3,584 twice; 5000 elements: not paged, uint8 5,120 twice + 512 twice.
    tape, leaves, shapes = _tape([((200_000,), 4), ((5000,), 4)])
    job = replace(_job("adam8bit", "for-loop"), paged_optimizer=True)
    st = optimizer_step(
        tape, leaves, optimizer="adam8bit", impl="for-loop", precision="fp32", first_step=True,
        weight_decay=0.0, device="cpu", shapes=shapes, paged=job.paged_optimizer,
    )  # fmt: skip
    kept_bytes = sum(t.storage.size for t in st.tensors())
    assert kept_bytes == 2 * 3584 + 2 * 5120 + 2 * 512
    # what is paged: 2 x 200,000 uint8 (the smaller param is below the threshold)
    assert paged_state_bytes([200_000, 5000], "adam8bit") == 400_000
    assert paged_state_bytes([200_000, 5000], "adam32bit") == 1_600_000


def test_amp_fp16_scaler_scalars_by_hand() -> None:
    # SGD without decay or momentum allocates nothing itself. unscale_: double + reciprocal
    # (1024), then inv_scale + found_inf + the replicator's copy of each (4 x 512 = 2048);
    # nothing kept after update().
    tape, leaves, shapes = _tape([((1000,), 4)])
    peak, kept, _ = _replay(tape, leaves, shapes, _job("sgd", "foreach", "amp-fp16"), first=True)
    assert (peak, kept) == (2048, 0)
    # fused: dummy_inv_scale + found_inf + their copies (2048); later found_inf copy +
    # found_inf_sum + grad_scale (1536)
    tape, leaves, shapes = _tape([((1000,), 4)])
    peak, kept, _ = _replay(tape, leaves, shapes, _job("sgd", "fused", "amp-fp16"), first=True)
    assert (peak, kept) == (2048, 0)


def test_bf16_master_by_hand() -> None:
    # bf16 param of 1000 (2048 B), SGD for-loop, first step: master fp32 4096 (kept) + fp32 grad
    # 4096 (dropped at the end): peak 8192, kept 4096.
    tape, leaves, shapes = _tape([((1000,), 2)])
    peak, kept, states = _replay(
        tape, leaves, shapes, _job("sgd", "for-loop", "bf16-master"), first=True
    )
    assert (peak, kept) == (8192, 4096)
    assert [t.storage.tag for t in states.tensors()] == ["p0"]


def test_state_tags_and_closed_form() -> None:
    specs = [((7, 50), 4), ((50,), 4), ((2, 65, 41), 4)]
    for name, impl in [
        ("adamw", "fused"),
        ("adafactor", "foreach"),
        ("adam8bit", "foreach"),
        ("lion", "for-loop"),
        ("sgd-momentum", "foreach"),
    ]:
        tape, leaves, shapes = _tape(specs)
        job = _job(name, impl)
        _, kept, states = _replay(tape, leaves, shapes, job, first=True)
        for i, leaf in enumerate(leaves):
            assert {t.storage.tag for t in states.per_param[id(leaf.storage)].values()} == {f"p{i}"}
        closed = sum(
            state_bytes_per_param(
                leaf.numel, 4, optimizer=name, impl=impl, precision="fp32", shape=shape
            )
            for leaf, shape in zip(leaves, shapes, strict=True)
        )
        assert kept == closed, name


# ------------------------------------------------------------------------------ measured


class _Model(torch.nn.Module):
    """Odd sizes: weights >= 4096 and < 4096 elements, 1-D biases, a 3-D param."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(37, 129),  # 4773 + 129
            torch.nn.Linear(129, 50),  # 6450 + 50
            torch.nn.Linear(50, 7),  # 350 + 7
        )
        self.cube = torch.nn.Parameter(torch.randn(2, 65, 41))  # 5330, 3-D


def _measure(bundle: vopt.OptimizerBundle) -> tuple[int, int]:
    with StorageTracker(scan_baseline=False, track_saved=False) as tr:
        tr.track(*bundle.tensors())
        tr.reset_peak()
        base = tr.live_bytes
        vopt.step(bundle)
        return tr.peak_bytes - base, tr.live_bytes - base


def _combos() -> list[tuple[str, str, str]]:
    out = []
    for name in ("sgd", "sgd-momentum", "adam", "adamw", "adam8bit", "adafactor", "lion"):
        impls = (
            ("foreach", "fused", "for-loop")
            if name in ("sgd", "sgd-momentum", "adam", "adamw")
            else ("foreach", "for-loop")
        )
        for impl, prec in itertools.product(impls, ("fp32", "bf16", "bf16-master", "amp-fp16")):
            out.append((name, impl, prec))
    return out


def _compare(model: torch.nn.Module, job: Training) -> None:
    """Steps 1 and 2 measured and replayed; exact, or within the 8-bit emulation's scratch."""
    bundle = vopt.build(model, job)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    if bundle.scaler is not None:
        vopt.scale_loss(bundle, torch.ones(()))  # makes the scale and growth tensors
    tape, leaves, shapes = _tape([(tuple(p.shape), p.element_size()) for p in params])
    states = None
    for first in (True, False):
        m_peak, m_kept = _measure(bundle)
        c_peak, c_kept, states = _replay(tape, leaves, shapes, job, first, states)
        assert m_kept == c_kept, (first, m_kept, c_kept)
        if job.optimizer == "adam8bit" and vopt.adam8bit_class() is vopt.BlockwiseAdam8bit:
            # the emulation's chunk temporaries stand in for bitsandbytes' in-place kernel
            assert 0 <= m_peak - c_peak <= vopt.EMULATION_SCRATCH_BYTES, (first, m_peak, c_peak)
        else:
            assert m_peak == c_peak, (first, m_peak, c_peak)


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize(("name", "impl", "precision"), _combos())
def test_replay_matches_tracker(name: str, impl: str, precision: str, wd: float) -> None:
    torch.manual_seed(0)
    model = _Model()
    if precision in ("bf16", "bf16-master"):
        model = model.to(torch.bfloat16)
    _compare(model, _job(name, impl, precision, wd))


_SHAPE = st.one_of(
    st.tuples(st.integers(1, 6000)),
    st.tuples(st.integers(1, 90), st.integers(1, 90)),
    st.tuples(st.integers(1, 4), st.integers(1, 30), st.integers(1, 30)),
)


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(_SHAPE, min_size=1, max_size=4),
    combo=st.sampled_from(_combos()),
    wd=st.sampled_from([0.0, 0.01]),
)
def test_replay_matches_tracker_random_shapes(
    shapes: list[tuple[int, ...]], combo: tuple[str, str, str], wd: float
) -> None:
    name, impl, precision = combo
    dtype = torch.bfloat16 if precision in ("bf16", "bf16-master") else torch.float32
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
    )
    _compare(model, _job(name, impl, precision, wd))


def test_host_step_scalars_are_invisible_unless_counted_late() -> None:
    # Adam's non-fused step counters are torch.tensor(0.0) on the host: they bypass Python
    # dispatch, so the tracker (count_late=False) ignores them as calc does; counted from first
    # sight (count_late=True) they add one 512-B block per param to what the first step keeps.
    torch.manual_seed(0)
    model = _Model()
    n = len(list(model.parameters()))
    bundle = vopt.build(model, _job("adamw", "foreach"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    tape, leaves, shapes = _tape([(tuple(p.shape), 4) for p in model.parameters()])
    _, c_kept, _ = _replay(tape, leaves, shapes, bundle.job, first=True)
    with StorageTracker(scan_baseline=False, track_saved=False, count_late=True) as tr:
        tr.track(*bundle.tensors())
        base = tr.live_bytes
        vopt.step(bundle)
        kept = tr.live_bytes - base
    assert kept == c_kept + n * 512


@pytest.mark.parametrize("name", ["adam", "sgd-momentum", "lion", "adafactor"])
def test_mixed_dtype_groups_within_one_group(name: str) -> None:
    # Two (device, dtype) groups. torch iterates them in the order of a C++ std::unordered_map
    # (``_group_tensors_by_first_tensors_device_and_dtype``; here bf16 before fp32), calc in
    # order of first appearance, so the temporaries alive across a group boundary (Adam's
    # sqrt, SGD's decayed-grad copy, Adafactor's updates) can differ: the peak is within twice
    # the largest group's rounded bytes, the states are exact. No supported precision makes
    # mixed groups: every optimizer sees params of one dtype.
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(1000)),  # fp32 4096
        torch.nn.Parameter(torch.randn(30, 100, dtype=torch.bfloat16)),  # bf16 6144
        torch.nn.Parameter(torch.randn(10)),  # fp32 512
    ]
    bound = 2 * max(4096 + 512, 6144)
    job = _job(name, "foreach", wd=0.1)
    bundle = vopt.OptimizerBundle(job=job, params=params, stepper=vopt._make_factory(job)(params))
    for p in params:
        p.grad = torch.randn_like(p)
    tape, leaves, shapes = _tape([(tuple(p.shape), p.element_size()) for p in params])
    states = None
    for first in (True, False):
        m_peak, m_kept = _measure(bundle)
        c_peak, c_kept, states = _replay(tape, leaves, shapes, job, first, states)
        assert m_kept == c_kept, first
        assert abs(m_peak - c_peak) <= bound, (first, m_peak, c_peak)
