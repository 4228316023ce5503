"""LoRA's adapters on the linears of derived architectures (`calc.derive.lora`,
`calc.derive.linears`): latent attention, shared experts, routed experts left alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from calc.derive.replay import MOE_LORA_NOTE, derived_trainable_numels

pytest.importorskip("transformers")

BASE = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
    "max_position_embeddings": 512,
}  # fmt: skip
DEEPSEEK_V3 = {
    **BASE, "model_type": "deepseek_v3", "num_key_value_heads": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
}  # fmt: skip
MIXTRAL = {**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


def _trained(config: dict, lora: calc.LoRA) -> int:
    spec = calc.ModelSpec.from_hf_config(config)
    job = calc.Training(micro_batch=1, seq_len=16, lora=lora)
    return sum(derived_trainable_numels(spec, job))


def adapter(rank: int, in_features: int, out_features: int) -> int:
    """A is [r, in], B is [out, r] (Hu et al. 2021)."""
    return rank * (in_features + out_features)


def test_latent_attention_and_shared_experts_get_adapters() -> None:
    # transformers' DeepseekV3Attention: q_a_proj 64 -> q_lora_rank 32, q_b_proj 32 -> 4 heads
    # x (16 + 8); kv_a_proj_with_mqa 64 -> kv_lora_rank 16 + rope 8, kv_b_proj 16 -> 4 heads x
    # (16 + 16); o_proj 4 x 16 -> 64. Layer 0 is dense (first_k_dense_replace=1): its MLP
    # 64 -> 128 -> 64; layer 1's shared expert 64 -> 1 x 32 -> 64; its 4 routed experts none.
    r = 4
    attention = (adapter(r, 64, 32) + adapter(r, 32, 96) + adapter(r, 64, 24)
                 + adapter(r, 16, 128) + adapter(r, 64, 64))  # fmt: skip
    dense_mlp = 2 * adapter(r, 64, 128) + adapter(r, 128, 64)
    shared_mlp = 2 * adapter(r, 64, 32) + adapter(r, 32, 64)
    assert _trained(DEEPSEEK_V3, calc.LoRA(rank=r)) == 2 * attention + dense_mlp + shared_mlp
    only_attention = calc.LoRA(rank=r, modules=("q", "k", "v", "o"))
    assert _trained(DEEPSEEK_V3, only_attention) == 2 * attention


def test_deepseek_v2_queries_without_low_rank_adapt_q_proj() -> None:
    config = {**DEEPSEEK_V3, "model_type": "deepseek_v2", "q_lora_rank": None,
              "topk_method": "greedy"}  # fmt: skip
    # q_proj 64 -> 4 x 24; k and v: the two latent projections as above
    per_layer = adapter(2, 64, 96) + adapter(2, 64, 24) + adapter(2, 16, 128)
    assert _trained(config, calc.LoRA(rank=2, modules=("q", "k", "v"))) == 2 * per_layer


def test_routed_experts_get_none_as_with_peft_target_modules() -> None:
    # Mixtral's experts are 3-D parameters: the default modules adapt q, k, v, o alone (q
    # 64 -> 64, k and v 64 -> 2 x 16, o 64 -> 64), the same bytes as naming them, with a note
    r = 8
    per_layer = 2 * adapter(r, 64, 64) + 2 * adapter(r, 64, 32)
    assert _trained(MIXTRAL, calc.LoRA(rank=r)) == 2 * per_layer
    spec = calc.ModelSpec.from_hf_config(MIXTRAL)
    job = calc.Training(micro_batch=2, seq_len=32, lora=calc.LoRA(rank=r))
    default = calc.estimate(spec, job, device="cpu")
    attention = calc.LoRA(rank=r, modules=("q", "k", "v", "o"))
    named = calc.estimate(spec, replace(job, lora=attention), device="cpu")
    assert default.peak_bytes == named.peak_bytes
    assert MOE_LORA_NOTE in default.notes and MOE_LORA_NOTE not in named.notes


def test_a_dense_model_lacking_a_chosen_projection_is_still_refused() -> None:
    # Starcoder2's MLP is c_fc / c_proj: gate, up and down are nowhere, and it has no experts
    spec = calc.ModelSpec.from_hf_config({**BASE, "model_type": "starcoder2"})
    job = calc.Training(micro_batch=1, seq_len=16, lora=calc.LoRA(rank=4))
    with pytest.raises(NotImplementedError, match=r"\['down', 'gate', 'up'\]"):
        calc.estimate(spec, job, device="cpu")
