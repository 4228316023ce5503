"""LoRA and QLoRA under data parallelism (DDP; LoRA also under FSDP2): buckets, states, refusals.

Expected values are hand derivations written here. The source of each rule: DDP builds its
reducer over the parameters with ``requires_grad`` only (``torch/nn/parallel/distributed.py``,
``_build_params_for_reducer``), so a frozen LoRA base is in no bucket; the first iteration
uses one bucket per dtype holding every such parameter (``compute_bucket_size_limits`` returns
``[sys.maxsize]`` before the rebuild); each bucket is one allocation, rounded up to 512 bytes
like every CPU/CUDA allocation (memory-facts §1). Measured accuracy of these layouts lives in
``python -m verify --nproc 2 --cases dist-lora,dist-qlora``.
"""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama

LORA_DP_LLAMA = {"name": "lora-dp-llama", "hidden": 520, "n_heads": 8, "n_kv_heads": 8,
                 "head_dim": 65, "ffn": 1024, "vocab": 512}  # fmt: skip


def _llama(**changes: object) -> calc.ModelSpec:
    """hidden 520 = 8 heads x 65: every attention adapter of rank 1 is 520 elements, so bf16
    adapter gradients are 1040 B, not a multiple of 512 (rounding per bucket shows)."""
    return tiny_llama(**{**LORA_DP_LLAMA, **changes})


ATTN = ("q", "k", "v", "o")


def _job(**changes: object) -> calc.Training:
    kw = dict(micro_batch=1, seq_len=16, precision="bf16", implementation="reference",
              lora=calc.LoRA(rank=1, modules=ATTN))  # fmt: skip
    kw.update(changes)
    return calc.Training(**kw)  # type: ignore[arg-type]


def _round512(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


@pytest.mark.parametrize("n_layers", [2, 7])
def test_ddp_buckets_hold_the_adapters_gradients_only(n_layers: int) -> None:
    """Rank-1 adapters on q, k, v, o (all 520 -> 520): per module A [1, 520] and B [520, 1],
    8 tensors of 520 bf16 elements (1040 B) per layer. With the default caps (1 MiB first
    bucket) all of them fit one bucket in step 1 and after the rebuild: one allocation of
    8 * L * 1040 B rounded up to 512 (2 layers: 16640 -> 16896; 7 layers, which the replay
    extrapolates from five: 58240 -> 58368). The frozen base (about 2.4 MB of bf16 weights)
    adds nothing. Without bucket views the buckets are a constant beside everything else, so
    the peak is the single-GPU peak plus the buckets."""
    model = _llama(n_layers=n_layers)
    job = _job()
    expected = _round512(8 * n_layers * 1040)
    assert expected == {2: 16896, 7: 58368}[n_layers]
    single = calc.estimate(model, job, device="cpu")
    ddp = calc.estimate(model, job, calc.Parallelism(dp=2), device="cpu")
    assert ddp.breakdown["ddp/gradient_buckets"] == expected
    assert ddp.peak_bytes == single.peak_bytes + expected
    assert sorted(ddp.rank_peaks) == [0, 1]


def test_qlora_base_stays_out_of_the_buckets() -> None:
    """QLoRA (NF4 base) under DDP: the same adapters, so the same bucket as the 16-bit base
    (the packed base is buffers, never in a bucket); the base is replicated, so each rank holds
    the single-GPU QLoRA step plus that bucket."""
    model = _llama()
    job = _job(quant=calc.Quant(method="nf4"))
    single = calc.estimate(model, job, device="cpu")
    ddp = calc.estimate(model, job, calc.Parallelism(dp=4), device="cpu")
    assert ddp.breakdown["ddp/gradient_buckets"] == 16896
    assert ddp.peak_bytes == single.peak_bytes + 16896


def test_fp32_adapters_give_an_fp32_bucket() -> None:
    """``adapter_dtype='fp32'`` over a bf16 base: the adapters' gradients, hence the bucket,
    are fp32: 16 tensors x 520 x 4 B = 33280 B, rounded to 33280 (65 x 512)."""
    model = _llama()
    job = _job(lora=calc.LoRA(rank=1, modules=ATTN, adapter_dtype="fp32"))
    ddp = calc.estimate(model, job, calc.Parallelism(dp=2), device="cpu")
    assert ddp.breakdown["ddp/gradient_buckets"] == 33280


def test_bucket_views_hold_no_second_gradient_copy() -> None:
    """``gradient_as_bucket_view=True``: ``.grad`` of each adapter is a view of the bucket, so
    no gradient has storage of its own and the peak is never above the plain DDP peak; the
    buckets are the same bytes."""
    model = _llama()
    job = _job()
    plain = calc.estimate(model, job, calc.Parallelism(dp=2), device="cpu")
    view = calc.estimate(model, job, calc.Parallelism(dp=2, gradient_as_bucket_view=True),
                         device="cpu")  # fmt: skip
    assert view.breakdown["ddp/gradient_buckets"] == plain.breakdown["ddp/gradient_buckets"]
    assert view.breakdown.get("gradients", 0) == 0
    assert view.peak_bytes <= plain.peak_bytes


@pytest.mark.parametrize(
    ("parallel", "match"),
    [
        (calc.Parallelism(tp=2), "tp=2"),
        (calc.Parallelism(dp=2, pp=2), "pp=2"),
        (calc.Parallelism(dp=2, cp=2), "cp=2"),
        (calc.Parallelism(dp=2, zero=3, offload="optimizer"), "offload"),
    ],
)
def test_layouts_not_covered_are_refused_by_name(parallel: calc.Parallelism, match: str) -> None:
    with pytest.raises(NotImplementedError, match=match):
        calc.estimate(_llama(), _job(), parallel, device="cpu")


def test_zero_shards_the_adapters_as_one_flat_buffer() -> None:
    """ZeRO-1/2 with sharded states (DeepSpeed's stage 1 and 2: the trainable parameters
    flattened and cut in ``dp`` equal slices) over 2 ranks: each rank's Adam states are half of
    each adapter, 260 bf16 elements = 520 B -> 1024 per moment, 16 x 2 x 1024 = 32768 B (a
    dim-0 split of a rank-1 ``A [1, 520]`` would have kept a whole padded row, 1536 B, on each
    rank). ZeRO-1 still all-reduces through DDP's bucket (16896 B, derived above); ZeRO-2
    reduce-scatters each gradient when it is ready and has no bucket: at the peak, in the
    backward before any adapter gradient exists, it is ZeRO-1's peak less the bucket."""
    model, job = _llama(), _job()
    zero1 = calc.estimate(model, job, calc.Parallelism(dp=2, zero=1), device="cpu")
    zero2 = calc.estimate(model, job, calc.Parallelism(dp=2, zero=2), device="cpu")
    assert zero1.breakdown["optimizer"] == zero2.breakdown["optimizer"] == 16 * 2 * 1024
    assert zero1.breakdown["ddp/gradient_buckets"] == 16896
    assert "ddp/gradient_buckets" not in zero2.breakdown
    assert zero2.peak_phase == zero1.peak_phase == "step2/backward"
    assert zero2.peak_bytes == zero1.peak_bytes - 16896


def test_zero_redundancy_optimizer_partitions_the_adapters() -> None:
    """``ZeroRedundancyOptimizer`` over the trainable parameters (the 16 rank-1 adapters of
    520 elements, `_llama`): largest first, each to the least-loaded rank, so 8 per rank. Adam
    in bf16 keeps two moments of 520 x 2 = 1040 B, rounded to 1536 B: 8 x 2 x 1536 = 24576 B
    per rank, half of DDP's 49152 B. The gradients still all-reduce through one bucket of all
    16 adapters' gradients (16896 B, derived above)."""
    model = _llama()
    job = _job()
    zero1 = calc.Parallelism(dp=2, zero=1, zero_partition="by-parameter")
    ddp = calc.estimate(model, job, calc.Parallelism(dp=2), device="cpu")
    est = calc.estimate(model, job, zero1, device="cpu")
    assert est.peak_phase.startswith("step2/") and ddp.peak_phase.startswith("step2/")
    assert ddp.breakdown["optimizer"] == 16 * 2 * 1536
    assert est.breakdown["optimizer"] == 8 * 2 * 1536
    assert est.breakdown["ddp/gradient_buckets"] == 16896
    assert sorted(est.rank_peaks) == [0, 1]


def test_bitsandbytes_qlora_under_fsdp_is_refused() -> None:
    fsdp = calc.Parallelism(dp=2, fsdp=True)
    with pytest.raises(NotImplementedError, match="QLoRA with fsdp"):
        calc.estimate(_llama(), _job(quant=calc.Quant(method="nf4")), fsdp, device="cpu")


def test_fsdp_optimizer_states_are_the_adapter_shards_only() -> None:
    """LoRA r2 on all seven linears of a 512-wide model (ffn 1024), fp32, AdamW, FSDP2 over 2
    ranks. Adapters per layer: q, k, v, o: A [2, 512] + B [512, 2] = 2048 elements each;
    gate, up: A [2, 512] + B [1024, 2] = 3072; down: A [2, 1024] + B [512, 2] = 3072: 17408
    per layer, 34816 for two layers. Every dim-0 shard over 2 ranks is a multiple of 512 bytes
    (A: one row of 512 or 1024 fp32; B: 256 or 512 rows of 2), so no rounding: the two Adam
    moments of the shards are 2 x 4 B x 34816 / 2 = 139264 B. The frozen base has no state."""
    model = _llama(hidden=512, head_dim=64)
    job = _job(precision="fp32", lora=calc.LoRA(rank=2), micro_batch=2, seq_len=64)
    est = calc.estimate(model, job, calc.Parallelism(dp=2, fsdp=True), device="cpu")
    assert est.peak_phase.startswith("step2/"), est.peak_phase
    assert est.breakdown["optimizer"] == 139264
    zero3 = calc.estimate(model, job, calc.Parallelism(dp=2, zero=3), device="cpu")
    assert zero3.peak_bytes == est.peak_bytes  # zero=3 is replayed as FSDP2 too


def test_pruning_under_data_parallelism_is_still_refused() -> None:
    job = calc.Training(micro_batch=1, seq_len=16, precision="bf16", implementation="reference",
                        pruning=calc.Pruning(amount=0.5))  # fmt: skip
    with pytest.raises(NotImplementedError, match="pruning"):
        calc.estimate(_llama(), job, calc.Parallelism(dp=2), device="cpu")
