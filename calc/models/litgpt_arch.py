"""What of LitGPT's ``Config`` (litgpt 0.5.12 ``litgpt/config.py``) decides memory beyond
`calc.config.model_spec.ModelSpec`'s switches (`Arch`), and the model litgpt builds for a
Hugging Face config (`as_built`).

LitGPT's ``GPT`` is one model class for every family, steered by its config: the block's
residual layout (``parallel_residual``, ``shared_attention_norm``), the fraction of each head
RoPE rotates (``rotary_percentage``), the MLP class (``LLaMAMLP`` or ``GptNeoxMLP``), the norm
class (``RMSNorm`` or ``torch.nn.LayerNorm``), one ``bias`` flag for every block linear and
``lm_head_bias`` for the head. A derived Hugging Face type litgpt has configurations for is
built here as litgpt builds it (its ``config.py`` entries):

* ``phi3`` (Phi-3-mini, Phi-4): a Llama configuration (``LLaMAMLP``, ``RMSNorm``, no biases);
* ``phi`` (phi-1.5, phi-2): parallel residual sharing ``norm_1``, ``LayerNorm``,
  ``GptNeoxMLP`` with the tanh GeLU, biases on every linear and on the head, RoPE on
  ``partial_rotary_factor`` of each head;
* ``gpt_neox`` (Pythia, StableLM-Base-Alpha): parallel residual with its own ``norm_2``,
  ``LayerNorm``, ``GptNeoxMLP`` with the exact GeLU, biases on the block linears only, RoPE on
  ``rotary_pct`` of each head;
* ``falcon`` (Falcon-7B, -40B): parallel residual (``norm_1`` shared in the 7B layout),
  ``LayerNorm``, ``GptNeoxMLP`` with the exact GeLU, no biases, multi-query attention;
* ``gemma`` (Gemma 2B, 7B): a Llama layout with ``GemmaMLP``, scaled embeddings and the
  norms' unit offset, an untied head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from calc.config.model_spec import ModelSpec

WHAT = "implementation='litgpt'"


@dataclass(frozen=True, slots=True)
class Arch:
    """The config fields of litgpt's ``GPT`` that `ModelSpec` has no switch for."""

    parallel_residual: bool = False
    """``Block.forward``: ``x + attn(norm_1(x)) + mlp(norm_2(x))`` instead of two residual
    steps in a row."""
    shared_attention_norm: bool = False
    """With ``parallel_residual``: the MLP reads ``norm_1``'s output (no ``norm_2``)."""
    rope_fraction: Fraction = Fraction(1)
    """``rotary_percentage``: RoPE rotates ``int(fraction * head_size)`` of each head."""
    gelu_approximate: str = "none"
    """``GptNeoxMLP``'s ``F.gelu(..., approximate=...)`` (the same bytes either way)."""
    head_bias: bool = False
    """``lm_head_bias``."""
    gemma: bool = False
    """Gemma's three changes: ``GemmaMLP`` (``gelu(fc_1(x)) * fc_2(x)``, the tanh GeLU),
    ``scale_embeddings`` (``wte``'s output times ``torch.tensor(n_embd ** 0.5)``) and
    ``RMSNorm(add_unit_offset=True)`` (``1 + weight``: litgpt's ``"Gemma" in name``)."""

    def key(self) -> tuple[bool, bool, str, str, bool, bool]:
        """The fields as a hashable part of the compile key."""
        return (self.parallel_residual, self.shared_attention_norm, str(self.rope_fraction),
                self.gelu_approximate, self.head_bias, self.gemma)  # fmt: skip


LLAMA = Arch()
"""litgpt's Llama configurations (and Mistral's, Phi-3's)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LitSpec(ModelSpec):
    """A model as litgpt builds it: `ModelSpec`'s sizes and switches (``model_type`` the
    family's Llama-like stand-in) and the rest of litgpt's config (`arch`)."""

    arch: Arch = LLAMA
    """Residual layout, partial RoPE, GeLU, head bias."""
    family: str = "llama"
    """The Hugging Face ``model_type`` it was read from (for messages)."""


def arch_of(model: ModelSpec) -> Arch:
    """``model``'s litgpt configuration: `LitSpec.arch`, or a Llama's."""
    return model.arch if isinstance(model, LitSpec) else LLAMA


def _fraction(value: object, field: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{field}={value!r} must be a number in (0, 1]")
    return Fraction(str(value))


def _phi(cfg: dict[str, Any]) -> tuple[dict[str, Any], Arch]:
    """``PhiForCausalLM`` as litgpt's ``phi-2`` (``config.py``): biases everywhere, the tanh
    GeLU (``gelu_new``), ``norm_1`` shared by attention and the MLP."""
    if cfg.get("qk_layernorm"):
        raise NotImplementedError(f"{WHAT} on model_type='phi' with qk_layernorm=true")
    fraction = _fraction(cfg.get("partial_rotary_factor", 0.5), "partial_rotary_factor")
    biased = {"qkv_bias": True, "o_bias": True, "mlp_bias": True}
    return biased, Arch(True, True, fraction, "tanh", head_bias=True)


def _gpt_neox(cfg: dict[str, Any]) -> tuple[dict[str, Any], Arch]:
    """``GPTNeoXForCausalLM`` as litgpt's ``stablelm-base-alpha`` and ``pythia`` entries:
    biases on the block linears, not the head; the exact GeLU; its own ``norm_2``."""
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise NotImplementedError(f"{WHAT} on model_type='gpt_neox' with hidden_act={act!r}")
    fraction = _fraction(cfg.get("rotary_pct", 0.25), "rotary_pct")
    parallel = cfg.get("use_parallel_residual", True)
    biased = {"qkv_bias": True, "o_bias": True, "mlp_bias": True}
    return biased, Arch(bool(parallel), False, fraction, "none")


def _falcon(cfg: dict[str, Any]) -> tuple[dict[str, Any], Arch]:
    """``FalconForCausalLM`` as litgpt's ``falcon-7b`` and ``falcon-40b`` entries: parallel
    residual, ``norm_1`` shared unless ``new_decoder_architecture`` (its two norms), the exact
    GeLU, ``bias`` on the block linears, multi-query attention (one key/value head) or
    ``num_kv_heads`` groups in the new architecture."""
    if cfg.get("alibi"):
        raise NotImplementedError(f"{WHAT} on model_type='falcon' with alibi=true (no RoPE)")
    new = bool(cfg.get("new_decoder_architecture", False))
    if not new and not cfg.get("parallel_attn", True):
        raise NotImplementedError(f"{WHAT} on model_type='falcon' with parallel_attn=false")
    heads = int(cfg.get("num_attention_heads", cfg.get("n_head", 71)))
    kv = (
        int(cfg.get("num_kv_heads", heads)) if new else 1 if cfg.get("multi_query", True) else heads
    )
    biased = bool(cfg.get("bias", False))
    hidden = int(cfg.get("hidden_size", 4544))
    switches = {"qkv_bias": biased, "o_bias": biased, "mlp_bias": biased, "n_kv_heads": kv,
                "ffn": int(cfg.get("ffn_hidden_size") or 4 * hidden)}  # fmt: skip
    return switches, Arch(True, not new, Fraction(1), "none")


def _gemma(cfg: dict[str, Any]) -> tuple[dict[str, Any], Arch]:
    """``GemmaForCausalLM`` as litgpt's ``Gemma-2b`` and ``Gemma-7b`` entries: ``GemmaMLP``
    with the tanh GeLU, embeddings scaled, ``RMSNorm`` with the unit offset, no biases, and
    its own ``lm_head`` (litgpt's ``GPT`` always has one; the checkpoint's tied embedding is
    copied into it)."""
    return {"tied_embeddings": False}, Arch(gelu_approximate="tanh", gemma=True)


def _phi3(cfg: dict[str, Any]) -> tuple[dict[str, Any], Arch]:
    """``Phi3ForCausalLM`` (Phi-3-mini, Phi-4): a Llama configuration in litgpt."""
    partial = cfg.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise NotImplementedError(
            f"{WHAT} on model_type='phi3' with partial_rotary_factor={partial}: modelled for "
            "full rotary embeddings (litgpt's rotary_percentage=1.0)"
        )
    return {}, LLAMA


_FAMILIES = {
    "phi3": _phi3, "phi": _phi, "gpt_neox": _gpt_neox, "falcon": _falcon, "gemma": _gemma,
}  # fmt: skip
FAMILIES = tuple(_FAMILIES)
"""The derived Hugging Face types `as_built` maps to litgpt's configurations."""


def as_built(model: ModelSpec) -> ModelSpec:
    """The model litgpt builds for ``model``: a derived type of `FAMILIES` as its litgpt
    configuration (the module docstring), its sizes and sliding window kept; any other model
    as it is but untied (`calc.models.litgpt.check` refuses what litgpt's code here does not
    cover)."""
    if not model.derived or model.hf_config is None or model.model_type not in _FAMILIES:
        # fine-tuning never ties (finetune/*.py refuse train.tie_embeddings): a tied checkpoint
        # (Llama-3.2-1B, 3B) gets a head of its own, a copy of the embedding
        return replace(model, tied_embeddings=False) if model.tied_embeddings else model
    cfg = json.loads(model.hf_config)
    switches, arch = _FAMILIES[model.model_type](cfg)
    layer_norm = model.model_type in ("phi", "gpt_neox", "falcon")
    fields: dict[str, Any] = {
        "name": model.name, "model_type": "llama", "hidden": model.hidden,
        "n_layers": model.n_layers, "n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads,
        "head_dim": model.head_dim, "ffn": model.ffn, "vocab": model.vocab,
        "max_positions": model.max_positions, "mlp": "gelu" if layer_norm else "swiglu",
        "norm": "layernorm" if layer_norm else "rmsnorm", "qkv_bias": False, "o_bias": False,
        "mlp_bias": False, "norm_bias": layer_norm, "qk_norm": False,
        "tied_embeddings": model.tied_embeddings, "learned_positions": False,
        "attention_dropout": 0.0, "hidden_dropout": 0.0, "embedding_dropout": 0.0,
        "norm_eps": 1e-5, "rope_theta": None, "sliding_window": model.sliding_window,
    }  # fmt: skip
    return LitSpec(**{**fields, **switches}, arch=arch, family=model.model_type)
