"""The `hf` implementation: a Hugging Face transformers model built from a (scaled) `ModelSpec`.

Built from a config with ``AutoModelForCausalLM.from_config`` (``HF_HUB_OFFLINE=1``: nothing is
downloaded). ``transformers`` is an optional extra: `available` says whether it imports.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from calc.config.model_spec import ModelSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def available() -> bool:
    """Whether ``transformers`` can be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` keys that give ``spec`` back through ``ModelSpec.from_hf_config``.

    Key names follow ``transformers/models/*/configuration_*.py``. ``use_cache`` stays True, the
    default of every card's config.json: a plain training step then builds a ``DynamicCache``
    (``calc.models.hf`` models it)."""
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


def hf_config(spec: ModelSpec) -> Any:
    """A ``transformers`` config object for ``spec``."""
    import transformers

    fields = hf_config_dict(spec)
    model_type = fields.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **fields)


def build_hf(
    spec: ModelSpec, attention: str = "sdpa", device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """``AutoModelForCausalLM`` for ``spec`` with ``attn_implementation`` ``sdpa`` or ``eager``,
    initialised on ``device`` in training mode (seed the RNG before calling for fixed weights)."""
    import torch
    import transformers

    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention={attention!r} must be 'sdpa' or 'eager'")
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config(spec), attn_implementation=attention
        )
    return model.train()


def build_hf_on_meta(spec: ModelSpec, attention: str = "sdpa") -> torch.nn.Module:
    """The same model on the ``meta`` device: shapes only, no memory (for full-size cards)."""
    return build_hf(spec, attention, device="meta")


def hf_loss(
    model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token loss with ``labels`` (a separate tensor, as a data collator makes it;
    default ``ids``); transformers' ``ForCausalLMLoss`` shifts them."""
    return model(input_ids=ids, labels=ids if labels is None else labels).loss
