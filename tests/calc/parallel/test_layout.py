"""calc.Parallelism, the sharding layer and the data-parallel terms (DDP, ZeRO, FSDP2).

Expected values are hand derivations written here or the ZeRO paper's model-state figures
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020, §3.1 and Fig. 1: mixed-precision Adam holds 2 + 2 + 12 bytes per parameter; with N
data-parallel ranks P_os keeps 12/N of the optimizer states, P_os+g also 2/N of the gradients,
P_os+g+p also 2/N of the parameters). Measured accuracy lives in ``python -m verify --nproc``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import calc
from calc.config.parallelism import check_divisibility, layers_per_stage
from calc.parallel.data import assign_buckets, bucket_bytes, zero_redundancy_partition
from calc.parallel.fsdp import shard_numel
from calc.parallel.layout import holding
from tests.specs import tiny_llama

MIB = 1 << 20


ZERO_LLAMA = {"name": "zero-llama", "hidden": 512, "n_heads": 8, "n_kv_heads": 8,
              "head_dim": 64, "ffn": 1024, "vocab": 512}  # fmt: skip


def _llama(**changes: object) -> calc.ModelSpec:
    return tiny_llama(**{**ZERO_LLAMA, **changes})


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dp": 0}, "dp"),
        ({"tp": -1}, "tp"),
        ({"pp": 1.5}, "pp"),
        ({"cp": True}, "cp"),
        ({"zero": 4}, "zero"),
        ({"zero": True}, "zero"),
        ({"sp": 1}, "sp"),
        ({"offload": "disk"}, "offload"),
        ({"pp_schedule": "zb"}, "pp_schedule"),
        ({"ddp_bucket_mib": 0}, "ddp_bucket_mib"),
        ({"zero_partition": "rows"}, "zero_partition"),
    ],
)
def test_invalid_fields_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        calc.Parallelism(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fsdp": True, "zero": 1},  # FSDP2 is ZeRO-3 sharding
        {"sp": True},  # sequence parallelism needs tp > 1
        {"pp_virtual_stages": 2},  # only interleaved 1F1B has virtual stages
        {"offload": "optimizer+params", "zero": 2},  # parameters offload as shards
        {"zero_partition": "by-parameter", "zero": 2},  # a ZeRO-1 layout
    ],
)
def test_inconsistent_combinations_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        calc.Parallelism(**kwargs)


def test_world_size_and_shard_level() -> None:
    par = calc.Parallelism(dp=2, tp=4, pp=2, cp=2, fsdp=True)
    assert par.world_size == 32
    assert par.shard_level == 3
    assert calc.Parallelism().is_single


def test_divisibility_errors_name_the_dimension() -> None:
    qwen = calc.load_card("qwen2.5-32b")  # 40 heads, 8 kv heads, 64 layers
    check_divisibility(qwen, calc.Parallelism(tp=8))
    with pytest.raises(ValueError, match="n_heads=40"):
        check_divisibility(qwen, calc.Parallelism(tp=16))
    with pytest.raises(ValueError, match="n_kv_heads=8"):
        check_divisibility(qwen, calc.Parallelism(tp=5))
    with pytest.raises(ValueError, match="n_layers=64"):
        check_divisibility(qwen, calc.Parallelism(pp=65))


def test_uneven_pipeline_split_puts_extra_layers_first() -> None:
    # 64 layers on 3 stages: 22, 21, 21; with 2 virtual stages each (6 chunks of 11, 11, 11,
    # 11, 10, 10), rank r holds chunks r and r + 3.
    assert layers_per_stage(64, calc.Parallelism(pp=3)) == (22, 21, 21)
    par = calc.Parallelism(pp=3, pp_virtual_stages=2, pp_schedule="interleaved-1f1b")
    assert layers_per_stage(64, par) == (22, 21, 21)


def test_holding_per_zero_stage() -> None:
    """ZeRO §5.1-5.3: stage 1 shards states, 2 also gradients, 3 also parameters."""
    for zero, sharded in ((0, set()), (1, {"state"}), (2, {"state", "grad"}),
                          (3, {"state", "grad", "weight"})):  # fmt: skip
        par = calc.Parallelism(dp=4, zero=zero)
        got = {k for k in ("weight", "grad", "state") if "dp-sharded" in holding(k, par)}
        assert got == sharded
    par = calc.Parallelism(dp=4, zero=1, zero_partition="by-parameter")
    assert holding("state", par) == ("dp-owned",)
    assert holding("state", calc.Parallelism(dp=4, offload="optimizer")) == ("cpu",)
    assert holding("activation", calc.Parallelism(dp=4, zero=3)) == ("replicated",)


# ---------------------------------------------------------------------- DDP buckets, ZeRO-1


def test_bucket_assignment_by_hand() -> None:
    # fp32 grads of 100k, 200k, 50k, 7M, 1M elements, limits [1 MiB, 25 MiB]: the first bucket
    # closes at 1.2 MB >= 1 MiB (tensors 0, 1); then 0.2 MB + 28 MB >= 25 MiB closes (2, 3);
    # 4 MB stays open and ends as the last bucket.
    grads = [(4, 100_000), (4, 200_000), (4, 50_000), (4, 7_000_000), (4, 1_000_000)]
    buckets = assign_buckets(grads, [MIB, 25 * MIB])
    assert buckets == [[0, 1], [2, 3], [4]]
    # 512-aligned: 1,200,000 B -> 1,200,128; 28,200,000 -> 28,200,448; 4,000,000 -> 4,000,256.
    assert bucket_bytes(grads, buckets) == [1_200_128, 28_200_448, 4_000_256]


def test_bucket_assignment_separates_dtypes() -> None:
    grads = [(2, 10), (4, 10), (2, 10)]
    assert sorted(assign_buckets(grads, [MIB])) == [[0, 2], [1]]


def test_zero_redundancy_partition_by_hand() -> None:
    # sizes 5, 3, 3, 2 over 2 ranks, largest first to the least-loaded (lowest on ties):
    # 5 -> r0 (5, 0); 3 -> r1 (5, 3); 3 -> r1 (5, 6); 2 -> r0 (7, 6).
    assert zero_redundancy_partition([5, 3, 3, 2], 2) == [[0, 3], [1, 2]]
    assert zero_redundancy_partition([1, 1, 1], 4) == [[0], [1], [2], []]


def test_shard_numel_pads_dim0() -> None:
    assert shard_numel((10, 3), 4) == 9  # ceil(10 / 4) = 3 rows of 3
    assert shard_numel((8,), 4) == 2


# ---------------------------------------------------------------------- ZeRO paper oracle


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_follow_the_zero_paper(zero: int, n: int) -> None:
    """bf16 weights and gradients, fp32 master weights and Adam moments (the paper's mixed
    precision, K = 12): at a peak of step 2 (or of step 1's optimizer) every state exists, so
    the optimizer holds 12 Psi / N bytes from ZeRO-1 on (12 Psi without); at an optimizer-step
    peak the parameters are 2 Psi (2 Psi / N with ZeRO-3, whose unsharded copies are freed after
    the backward). The model's dims make every shard a multiple of 512 bytes, so allocator
    rounding adds nothing."""
    model = _llama()
    psi = model.n_params
    job = calc.Training(micro_batch=1, seq_len=16, precision="bf16-master",
                        implementation="reference")  # fmt: skip
    est = calc.estimate(model, job, calc.Parallelism(dp=n, zero=zero), device="cuda")
    phase = est.peak_phase
    assert phase.startswith("step2/") or phase.endswith("/optimizer"), phase
    tree = est.breakdown
    assert tree["optimizer"] == (12 * psi if zero == 0 else 12 * psi // n)
    if phase.endswith("/optimizer"):
        assert tree["weights"] == (2 * psi // n if zero == 3 else 2 * psi)
    else:  # ZeRO-3 peaking in the backward: shards plus the layers gathered then
        assert zero == 3
        assert 2 * psi // n < tree["weights"] < 2 * psi


def test_ddp_buckets_are_one_more_gradient_copy() -> None:
    """memory-facts §2.3: without gradient_as_bucket_view DDP holds the buckets besides .grad:
    one more gradient-sized set (fp32, this model's gradients are 512-aligned per bucket)."""
    model = _llama()
    job = calc.Training(micro_batch=1, seq_len=16, precision="fp32", implementation="reference")
    single = calc.estimate(model, job, device="cpu")
    ddp = calc.estimate(model, job, calc.Parallelism(dp=2), device="cpu")
    assert ddp.breakdown["ddp/gradient_buckets"] == 4 * model.n_params
    assert ddp.peak_bytes == single.peak_bytes + 4 * model.n_params


def test_most_loaded_rank_and_rank_keys() -> None:
    model = _llama()
    job = calc.Training(micro_batch=1, seq_len=16, precision="fp32", implementation="reference")
    par = calc.Parallelism(dp=4, zero=1, zero_partition="by-parameter")
    est = calc.estimate(model, job, par, device="cpu")
    assert sorted(est.rank_peaks) == [0, 1, 2, 3]
    assert est.peak_bytes == max(est.rank_peaks.values()) == est.rank_peaks[est.rank]
    assert all(est.breakdown[f"ranks/{r}"] == v for r, v in est.rank_peaks.items())


# ---------------------------------------------------------------------- properties


@settings(max_examples=15, deadline=None)
@given(
    dp=st.sampled_from([2, 4, 8]),
    seq=st.sampled_from([8, 32]),
    precision=st.sampled_from(["fp32", "bf16", "bf16-master"]),
)
def test_memory_never_grows_with_the_zero_stage(dp: int, seq: int, precision: str) -> None:
    """ZeRO-1 and ZeRO-2 shard one more kind of tensor each: the most-loaded rank never grows
    from DDP to stage 1 to stage 2, nor with more ranks at stages 1 and 3. (Stage 3 is not
    always below stage 2: on a two-layer model FSDP2's all-gather and reduce-scatter buffers,
    about a layer each times N / N, outweigh the parameter shards it saves.)"""
    model = _llama()
    job = calc.Training(micro_batch=1, seq_len=seq, precision=precision,
                        implementation="reference")  # fmt: skip

    def peak(d: int, z: int) -> int:
        return calc.estimate(model, job, calc.Parallelism(dp=d, zero=z), device="cpu").peak_bytes

    assert peak(dp, 0) >= peak(dp, 1) >= peak(dp, 2)
    assert peak(2 * dp, 1) <= peak(dp, 1)
    assert peak(2 * dp, 3) <= peak(dp, 3)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_replay_generalises_over_layers(reshard: bool) -> None:
    """The five-layer replay that stands for any L (calc.replay.timeline) gives the same peak and
    phases for FSDP2 as replaying all seven layers, whose per-layer all-gathers, reshards and
    reduce-scatters it must extrapolate."""
    from calc.estimate.core import ReplayOptions, compiled_for, evaluate
    from calc.parallel.data import ReplayPlan

    model = _llama(n_layers=7, hidden=64, n_heads=4, n_kv_heads=4, head_dim=16, ffn=128,
                   vocab=256)  # fmt: skip
    job = calc.Training(micro_batch=2, seq_len=16, precision="fp32", implementation="reference")
    plan = ReplayPlan(fsdp=True, shard_world=2, reshard_after_forward=reshard)
    out = []
    for exact in (False, True):
        comp, key = compiled_for(model, job, "cpu", ReplayOptions(dp=plan, exact_layers=exact))
        assert comp.l_min == (7 if exact else 5)
        out.append(evaluate(comp, key, model, job, "cpu"))
    assert out[0].peak_bytes == out[1].peak_bytes
    assert out[0].phases == out[1].phases


def test_offload_keeps_states_off_the_gpu() -> None:
    """ZeRO-Offload / ZeRO-Infinity: with the optimizer offloaded no optimizer state or step
    temporary is on the GPU; with the parameters offloaded too, no parameter shard either, so
    at a forward peak the GPU holds only the layers gathered then."""
    model = _llama()
    job = calc.Training(micro_batch=1, seq_len=16, precision="bf16-master",
                        implementation="reference")  # fmt: skip
    base = calc.estimate(model, job, calc.Parallelism(dp=4, zero=3))
    opt = calc.estimate(model, job, calc.Parallelism(dp=4, zero=3, offload="optimizer"))
    both = calc.estimate(model, job, calc.Parallelism(dp=4, zero=3, offload="optimizer+params"))
    assert base.breakdown["optimizer"] == 12 * model.n_params // 4
    for est in (opt, both):
        assert "optimizer" not in est.breakdown
    assert both.peak_bytes < opt.peak_bytes < base.peak_bytes
    with pytest.raises(NotImplementedError, match="dp > 1"):
        calc.estimate(model, job, calc.Parallelism(tp=2, offload="optimizer"))
