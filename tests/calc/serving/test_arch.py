"""calc.serving.arch and the families it opens to calc.serve: weights per rank, MLA pages, the
hybrid KV cache groups, the analytic forward. Expected values are derived by hand in each test
(shapes from vLLM's model classes, cited in calc/serving/weights.py and kv_cache.py) or are the
cards' published parameter counts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import calc
from calc.serving import inverse
from calc.serving import kv_cache as kv
from calc.serving import profile as prof
from calc.serving import weights as W
from calc.serving.arch import LayerKV, ServingArch

TINY_MIXTRAL = {
    "model_type": "mixtral", "hidden_size": 8, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "num_local_experts": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "vocab_size": 64,
    "max_position_embeddings": 32, "tie_word_embeddings": False,
}  # fmt: skip
TINY_DEEPSEEK = {
    "model_type": "deepseek_v2", "hidden_size": 16, "num_attention_heads": 2,
    "q_lora_rank": None, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2,
    "v_head_dim": 4, "moe_intermediate_size": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "intermediate_size": 8, "num_hidden_layers": 2, "vocab_size": 64,
    "max_position_embeddings": 16, "hidden_act": "silu",
}  # fmt: skip


def tiny_gemma3(n_layers: int = 8, pattern: int = 4) -> dict:
    return {
        "model_type": "gemma3_text", "hidden_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16,
        "num_hidden_layers": n_layers, "vocab_size": 64, "max_position_embeddings": 2048,
        "sliding_window": 128, "sliding_window_pattern": pattern,
    }  # fmt: skip


def test_tiny_mixtral_weights_by_hand() -> None:
    # Per layer: qkv (2 + 2*1)*4 x 8 = 128; o 8 x 8 = 64; experts 4 x (2*16*8 + 8*16) = 1536;
    # router 4 x 8 = 32; two norms 16 -> 1776; two layers 3552; embed 64x8 = 512, head 512,
    # final norm 8, rope 32 x 4 = 128 -> 4712 elements, 9424 bf16 bytes.
    arch = ServingArch.from_hf_config(TINY_MIXTRAL)
    assert W.stage_weight_bytes(arch, calc.Serving(), 0) == 9424
    # tp=2: heads 1, KV head replicated: qkv 3*4 x 8 = 96; o 8 x 4 = 32; experts with I/2 = 8:
    # 4 x (16*8 + 8*8) = 768; router 32; norms 16 -> 944 x 2 = 1888; embed and head 32 x 8 =
    # 256 each; norm 8; rope 128 -> 2536 elements, 5072 bytes.
    assert W.stage_weight_bytes(arch, calc.Serving(tensor_parallel=2), 0) == 5072


def test_tiny_deepseek_mla_weights_and_page_by_hand() -> None:
    arch = ServingArch.from_hf_config(TINY_DEEPSEEK)
    assert arch.moe_layers == (False, True)  # first_k_dense_replace = 1
    # Attention: q_proj 2*(4+2) x 16 = 192; kv_a_proj_with_mqa (8+2) x 16 = 160; kv_b_proj
    # 2*(4+4) x 8 = 128; o_proj 16 x 2*4 = 128 -> 608; norms 2*16 + kv_a_layernorm 8 = 40.
    # Layer 0 dense MLP: gate_up 16 x 16 + down 16 x 8 = 384 -> 1032.
    # Layer 1: experts 4 x (2*4*16 + 16*4) = 768, router 4 x 16 = 64, shared MLP of 4*1:
    # 8 x 16 + 16 x 4 = 192 -> 608 + 40 + 1024 = 1672.
    # embed 1024 + head 1024 + final norm 16 + rope 16 x 2 = 32 -> 4800 elements, 9600 bytes.
    assert W.stage_weight_bytes(arch, calc.Serving(), 0) == 9600
    # MLAAttentionSpec: block 16 x (kv_lora 8 + rope 2) x 2 bytes = 320, no factor 2, not
    # divided by tensor parallelism.
    for tp in (1, 2):
        assert kv.layer_page_bytes(arch, arch.layers[0], calc.Serving(tensor_parallel=tp)) == 320


def test_tiny_mixtral_analytic_forward_by_hand() -> None:
    # T = 8: attention (qkv 2+2*1 heads, output 2 heads) x 4 = 8 * 24 = 192 elements;
    # FusedMoE: M = 8, top_k 2: cache13 8*2*max(2*16, 8) = 512, cache2 8*2*16 = 256, output,
    # router logits and top-k weights/ids 8*(8 + 4 + 4*2) = 160 -> 928; plus 2 [T, h] = 128:
    # 1056 elements, 2112 bf16 bytes.
    arch = ServingArch.from_hf_config(TINY_MIXTRAL)
    assert prof.analytic_forward_bytes(arch, calc.Serving(), 8) == 2112


def test_hybrid_groups_gemma3_pattern() -> None:
    # 8 layers, pattern 4: layers 3 and 7 global (2 full), 6 sliding. Group size = 2 (the
    # smallest count; 6 >= 1.5 * 2); sliding split into cdiv(6, 2) = 3 groups -> 4 groups.
    arch = ServingArch.from_hf_config(tiny_gemma3())
    full = [i for i, layer in enumerate(arch.layers) if layer.kind == "full"]
    assert full == [3, 7]
    layout = kv.kv_layout(arch, calc.Serving(), "v1", range(8), 1024, 256)
    assert (layout.group_size, layout.n_groups) == (2, 4)
    # Per request: full cdiv(1024, 16) = 64; each sliding group cdiv(min(127 + 256, 1024), 16)
    # + 1 = 25, three of them -> 64 + 75 = 139 blocks.
    assert layout.blocks_per_request == 139
    # Before the hybrid manager (0.9.2) and on V0: every layer full, one group of 8.
    old = kv.kv_layout(arch, calc.Serving(vllm_version="0.9.2"), "v1", range(8), 1024, 256)
    assert (old.group_size, old.n_groups, old.blocks_per_request) == (8, 1, 64)


def test_hybrid_group_size_heuristic() -> None:
    # 3 full + 4 sliding: 4 < 1.5 * 3, so the group size is 4 (001cabc1): one group each.
    arch = _tiny_hybrid("FFFSSSS")
    groups = kv.kv_groups(arch, hybrid=True)
    assert [len(members) for _, members in groups] == [3, 4]


def test_serve_hybrid_tokens_follow_groups() -> None:
    # gemma-3-1b-it: 26 layers, every 6th global -> 4 full, 22 sliding: group size 4, 1 + 6 = 7
    # groups. Page: 2 x 16 x 1 KV head x 256 x 2 bytes = 16384; a block id holds 4 pages.
    cfg = calc.load_card_config("gemma-3-1b-it")
    est = calc.serve(cfg, calc.Serving(max_model_len=8192), total_bytes=24 * 2**30)
    assert est.page_bytes == 16384
    assert est.kv_cache_groups == 7
    assert est.gpu_blocks == est.kv_cache_bytes // (16384 * 4)
    assert est.kv_cache_tokens == est.gpu_blocks // 7 * 16
    # Gemma-2: even layers sliding, 21 + 21: two groups of 21.
    est2 = calc.serve(calc.load_card_config("gemma-2-9b"), calc.Serving(), total_bytes=80 * 2**30)
    assert est2.kv_cache_groups == 2
    assert est2.kv_cache_tokens == est2.gpu_blocks // 2 * 16


EXACT_CARDS = (
    "mixtral-8x7b", "qwen3-30b-a3b", "gemma-2-9b", "gemma-3-1b-it", "phi-4",
    "olmo-2-7b-instruct", "granite-3.3-8b-instruct", "deepseek-v3",
)  # fmt: skip


@pytest.mark.parametrize("card", EXACT_CARDS)
def test_weights_match_published_params(card: str) -> None:
    """vLLM loads exactly the checkpoint's parameters for these: bf16 bytes / 2, less the rotary
    tables and the vocabulary padding (to 64), is the published count (DeepSeek-V3's 671B is
    rounded to 1B; its fp32 router biases count double here, 58 x 256 elements). The count is
    of parameters, so a checkpoint's quantization_config (DeepSeek-V3's fp8) is set aside."""
    arch = replace(
        ServingArch.from_hf_config(calc.load_card_config(card), name=card), checkpoint=None
    )
    weights = W.stage_weight_bytes(arch, calc.Serving(), 0)
    rope = arch.rope_tables * arch.max_positions * arch.rotary_dim * 2
    padding = (W.padded_vocab(arch) - arch.vocab) * arch.hidden
    params = (weights - rope) // 2 - padding * (1 if arch.tied_embeddings else 2)
    tolerance = calc.data.cards.published_params_precision(card) // 2
    assert abs(params - calc.published_params(card)) <= tolerance


def test_config_of_a_modelspec_type_is_unchanged() -> None:
    serving = calc.Serving(max_model_len=8192)
    spec = calc.serve(calc.load_card("llama-3.1-8b"), serving, gpu="h100-80gb")
    cfg = calc.serve(calc.load_card_config("llama-3.1-8b"), serving, gpu="h100-80gb")
    assert spec.kv_cache_tokens == cfg.kv_cache_tokens
    assert spec.weights_bytes == cfg.weights_bytes


def test_config_errors_name_the_key() -> None:
    bad = dict(TINY_MIXTRAL)
    del bad["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ServingArch.from_hf_config(bad)
    with pytest.raises(ValueError, match="num_local_experts"):
        ServingArch.from_hf_config({**TINY_MIXTRAL, "num_local_experts": "8"})
    with pytest.raises(ValueError, match="model_type"):
        ServingArch.from_hf_config({**TINY_MIXTRAL, "model_type": "mamba"})
    with pytest.raises(ValueError, match=r"config\.json dict"):
        calc.serve(["not", "a", "config"], calc.Serving(), total_bytes=2**34)  # type: ignore[arg-type]


def _weights_only_records() -> list[dict]:
    data = json.loads(
        (Path(__file__).resolve().parents[2] / "data" / "vllm_startup_logs.json").read_text()
    )
    return list(data["weights_only"])


@pytest.mark.parametrize("rec", _weights_only_records(), ids=lambda r: r["id"])
def test_weights_match_published_logs(rec: dict) -> None:
    # "Model loading took X GiB" printed to 0.0001 GiB; calc's per-rank weights of the card's
    # config within 0.01 GiB (vllm #17469, Qwen3-30B-A3B on 4 x A10: 14.2474 GiB logged).
    serving = calc.Serving(vllm_version=rec["vllm_version"], **rec["serving"])
    arch = ServingArch.from_hf_config(calc.load_card_config(rec["card"]))
    got = W.stage_weight_bytes(arch, serving, 0) / 2**30
    assert got == pytest.approx(rec["logged"]["weights_gib"], abs=0.01)


def test_expert_parallel_weights_by_hand() -> None:
    # 3 experts, tp = 2. Shared per layer: qkv 96, o 32, router 3 x 8 = 24, norms 16 = 168;
    # outside the layers: embed 256 + head 256 + norm 8 + rope 128 = 648.
    # TP: each expert split, 3 x (2*8*8 + 8*8) = 576 -> (168 + 576) x 2 + 648 = 2136 elements.
    # EP: cdiv(3, 2) = 2 whole experts, 2 x (2*16*8 + 8*16) = 768 -> (168 + 768) x 2 + 648 =
    # 2520 elements.
    arch = ServingArch.from_hf_config({**TINY_MIXTRAL, "num_local_experts": 3})
    assert W.stage_weight_bytes(arch, calc.Serving(tensor_parallel=2), 0) == 2 * 2136
    ep = calc.Serving(tensor_parallel=2, expert_parallel=True)
    assert W.stage_weight_bytes(arch, ep, 0) == 2 * 2520
    with pytest.raises(ValueError, match="expert_parallel"):
        calc.Serving(expert_parallel="yes")  # type: ignore[arg-type]


def test_declared_checkpoint_quantization_is_read() -> None:
    # DeepSeek-V3's config.json ships its fp8 quantization_config (block-wise fp8 weights)
    arch = ServingArch.from_hf_config(calc.load_card_config("deepseek-v3"))
    assert arch.checkpoint_quant == "fp8"
    assert ServingArch.from_hf_config(TINY_MIXTRAL).checkpoint_quant is None


def _tiny_hybrid(pattern: str) -> ServingArch:
    layers = tuple(LayerKV("full") if c == "F" else LayerKV("sliding", 64) for c in pattern)
    return ServingArch(
        name="t", model_type="gemma2", hidden=8, n_heads=2, n_kv_heads=1, head_dim=4, ffn=16,
        vocab=64, max_positions=512, layers=layers, moe_layers=(False,) * len(layers),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("pattern", "pages_available", "blocks"),
    [
        # hybrid model + PP: worker 0 holds 2 full layers, worker 1 2 sliding ones; each worker
        # has page x 2 x 10 bytes -> num_blocks = 10 (groups of 2 layers)
        ("FFSS", 20, 10),
        # "the number of layers per group is similar": each worker 1 full + 2 sliding, page x 10
        # bytes -> groups (full x 2), (sliding x 2), (sliding x 2), one layer of each per worker:
        # num_blocks = 10
        ("FSSFSS", 10, 10),
    ],
)
def test_hybrid_blocks_match_vllms_own_test(
    pattern: str, pages_available: int, blocks: int
) -> None:
    """vLLM's tests/v1/core/test_kv_cache_utils.py ``test_get_kv_cache_configs_multiple_workers``
    (commit 002f10e0): two pipeline stages, the expected ``num_blocks`` is vLLM's."""
    arch = _tiny_hybrid(pattern)
    serving = calc.Serving(pipeline_parallel=2)
    for stage in (0, 1):
        layers = W.stage_layer_indices(arch.n_layers, 2, stage)
        layout = kv.kv_layout(arch, serving, "v1", layers, 512, 256)
        assert kv.num_blocks(pages_available * layout.page_bytes, layout.page_bytes,
                             layout.group_size) == blocks  # fmt: skip


@pytest.mark.parametrize(
    ("pattern", "pages_available", "blocks", "version"),
    [
        ("FS", 2 * 32, 64, "0.19.0"),  # full + sliding, hybrid manager: groups of 1 layer
        ("FS", 2 * 32, 32, "0.9.2"),  # the same without it: one group of 2 full layers
        ("FFSSSS", 2 * 32, 32, "0.19.0"),  # 2 full + 4 sliding, 2 layers per group
        ("FFFSSSSSSS", 3 * 32, 32, "0.19.0"),  # 3 full + 7 sliding, padded to 3 + 9
        ("FFFFFFSSSSS", 6 * 32, 32, "0.19.0"),  # 6 full + 5 sliding, padded to 6 + 6 (1.5 rule)
    ],
)
def test_hybrid_blocks_one_worker_match_vllms_own_test(
    pattern: str, pages_available: int, blocks: int, version: str
) -> None:
    """vLLM's tests/v1/core/test_kv_cache_utils.py ``test_get_kv_cache_config_one_worker``
    (commit 002f10e0): available memory in units of one layer's page, vLLM's ``num_blocks``
    (its disable_hybrid_kv_cache_manager case stands for the releases before the manager)."""
    arch = _tiny_hybrid(pattern)
    serving = calc.Serving(vllm_version=version)
    layout = kv.kv_layout(arch, serving, "v1", range(arch.n_layers), 512, 256)
    got = kv.num_blocks(pages_available * layout.page_bytes, layout.page_bytes, layout.group_size)
    assert got == blocks


def test_inverse_questions_take_a_config() -> None:
    # the longest context at which 4 requests fit: 4x at it, below 4x one token longer
    cfg = calc.load_card_config("qwen3-30b-a3b")
    serving = calc.Serving(tensor_parallel=2)
    total = 40 * 2**30
    length = inverse.largest_max_model_len(cfg, serving, 4.0, total_bytes=total)
    assert 0 < length < 40960
    at = calc.serve(cfg, replace(serving, max_model_len=length), total_bytes=total)
    past = calc.serve(cfg, replace(serving, max_model_len=length + 1), total_bytes=total)
    assert at.max_concurrency >= 4 > past.max_concurrency
    # 56.9 GiB of bf16 weights exceed 0.9 x 40 GiB on one GPU; half of them (28.5 GiB) leave
    # ~7 GiB for the KV cache, far more than one 4096-token request needs: tp = 2
    assert inverse.fewest_tensor_parallel(cfg, calc.Serving(max_model_len=4096), 1.0,
                                          total_bytes=total) == 2  # fmt: skip


def test_a_card_of_another_architecture_is_served_from_its_config() -> None:
    # calc.load_card gives a ModelSpec carrying the config (the derived path); serving reads the
    # same config.json as when it is passed as a dict, so both answers are one
    config = calc.load_card_config("mixtral-8x7b")
    spec = calc.load_card("mixtral-8x7b")
    serving = calc.Serving(tensor_parallel=2, max_model_len=32768)
    from_spec = calc.serve(spec, serving, gpu="h100-80gb")
    from_dict = calc.serve(config, serving, gpu="h100-80gb")
    assert from_spec == from_dict
    assert from_spec.kv_cache_tokens > 0
