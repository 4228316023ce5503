"""Scaled-down copies of a model card: the same architecture at a size a CPU runs in a second.

`scaled_spec` keeps what decides the *shape* of memory (model type, MLP and norm kinds, biases,
q/k norms, tied embeddings, the GQA ratio ``n_heads / n_kv_heads``, the ratio
``n_heads * head_dim / hidden``, the ratio ``ffn / hidden`` rounded to a multiple of 8, dropout
probabilities) and shrinks what only scales it (layers, width, vocabulary, positions).
"""

from __future__ import annotations

import json
from fractions import Fraction

from calc.config.model_spec import ModelSpec
from calc.data.cards import load_card
from calc.derive.dropout import dropout_config

DEFAULT_HEAD_DIM = 16
"""Head width of a scaled model unless given, in elements."""
DEFAULT_VOCAB = 512
"""Vocabulary of a scaled model unless given (rows of the embedding)."""
DEFAULT_MAX_POSITIONS = 256
"""``max_positions`` of a scaled model unless given (GPT-2's ``wpe`` rows)."""
FFN_MULTIPLE = 8
"""The scaled feed-forward size is rounded to a multiple of this."""


def gqa_ratio(spec: ModelSpec) -> int:
    """Query heads per key/value head."""
    return spec.n_heads // spec.n_kv_heads


def head_ratio(spec: ModelSpec) -> Fraction:
    """``n_heads * head_dim / hidden``: 1 for most models, 8/5 for Qwen3-32B."""
    return Fraction(spec.n_heads * spec.head_dim, spec.hidden)


def scaled_ffn(spec: ModelSpec, hidden: int) -> int:
    """``hidden * ffn / spec.hidden`` rounded to the nearest multiple of `FFN_MULTIPLE` (>= 8)."""
    exact = Fraction(hidden * spec.ffn, spec.hidden)
    return max(FFN_MULTIPLE, round(exact / FFN_MULTIPLE) * FFN_MULTIPLE)


def scaled_spec(
    card: str | ModelSpec,
    *,
    layers: int = 2,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    hidden: int | None = None,
    vocab: int = DEFAULT_VOCAB,
    max_positions: int = DEFAULT_MAX_POSITIONS,
    **overrides: object,
) -> ModelSpec:
    """A small model with the structure of ``card`` (a card id or a `ModelSpec`).

    Heads: ``n_kv_heads = kv_heads`` (default: enough for at least 4 query heads), ``n_heads`` =
    that times the card's GQA ratio. Width: ``head_dim`` defaults to 16 and
    ``hidden = n_heads * head_dim / head_ratio``; given ``hidden`` instead, ``head_dim`` follows
    from it. ``ffn`` keeps the card's ``ffn / hidden`` (multiple of 8). Further keyword arguments
    are `ModelSpec` fields set last (e.g. ``tied_embeddings=False``, ``attention_dropout=0.0``).

    Example: llama-3.1-8b (32 heads, 8 kv heads, head_dim 128, hidden 4096, ffn 14336) scales to
    4 heads, 1 kv head, head_dim 16, hidden 64, ffn 224 (64 * 3.5).

    Raises ``ValueError`` naming the argument when the ratios cannot be kept exactly.
    """
    base = load_card(card) if isinstance(card, str) else card
    if not isinstance(base, ModelSpec):
        raise ValueError(f"card={card!r} must be a card id or a ModelSpec")
    for name, value in (("layers", layers), ("vocab", vocab), ("max_positions", max_positions)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    g = gqa_ratio(base)
    kv = kv_heads if kv_heads is not None else max(1, -(-4 // g))
    if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0:
        raise ValueError(f"kv_heads={kv_heads!r} must be a positive integer")
    heads = kv * g
    ratio = head_ratio(base)
    if hidden is None:
        hd = DEFAULT_HEAD_DIM if head_dim is None else head_dim
        width = Fraction(heads * hd) / ratio
        if width.denominator != 1:
            raise ValueError(
                f"head_dim={hd} with {heads} heads gives hidden={width}, not an integer, "
                f"for head ratio {ratio}"
            )
        h = int(width)
    else:
        h = hidden
        hd_exact = Fraction(h) * ratio / heads
        if hd_exact.denominator != 1 or (head_dim is not None and head_dim != hd_exact):
            raise ValueError(
                f"hidden={hidden} with {heads} heads gives head_dim={hd_exact}; it must be an "
                f"integer (and equal head_dim={head_dim} if given) for head ratio {ratio}"
            )
        hd = int(hd_exact)
    fields: dict[str, object] = {
        "name": f"{base.name}-scaled",
        "n_layers": layers,
        "n_heads": heads,
        "n_kv_heads": kv,
        "head_dim": hd,
        "hidden": h,
        "ffn": scaled_ffn(base, h),
        "vocab": vocab,
        "max_positions": max_positions,
    }
    fields.update(overrides)
    return base.with_overrides(**fields)


def with_dropout(spec: ModelSpec, p: float | None) -> ModelSpec:
    """The model a job with ``dropout=p`` runs: ``attention_dropout``, ``hidden_dropout`` and
    ``embedding_dropout`` all set to ``p``, as ``calc.step.training.shape_for`` reads ``Training.dropout``
    ("every dropout site"). The llama family's Hugging Face code has an attention-dropout site
    only, so there only that one acts. ``None`` keeps the spec's values. A derived
    architecture's ``config.json`` gets ``p`` at every dropout key
    (`calc.derive.dropout.dropout_config`: what calc's ``dropout`` means there)."""
    if p is None:
        return spec
    if spec.hf_config is not None:  # the SDPA pins read attention_dropout
        config = dropout_config(json.loads(spec.hf_config), p)
        attn = config.get("attention_dropout", 0.0)
        return spec.with_overrides(
            hf_config=json.dumps(config, sort_keys=True), attention_dropout=float(attn)
        )
    return spec.with_overrides(attention_dropout=p, hidden_dropout=p, embedding_dropout=p)
