"""The Hugging Face ``config.json`` mapping of a `ModelSpec`: what ``transformers`` builds.

A spec read from a config of another architecture (a derived one, `ModelSpec.hf_config`) gives
that config back as it was; the five hand-modelled types are written out from the spec's fields,
with the key names of ``transformers/models/*/configuration_*.py``.
"""

from __future__ import annotations

import json
from typing import Any

from calc.config.model_spec import ModelSpec


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` keys that give ``spec`` back through ``ModelSpec.from_hf_config``.

    ``use_cache`` stays True, the default of every card's config.json: a plain training step
    then builds a ``DynamicCache`` (``calc.models.hf`` models it)."""
    if spec.hf_config is not None:
        return dict(json.loads(spec.hf_config))
    if spec.model_type == "gpt2":
        return {
            "model_type": "gpt2",
            "n_embd": spec.hidden,
            "n_layer": spec.n_layers,
            "n_head": spec.n_heads,
            "n_inner": spec.ffn,
            "vocab_size": spec.vocab,
            "n_positions": spec.max_positions,
            "attn_pdrop": spec.attention_dropout,
            "resid_pdrop": spec.hidden_dropout,
            "embd_pdrop": spec.embedding_dropout,
            "layer_norm_epsilon": spec.norm_eps,
            "activation_function": "gelu_new",
            "tie_word_embeddings": spec.tied_embeddings,
            "use_cache": True,
        }
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions,
        "attention_dropout": spec.attention_dropout,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta if spec.rope_theta is not None else 10_000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied_embeddings,
        "use_cache": True,
    }
    if spec.model_type in ("llama", "qwen3"):
        config["attention_bias"] = spec.qkv_bias
    if spec.model_type == "llama":
        config["mlp_bias"] = spec.mlp_bias
    return config
