"""The checkpoint's quantization_config as vLLM loads it (`calc.serving.checkpoint`): vLLM takes
the config's ``quant_method`` when ``--quantization`` is unset (``ModelConfig._verify_
quantization``). Expected sizes are hand arithmetic from the shapes, or published figures."""

from __future__ import annotations

import pytest

import calc
from calc.serving import weights as W
from calc.serving.checkpoint import Declared, WeightFormat, declared, weight_format
from tests.calc.serving.published import records

GIB = 2**30


def cfg(**quant: object) -> dict:
    return {"quantization_config": quant}


def test_deepseek_v3_declares_block_fp8() -> None:
    got = declared(calc.load_card_config("deepseek-v3"))
    assert got == Declared(
        method="fp8", format=WeightFormat(kind="fp8", scales="block", block=(128, 128))
    )


@pytest.mark.parametrize(
    ("quant", "want"),
    [
        ({"quant_method": "fp8"}, WeightFormat(kind="fp8", scales="tensor")),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128},
         WeightFormat(kind="w4a16", scales="group", group=128)),
        ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64},
         WeightFormat(kind="w4a16", scales="group", group=64)),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1},
         WeightFormat(kind="w4a16", scales="channel")),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}},
         WeightFormat(kind="fp8", scales="channel")),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}},
         WeightFormat(kind="w8a8", scales="channel")),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
            "input_activations": None}}},
         WeightFormat(kind="w4a16", scales="group", group=32)),
    ],
)  # fmt: skip
def test_declared_formats(quant: dict, want: WeightFormat) -> None:
    got = declared(cfg(**quant))
    assert got is not None and got.format == want


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"},
            "input_activations": {"num_bits": 4, "type": "float"}}}}, "num_bits=4 type='float'"),
    ],
)  # fmt: skip
def test_unmodelled_schemes_keep_dtype_and_say_so(quant: dict, named: str) -> None:
    got = declared(cfg(**quant))
    assert got is not None and got.format is None and named in got.reason
    fmt, notes = weight_format(got, calc.Serving())
    assert fmt is None and "not modelled" in notes[0] and named in notes[0]


def test_malformed_block_size_names_the_field() -> None:
    with pytest.raises(ValueError, match="weight_block_size"):
        declared(cfg(quant_method="fp8", weight_block_size=[128]))


def test_an_explicit_quant_overrides_the_checkpoint_and_says_so() -> None:
    ckpt = declared(calc.load_card_config("deepseek-v3"))
    fmt, notes = weight_format(ckpt, calc.Serving(quant="w4a16"))
    assert fmt == WeightFormat(kind="w4a16", scales="group", group=128)
    assert "overriding" in notes[0] and "quant_method=fp8" in notes[0]
    fmt, notes = weight_format(ckpt, calc.Serving())
    assert fmt is not None and fmt.scales == "block" and "without --quantization" in notes[0]


def test_block_scales_by_hand() -> None:
    # [300, 200] in fp8 with [128, 128] blocks: 60 000 bytes + fp32 scales of a
    # cdiv(300, 128) x cdiv(200, 128) = 3 x 2 grid
    lin = W.Linear(300, 200, 1, 0)
    fmt = WeightFormat(kind="fp8", scales="block")
    assert W.linear_bytes(lin, calc.Serving(), fmt) == 300 * 200 + 4 * 3 * 2
    # int4 with groups of 64: half a byte each, fp16 scales of cdiv(200, 64) = 4 groups per row
    fmt = WeightFormat(kind="w4a16", scales="group", group=64)
    assert W.linear_bytes(lin, calc.Serving(), fmt) == 300 * 200 // 2 + 2 * 4 * 300


def fp8(out: int, inp: int) -> int:
    """One fp8 linear with [128, 128] fp32 block scales."""
    return out * inp + 4 * -(-out // 128) * -(-inp // 128)


def test_deepseek_v3_fp8_weights_per_rank_by_hand() -> None:
    # DeepSeek-V3's config.json at tp 8: hidden 7168, 61 layers (3 dense, 58 MoE), 128 heads
    # (16 per rank), q_lora 1536, kv_lora 512, nope 128, rope 64, v 128; dense MLP 18432,
    # 256 routed experts of 2048 + one shared; vocab 129280 (a multiple of 64), 163840
    # positions. fp8 linears (block scales), bf16 norms/embedding/head/router, fp32 bias.
    attention = (
        fp8(1536, 7168)  # q_a_proj, replicated
        + fp8(16 * (128 + 64), 1536)  # q_b_proj
        + fp8(512 + 64, 7168)  # kv_a_proj_with_mqa, replicated
        + fp8(16 * (128 + 128), 512)  # kv_b_proj
        + fp8(7168, 16 * 128)  # o_proj
    )
    norms = 2 * (2 * 7168 + 512 + 1536)  # input/post-attention, kv_a and q_a layernorms
    dense = fp8(2 * 18432 // 8, 7168) + fp8(7168, 18432 // 8)
    expert = fp8(2 * 2048 // 8, 7168) + fp8(7168, 2048 // 8)
    moe = 256 * expert + expert + 2 * 256 * 7168 + 4 * 256  # routed, shared, router, bias
    table = 2 * 129280 // 8 * 7168
    want = (
        61 * (attention + norms) + 3 * dense + 58 * moe
        + 2 * table + 2 * 7168 + 2 * 163840 * 64  # embedding, head, final norm, rope table
    )  # fmt: skip
    serving = calc.Serving(max_model_len=8192, tensor_parallel=8)
    est = calc.serve(calc.load_card("deepseek-v3"), serving, gpu="h200-141gb")
    assert est.weights_bytes == want  # 85.16 GB: half of the bf16 169.6 GB
    assert est.kv_cache_bytes > 0 and est.fits


def test_qwen3_8b_fp8_checkpoint_matches_its_published_log() -> None:
    # the published vLLM 0.10.2 log of Qwen3-8B-FP8 (tests/data/vllm_startup_logs.json) prints
    # "8.8 GiB for weight"; Qwen's model card (https://huggingface.co/Qwen/Qwen3-8B-FP8) states
    # "fine-grained fp8 quantization with block size of 128", i.e. this quantization_config
    rec = next(r for r in records() if r["id"] == "qwen3-8b-fp8-24gb-v0.10.2")
    config = {
        **rec["config"],
        "quantization_config": {
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        },
    }  # fmt: skip
    fields = {k: v for k, v in rec["serving"].items() if k != "quant"}  # no --quantization
    serving = calc.Serving(vllm_version=rec["vllm_version"], **fields)
    est = calc.serve(config, serving, total_bytes=round(rec["total_gib"] * GIB))
    assert est.weights_bytes / GIB == pytest.approx(rec["logged"]["weights_gib"], abs=0.012)
    assert any("quant_method=fp8" in n for n in est.notes)
