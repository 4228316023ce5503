"""Cases of architectures with no hand-written graph: calc derives their replay (`calc.derive`).

Each runs transformers' own model (``implementation="hf"``) built from a tiny config of the
real ``model_type``, written here (the shapes of the upstream configs scaled down: 2-3 layers,
hidden 64, 4 heads of 16, vocabulary 512), and checks calc's derived estimate against the CPU
tracker: training in fp32 and in amp-bf16, and a bf16 prefill, per architecture; and models of
more layers, recorded five (layers or repeating patterns of layers) at a time. Gemma runs
eager attention (its soft-capping is written in the eager path), DeepSeek too (its value heads are
narrower than its query heads, which CPU flash SDPA refuses). The MoE types (`MOE_TYPES`) add a
pure bf16 training case, and Mixtral a case with the worst routing.
"""

from __future__ import annotations

import json
from typing import Any

from calc.config.jobs import Inference, Training
from verify.cases.case import TOLERANCE_PCT, Case, pairs

_BASE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
    "max_position_embeddings": 512, "use_cache": True,
}  # fmt: skip
"""What every tiny config shares (key names of ``transformers/models/*/configuration_*.py``)."""

CONFIGS: dict[str, dict[str, Any]] = {
    # soft-capping of attention logits and final logits, sliding window on alternate layers
    "gemma2": {**_BASE, "model_type": "gemma2", "sliding_window": 16,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 16},
    # two local layers then a global one (Gemma-3's 5:1 pattern, shortened), q/k norms
    "gemma3_text": {**_BASE, "model_type": "gemma3_text", "num_hidden_layers": 3,
                    "sliding_window": 16, "query_pre_attn_scalar": 16,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    # fused qkv_proj and gate_up_proj (Phi-3 / Phi-4)
    "phi3": {**_BASE, "model_type": "phi3", "num_key_value_heads": 4, "pad_token_id": 0},
    # q/k RMSNorm over the whole projection, norms after attention and MLP
    "olmo2": {**_BASE, "model_type": "olmo2", "pad_token_id": 1},
    # embedding, residual, attention and logits multipliers
    "granite": {**_BASE, "model_type": "granite", "embedding_multiplier": 12.0,
                "logits_scaling": 8.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0625},
    # LayerNorm with bias, GELU MLP with biases
    "starcoder2": {**_BASE, "model_type": "starcoder2", "sliding_window": None,
                   "intermediate_size": 256},
    # parallel attention and MLP from one LayerNorm, logit scale
    "cohere": {**_BASE, "model_type": "cohere", "use_qk_norm": False, "pad_token_id": 0},
    # mixture of experts: a router, top-2 of 4 experts run by grouped_mm (every layer)
    "mixtral": {**_BASE, "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2},
    # top-2 of 4 experts of their own width, q/k norms per head
    "qwen3_moe": {**_BASE, "model_type": "qwen3_moe", "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "norm_topk_prob": True},
    # routed experts plus a gated shared expert
    "qwen2_moe": {**_BASE, "model_type": "qwen2_moe", "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1},
    # latent attention (q and kv low-rank projections, a RoPE part of the heads), a first
    # dense layer, then routed experts with a shared one and grouped top-k routing
    "deepseek_v3": {**_BASE, "model_type": "deepseek_v3", "num_key_value_heads": 4,
                    "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16},
    # DeepSeek-V2-Lite's shape: latent kv, queries without a low-rank projection, greedy top-k
    "deepseek_v2": {**_BASE, "model_type": "deepseek_v2", "num_key_value_heads": 4,
                    "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "topk_method": "greedy", "q_lora_rank": None,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16},
}  # fmt: skip


MOE_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2")
"""Mixtures of experts: transformers' default ``grouped_mm`` experts (sizes of every buffer
``tokens x top_k`` rows, whatever the routing)."""


def config_case(
    name: str, card: str, job: Training | Inference, config: str, note: str, *tags: str
) -> Case:
    """A case of transformers' model built from ``config`` (``config.json`` text), predicted
    by the derived replay; tagged with its kind, ``hf``, ``derived`` and ``tags``."""
    kind = "training" if isinstance(job, Training) else "inference"
    return Case(
        name=name,
        card=card,
        job=job,
        impl="hf",
        tolerance_pct=TOLERANCE_PCT["hf"],
        tags=(kind, "hf", "derived", *tags),
        note=note,
        config=config,
        scale=pairs(None),
    )


def _case(model_type: str, label: str, job: Training | Inference, **config: Any) -> Case:
    text = json.dumps({**CONFIGS[model_type], **config}, sort_keys=True)
    note = "no hand-written graph: calc derives the replay from transformers' code"
    return config_case(f"derived-{model_type}-{label}", model_type, job, text, note)


def derived_cases() -> list[Case]:
    """Three cases per architecture of `CONFIGS` (fp32 and amp-bf16 training, bf16 prefill),
    and two seven-layer ones (the generalisation from five recorded layers)."""
    out = []
    for model_type in CONFIGS:
        attention = "eager" if model_type.startswith(("gemma", "deepseek")) else "sdpa"
        common = {"attention": attention, "implementation": "hf"}
        out.append(
            _case(
                model_type,
                "fp32",
                Training(micro_batch=2, seq_len=32, precision="fp32", optimizer="adamw", **common),
            )
        )
        out.append(
            _case(
                model_type,
                "amp-bf16",
                Training(
                    micro_batch=3, seq_len=64, precision="amp-bf16", optimizer="adamw", **common
                ),
            )
        )
        out.append(
            _case(
                model_type,
                "infer-bf16",
                Inference(batch=2, context=96, prompt=48, precision="bf16", **common),
            )
        )
    # MoE in pure bf16 (the dtype torch's meta rule of grouped_mm takes as is)
    for model_type in MOE_TYPES:
        attention = "eager" if model_type.startswith("deepseek") else "sdpa"
        bf16 = Training(
            micro_batch=2, seq_len=64, precision="bf16", optimizer="adamw",
            implementation="hf", attention=attention,
        )  # fmt: skip
        out.append(_case(model_type, "bf16", bf16))
    # The worst routing: with every weight 0 (initializer_range 0) the router's logits tie and
    # top-k picks the same 2 of the 4 experts for every token (counted once by hand with a
    # hook on layer 0's router: [0, 0, 64, 64] rows for 2 x 32 tokens); the seeded default
    # routes unevenly ([39, 15, 37, 37]). grouped_mm sizes both the same: one estimate.
    worst = Training(micro_batch=2, seq_len=32, precision="fp32", optimizer="adamw",
                     implementation="hf")  # fmt: skip
    out.append(_case("mixtral", "worst-routing-fp32", worst, initializer_range=0.0))
    # Seven layers, recorded with five and generalised to seven (calc.replay.timeline).
    seven = Training(micro_batch=2, seq_len=64, precision="fp32", implementation="hf")
    for model_type in ("phi3", "olmo2"):
        out.append(_case(model_type, "7-layers-fp32", seven, num_hidden_layers=7))
    # Layers that differ in a repeating pattern, recorded five patterns at a time and
    # generalised (calc.derive.period): Gemma-2's sliding/full pairs (7 pairs), Gemma-3's
    # (sliding, sliding, full) units (6 units and a tail of 2: 17 of 20 layers recorded),
    # DeepSeek-V2's dense first layer before 7 MoE ones.
    eager = {"implementation": "hf", "attention": "eager"}
    pattern = ["sliding_attention", "sliding_attention", "full_attention"] * 6
    for model_type, label, job, fields in (
        ("gemma2", "14-layers-amp-bf16",
         Training(micro_batch=2, seq_len=64, precision="amp-bf16", **eager),
         {"num_hidden_layers": 14}),
        ("gemma3_text", "20-layers-fp32",
         Training(micro_batch=2, seq_len=32, precision="fp32", recompute="full", **eager),
         {"num_hidden_layers": 20, "layer_types": pattern + pattern[:2]}),
        ("deepseek_v2", "8-layers-infer-bf16",
         Inference(batch=2, context=96, prompt=48, precision="bf16", **eager),
         {"num_hidden_layers": 8}),
    ):  # fmt: skip
        out.append(_case(model_type, label, job, **fields))
    # attention="sdpa" (the default) where the model cannot take CPU flash SDPA: Gemma-2's
    # class has no SDPA (transformers builds it eager), DeepSeek's value heads are narrower
    # than its query/key heads (CPU PyTorch falls back to math)
    sdpa = {"implementation": "hf", "attention": "sdpa"}
    out.append(_case("gemma2", "sdpa-fp32", Training(micro_batch=2, seq_len=32, **sdpa)))
    out.append(
        _case(
            "deepseek_v2",
            "sdpa-amp-bf16",
            Training(micro_batch=2, seq_len=64, precision="amp-bf16", **sdpa),
        )
    )
    # real configs name the checkpoint's dtype; the job's precision sets the weights' dtype on
    # both sides (transformers' from_config alone would build bf16 weights for an fp32 job)
    for precision in ("fp32", "amp-bf16"):
        out.append(
            _case(
                "gemma3_text",
                f"{precision}-config-says-bfloat16",
                Training(micro_batch=2, seq_len=32, precision=precision, **sdpa),
                torch_dtype="bfloat16",
            )
        )
    return out
