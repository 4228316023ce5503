"""Quantization, KV-cache quantization and LoRA terms against hand derivations.

Every expected number is derived in the comments from the storage layout (values, scales,
each tensor rounded to the allocator's 512-byte blocks) or taken from a cited paper.
"""

from fractions import Fraction

import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import calc
from calc.compress import kv_quant, quant
from verify.cases.scale import scaled_spec


def _r512(n: int) -> int:
    """The allocator's block rounding, written out for the hand derivations below."""
    return max(512, -(-n // 512) * 512)


# ------------------------------------------------------------------ bytes per parameter


def test_nf4_double_quant_is_the_qlora_papers_4_127_bits():
    # QLoRA (Dettmers et al. 2023, §3 Double Quantization): constants cost 32/64 = 0.5 bits per
    # parameter without it and 8/64 + 32/(64*256) = 0.127 bits with it; values are 4 bits.
    with_dq = quant.bytes_per_param(calc.Quant(method="nf4")) * 8
    without = quant.bytes_per_param(calc.Quant(method="nf4", double_quant=False)) * 8
    assert with_dq == sp.Rational(4) + sp.Rational(8, 64) + sp.Rational(32, 64 * 256)
    assert round(float(with_dq - 4), 3) == 0.127
    assert without == sp.Rational(9, 2)  # 4.5 bits: fp32 absmax per 64


@pytest.mark.parametrize(
    ("q", "in_features", "expected"),
    [
        # int4, groups of 128, fp16 scale + fp16 zero: 1/2 + (2 + 2)/128 = 17/32
        (calc.Quant(method="int4"), None, Fraction(17, 32)),
        # int4 symmetric, groups of 32, fp16 scale: 1/2 + 2/32 = 9/16
        (calc.Quant(method="int4", group_size=32, zero_point=False), None, Fraction(9, 16)),
        # int8 per row of 4096, one fp32 scale: 1 + 4/4096 = 1025/1024
        (calc.Quant(method="int8"), 4096, Fraction(1025, 1024)),
        # fp8 per tensor: 1 byte (the one scale is per tensor, not per parameter)
        (calc.Quant(method="fp8"), None, Fraction(1)),
        # fp8 per row of 5120, fp32 scale: 1 + 4/5120
        (calc.Quant(method="fp8", fp8_scaling="row"), 5120, Fraction(5124, 5120)),
    ],
)
def test_bytes_per_param_are_exact_rationals(q, in_features, expected):
    got = quant.bytes_per_param(q, in_features)
    assert isinstance(got, sp.Rational)
    assert Fraction(int(got.p), int(got.q)) == expected


def test_per_row_scales_need_the_row_width():
    with pytest.raises(ValueError, match="in_features"):
        quant.bytes_per_param(calc.Quant(method="int8"))


# ------------------------------------------------------------------ stored tensors


def test_nf4_stores_what_bitsandbytes_stores():
    # [8, 64] weight = 512 values: packed 256 B; 512/64 = 8 blocks -> 8 uint8 absmax codes,
    # ceil(8/256) = 1 fp32 nested absmax, one fp32 offset, a 16-entry fp32 code table.
    got = {
        s.name: s.numel * s.itemsize for s in quant.stored_tensors(calc.Quant(method="nf4"), 8, 64)
    }
    assert got == {
        "nf4.packed": 256, "nf4.code": 64, "nf4.qabsmax": 8, "nf4.absmax2": 4, "nf4.offset": 4,
    }  # fmt: skip


def test_group_size_must_divide_the_rows():
    with pytest.raises(ValueError, match="group_size"):
        quant.check_divides(calc.Quant(method="int4"), 64, 176, "down")


# ------------------------------------------------------------------ estimates at tiny dims

LLAMA = scaled_spec("llama-2-7b")  # h 64, 4 heads of 16 (MHA), ffn 176, vocab 512, 2 layers


def test_scaled_dims_used_below():
    assert (LLAMA.hidden, LLAMA.n_heads, LLAMA.n_kv_heads, LLAMA.head_dim, LLAMA.ffn) == (
        64, 4, 4, 16, 176,
    )  # fmt: skip
    assert LLAMA.n_layers == 2


def _infer(**kw):
    return calc.Inference(batch=2, context=64, precision="bf16", implementation="reference", **kw)


def test_int8_per_row_weights_and_scales():
    # Per layer: q, k, v, o are [64, 64] -> 4096 int8 values each; gate, up [176, 64] and
    # down [64, 176] -> 11264 each. Scales fp32 per row: q,k,v,o,down 64*4 = 256 -> 512;
    # gate, up 176*4 = 704 -> 1024. Two layers.
    est = calc.estimate(LLAMA, _infer(quant=calc.Quant(method="int8")), device="cpu")
    values = 2 * (4 * 4096 + 3 * 11264)
    scales = 2 * (5 * 512 + 2 * 1024)
    norms = 2 * 2 * 512  # two bf16 [64] norm weights per layer
    assert est.breakdown["weights/quant_scales"] == scales
    assert est.breakdown["weights/layers"] == values + norms


@pytest.mark.parametrize(
    ("kind", "per_layer"),
    [
        # b 2, k 4, c 64, d 16: 8192 values of 1 byte per K (and per V);
        # int8: + a bf16 scale per token and head, 2*4*64*2 = 1024 B; fp8: + one fp32 -> 512
        ("int8", 2 * (8192 + 1024)),
        ("fp8", 2 * (8192 + 512)),
        (None, 2 * 8192 * 2),  # bf16 K and V
    ],
)
def test_kv_cache_bytes(kind, per_layer):
    est = calc.estimate(LLAMA, _infer(kv_quant=kind), device="cpu")
    assert est.breakdown["kv_cache"] == 2 * per_layer


def test_kv_bytes_per_token():
    # Qwen2.5-32B: 8 KV heads of 128. bf16: 2*8*128*2 = 4096 B per token per layer;
    # int8: 2*8*(128 + 2) = 2080; fp8: 2*8*128 = 2048.
    assert kv_quant.bytes_per_token(None, 8, 128, 2) == 4096
    assert kv_quant.bytes_per_token("int8", 8, 128, 2) == 2080
    assert kv_quant.bytes_per_token("fp8", 8, 128, 2) == 2048


def test_lora_adapters_grads_and_states():
    # Rank 8 on all seven linears, fp32: A [8, in] and B [out, 8], each its own allocation.
    # q, k, v, o: A 8*64*4 = 2048, B 64*8*4 = 2048 -> 4 * 4096 = 16384;
    # gate, up: A 2048, B 176*8*4 = 5632; down: A 8*176*4 = 5632, B 2048 -> 3 * 7680 = 23040.
    # Two layers: 2 * 39424 = 78848 bytes of adapters; AdamW keeps two states of the same.
    job = calc.Training(micro_batch=2, seq_len=32, precision="fp32", implementation="reference",
                        lora=calc.LoRA(rank=8))  # fmt: skip
    est = calc.estimate(LLAMA, job, device="cpu")
    assert est.breakdown["weights/lora_adapters"] == 78848
    assert est.breakdown["optimizer/exp_avg"] == 78848
    assert est.breakdown["optimizer/exp_avg_sq"] == 78848
    assert not any(k.startswith("gradients/embedding") for k in est.breakdown)


def test_frozen_base_saves_less_than_full_fine_tuning():
    # A frozen linear keeps no input and a frozen norm weight makes x*rstd unsaved
    # (derivatives.yaml guarded saves): at the end of the first forward (weights, inputs and
    # saved activations; no grads, no states yet) LoRA holds less even with its adapters.
    kw = {"micro_batch": 2, "seq_len": 128, "precision": "fp32", "implementation": "reference"}
    full = calc.estimate(LLAMA, calc.Training(**kw), device="cpu")
    lora = calc.estimate(LLAMA, calc.Training(**kw, lora=calc.LoRA(rank=8)), device="cpu")
    assert lora.phases["step1/forward"] < full.phases["step1/forward"]


def test_qwen25_32b_nf4_weights_by_hand():
    # Qwen2.5-32B: h 5120, 40 heads x 128, 8 KV heads, ffn 27648, 64 layers, vocab 152064,
    # untied; q/k/v biases. NF4 (blocks of 64, double quant) on q, k, v, o, gate, up, down:
    # packed n/2 bytes, n/64 uint8 absmax codes, ceil(n/64/256) fp32 nested absmax, one fp32
    # offset and a 64-byte code table, each rounded to 512. Embedding and head stay bf16.
    model = calc.load_card("qwen2.5-32b")
    h, f, kvd = 5120, 27648, 8 * 128
    shapes = [(h, h), (kvd, h), (kvd, h), (h, h), (f, h), (f, h), (h, f)]
    values = scales = 0
    for out_f, in_f in shapes:
        n = out_f * in_f
        values += _r512(n // 2)
        nb = n // 64
        scales += _r512(nb) + _r512(-(-nb // 256) * 4) + 512 + 512
    per_layer_16bit = _r512(h * 2) + 2 * _r512(kvd * 2) + 2 * _r512(h * 2)  # biases, norms
    job = calc.Inference(batch=1, context=4096, implementation="reference",
                         quant=calc.Quant(method="nf4"))  # fmt: skip
    est = calc.estimate(model, job)
    assert est.breakdown["weights/layers"] == 64 * (values + per_layer_16bit)
    assert est.breakdown["weights/quant_scales"] == 64 * scales
    assert est.breakdown["weights/embedding"] == _r512(152064 * h * 2)
    # ~4.13 bits for every quantized weight: 31.2e9 of them in about 15 GiB.
    assert 14.9 < 64 * (values + scales) / 2**30 < 15.2


def test_estimate_refuses_a_group_that_does_not_divide():
    # llama-2 scaled: ffn 176 is not a multiple of 128 (int4's default group): down_proj's rows
    job = calc.Inference(batch=1, context=8, implementation="reference",
                         quant=calc.Quant(method="int4"))  # fmt: skip
    with pytest.raises(ValueError, match="group_size=128"):
        calc.estimate(LLAMA, job)


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from(["int8", "int4"]),
    exp=st.integers(min_value=1, max_value=10),
    zero=st.booleans(),
)
def test_larger_groups_never_cost_more(method, exp, zero):
    # One scale (and zero) per group: doubling the group halves the overhead, never adds.
    small = calc.Quant(method=method, group_size=2**exp, zero_point=zero)
    large = calc.Quant(method=method, group_size=2 ** (exp + 1), zero_point=zero)
    assert quant.scale_bytes_per_param(large) * 2 == quant.scale_bytes_per_param(small)
    assert quant.bytes_per_param(large) < quant.bytes_per_param(small)


@settings(max_examples=10, deadline=None)
@given(context=st.integers(min_value=19, max_value=4096))
def test_quantized_kv_never_exceeds_bf16_kv(context):
    # Batch 1, 4 KV heads of 16: per K (or V) bf16 holds 128c bytes, int8 64c + a separate
    # 8c-byte scale tensor, fp8 64c + 4. Each allocation rounds up by < 512 B, so int8 holds at
    # most 72c + 1022 <= 128c once c >= 19 (and fp8 less). Below that the rounding wins:
    # test_tiny_kv_cache_quantized_costs_more.
    b16 = calc.estimate(LLAMA, _infer_ctx(context, None), device="cpu").breakdown["kv_cache"]
    for kind in ("int8", "fp8"):
        q = calc.estimate(LLAMA, _infer_ctx(context, kind), device="cpu").breakdown["kv_cache"]
        assert q <= b16


def _infer_ctx(context, kind):
    return calc.Inference(batch=1, context=context, precision="bf16",
                          implementation="reference", kv_quant=kind)  # fmt: skip


def test_tiny_kv_cache_quantized_costs_more():
    # Context 2: bf16 K = 1*4*2*16*2 = 256 B -> one 512-B block; int8 K = 128 B -> 512 plus its
    # scale tensor 1*4*2*2 = 16 B -> 512: 1024 B per K (and per V), twice bf16's, two layers.
    b16 = calc.estimate(LLAMA, _infer_ctx(2, None), device="cpu").breakdown["kv_cache"]
    i8 = calc.estimate(LLAMA, _infer_ctx(2, "int8"), device="cpu").breakdown["kv_cache"]
    assert (b16, i8) == (2 * 2 * 512, 2 * 2 * 1024)


def test_8bit_adam_decides_per_adapter_size_for_each_model():
    # bitsandbytes keeps fp32 states for tensors under 4096 elements (min_8bit_size). Rank 8 on
    # q only: A [8, h], B [h, 8]. h = 64: 512 elements each -> fp32 state1/state2, 2 x 512 x 4 B
    # = 4096 B per tensor. h = 1024: 8192 elements -> uint8 states 8192 B each + fp32 absmax per
    # 256-element block (32 x 4 = 128 B -> 512). The same structure, two models: no stale compile.
    lora = calc.LoRA(rank=8, modules=("q",))
    kw = {"micro_batch": 1, "seq_len": 8, "precision": "bf16", "optimizer": "adam8bit",
          "implementation": "reference", "lora": lora}  # fmt: skip
    small = scaled_spec("llama-2-7b", layers=1)
    large = scaled_spec("llama-2-7b", layers=1, hidden=1024)
    for spec, per_tensor in ((small, 2 * 512 * 4), (large, 2 * 8192 + 2 * 512)):
        est = calc.estimate(spec, calc.Training(**kw), device="cpu")
        states = sum(v for k, v in est.breakdown.items() if k.count("/") == 1 and
                     k.startswith("optimizer/"))  # fmt: skip
        assert states == 2 * per_tensor, spec.hidden
