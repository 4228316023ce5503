"""Tiny model specifications shared by the tests: small enough that every byte count can be
derived by hand in the test that uses it.

``tiny_llama()`` is a llama-family model with hidden 16, 2 layers, 2 heads of 8 (no GQA), feed-
forward 24 (SwiGLU), vocabulary 50, RMSNorm, RoPE, no biases, untied head, no dropout;
``tiny_llama(**changes)`` changes any field (``n_layers=5``, ``model_type="qwen2"``, ...).
"""

from __future__ import annotations

import calc

TINY_LLAMA_FIELDS: dict[str, object] = {
    "name": "tiny-llama", "model_type": "llama", "hidden": 16, "n_layers": 2, "n_heads": 2,
    "n_kv_heads": 2, "head_dim": 8, "ffn": 24, "vocab": 50, "max_positions": 64,
    "mlp": "swiglu", "norm": "rmsnorm", "qkv_bias": False, "o_bias": False, "mlp_bias": False,
    "norm_bias": False, "qk_norm": False, "tied_embeddings": False, "learned_positions": False,
    "attention_dropout": 0.0, "hidden_dropout": 0.0, "embedding_dropout": 0.0,
    "norm_eps": 1e-6, "rope_theta": 10000.0,
}  # fmt: skip


def tiny_llama(**changes: object) -> calc.ModelSpec:
    """The tiny llama above, with ``changes`` applied."""
    return calc.ModelSpec(**{**TINY_LLAMA_FIELDS, **changes})  # type: ignore[arg-type]
