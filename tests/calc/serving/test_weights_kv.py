"""vLLM's per-rank weights and KV pages (`calc.serving.weights`, `calc.serving.kv_cache`) on tiny
models, every byte derived by hand below, plus the published "model weights take" figures."""

from __future__ import annotations

import pytest

import calc
from calc.serving import kv_cache as kv
from calc.serving import weights as W
from tests.specs import tiny_llama, tiny_llama64

GIB = 2**30


def test_tiny_llama_weights_by_hand() -> None:
    # tiny llama: h 16, 2 layers, 2 heads of 8 (k 2), ffn 24, vocab 50 -> padded to 64, untied,
    # max_positions 64, bf16 (2 bytes).
    # layer: qkv (2+2*2)*8=48 x 16 = 768; o 16 x 16 = 256; gate_up 48 x 16 = 768;
    #        down 16 x 24 = 384; norms 2*16 = 32 -> 2208 elements
    # embedding 64 x 16 = 1024, head 1024, final norm 16, rope cache 64 x 8 = 512
    # total = 2*2208 + 1024 + 1024 + 16 + 512 = 6992 elements = 13984 bytes
    assert W.stage_weight_bytes(tiny_llama(), calc.Serving(), 0) == 13984


def test_tensor_parallel_splits_heads_and_replicates_kv_heads() -> None:
    # tiny_llama64: h 64, 4 heads of 16, ffn 128, vocab 64. With k=2 KV heads and tp 4, each
    # rank holds one KV head (QKVParallelLinear replicates them): qkv out (1 + 2*1)*16 = 48.
    model = tiny_llama64(n_kv_heads=2)
    assert W.kv_heads_per_rank(model, 4) == 1
    assert W.kv_heads_per_rank(model, 2) == 1
    assert W.kv_heads_per_rank(model, 1) == 2
    lins = W.layer_linears(model, 4)
    assert [(lin.out_features, lin.in_features) for lin in lins] == [
        (48, 64),  # qkv: (4/4 + 2*1) heads x 16
        (64, 16),  # o_proj: input split, 1 head x 16
        (64, 64),  # gate_up: 2 x 128/4
        (64, 32),  # down: input 128/4
    ]
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        W.layer_linears(model, 3)


def test_quantized_linears_by_hand() -> None:
    # one linear 256 x 128 (out x in), one logical shard, no bias
    lin = W.Linear(256, 128, 1, 0)
    assert W.linear_bytes(lin, calc.Serving()) == 256 * 128 * 2
    assert W.linear_bytes(lin, calc.Serving(quant="fp8")) == 256 * 128 + 4  # one fp32 scale
    assert W.linear_bytes(lin, calc.Serving(quant="w8a8")) == 256 * 128 + 4 * 256  # per channel
    # int4: half a byte per weight, one fp16 scale per 128 inputs per output row
    assert W.linear_bytes(lin, calc.Serving(quant="w4a16")) == 256 * 128 // 2 + 2 * 1 * 256


def test_pipeline_stages_put_the_remainder_before_the_last() -> None:
    # get_pp_indices: 10 layers over 4 stages: 2 each, the remainder 2 to the two stages just
    # before the last: [2, 3, 3, 2]
    assert W.stage_layers(10, 4) == (2, 3, 3, 2)
    assert W.stage_layers(8, 2) == (4, 4)
    with pytest.raises(ValueError, match="pipeline_parallel=9"):
        W.stage_layers(8, 9)


@pytest.mark.parametrize(
    ("tp", "logged_gib"),
    [(1, 14.96), (2, 7.48)],  # vllm PR #10511: "model weights take 14.96GiB" / "7.48GiB" (-tp 2)
)
def test_llama3_8b_weights_match_the_published_profile(tp: int, logged_gib: float) -> None:
    model = calc.load_card("llama-3.1-8b").with_overrides(max_positions=8192)  # Llama-3-8B
    got = W.stage_weight_bytes(model, calc.Serving(tensor_parallel=tp), 0) / GIB
    assert got == pytest.approx(logged_gib, abs=0.005)


def test_llama31_8b_weights_match_the_published_log() -> None:
    # vllm issue #10517: "Loading model weights took 14.9888 GB" (the cos/sin cache of 131072
    # positions is loaded with the weights)
    got = W.stage_weight_bytes(calc.load_card("llama-3.1-8b"), calc.Serving(), 0) / GIB
    assert got == pytest.approx(14.9888, abs=0.0005)


def test_page_blocks_and_concurrency_by_hand() -> None:
    model = tiny_llama()  # 2 KV heads of 8
    # page = 2 (K and V) x 16 tokens x 2 heads x 8 x 2 bytes = 1024 bytes per layer
    assert kv.page_bytes(model, calc.Serving()) == 1024
    assert kv.page_bytes(model, calc.Serving(kv_cache_dtype="fp8")) == 512
    assert kv.page_bytes(model, calc.Serving(block_size=32)) == 2048
    # 100 000 bytes over 2 layers of 1024-byte pages: 100000 // 1024 // 2 = 48 blocks
    assert kv.num_blocks(100_000, 1024, 2) == 48
    assert kv.num_blocks(-5, 1024, 2) == 0
    # V1: a 100-token request needs cdiv(100, 16) = 7 blocks: 48 / 7
    serving = calc.Serving()
    assert kv.max_concurrency(48, model, serving, "v1", 100, 2048) == pytest.approx(48 / 7)
    # V0: tokens / max_model_len = 48 * 16 / 100
    assert kv.max_concurrency(48, model, serving, "v0", 100, 2048) == pytest.approx(7.68)


def test_sliding_window_request_needs_only_its_window() -> None:
    # SlidingWindowSpec: cdiv(min(window - 1 + batched, max_len), block) + 1 blocks
    model = tiny_llama(sliding_window=32)
    # min(31 + 16, 1000) = 47 -> cdiv(47, 16) = 3, + 1 = 4 blocks
    assert kv.blocks_per_request(model, calc.Serving(), 1000, 16) == 4
