"""Every sympy symbol of the cost model, in one place.

Sizes are positive integers; the model's dimensions are symbols too, so the formulas shown to
users read in terms of ``h``, ``L``, ``V`` rather than in digits. A model card supplies their
values when an expression is evaluated.
"""

from __future__ import annotations

import sympy as sp

_INT = {"positive": True, "integer": True}

# Job sizes
b = sp.Symbol("b", **_INT)
"""Micro-batch size (sequences per micro-batch, per GPU)."""
s = sp.Symbol("s", **_INT)
"""Sequence length of a training micro-batch or of an inference prompt (tokens)."""
c = sp.Symbol("c", **_INT)
"""Inference context length held in the KV cache (tokens)."""

# Model dimensions
h = sp.Symbol("h", **_INT)
"""Hidden size."""
L = sp.Symbol("L", **_INT)
"""Number of decoder layers."""
a = sp.Symbol("a", **_INT)
"""Number of query heads."""
k = sp.Symbol("k", **_INT)
"""Number of key/value heads (GQA; equals ``a`` for multi-head attention)."""
d = sp.Symbol("d", **_INT)
"""Head dimension."""
f = sp.Symbol("f", **_INT)
"""Feed-forward (intermediate) size."""
V = sp.Symbol("V", **_INT)
"""Vocabulary size (rows of the embedding matrix)."""
P = sp.Symbol("P", **_INT)
"""Learned position embeddings (rows of ``wpe``; GPT-2 only)."""

MODEL_SYMBOLS: tuple[sp.Symbol, ...] = (h, L, a, k, d, f, V, P)
JOB_SYMBOLS: tuple[sp.Symbol, ...] = (b, s, c)
ALL_SYMBOLS: tuple[sp.Symbol, ...] = JOB_SYMBOLS + MODEL_SYMBOLS

DESCRIPTIONS: dict[sp.Symbol, str] = {
    b: "micro-batch size (sequences)",
    s: "sequence length (tokens)",
    c: "KV-cache context length (tokens)",
    h: "hidden size",
    L: "decoder layers",
    a: "query heads",
    k: "key/value heads",
    d: "head dimension",
    f: "feed-forward size",
    V: "vocabulary size",
    P: "learned positions (GPT-2 wpe rows)",
}
INFERENCE_DESCRIPTIONS: dict[sp.Symbol, str] = {
    **DESCRIPTIONS,
    b: "batch size (sequences served together)",
    s: "prompt length (tokens of the prefill)",
}
"""``DESCRIPTIONS`` for an inference job, where ``b`` is the served batch and ``s`` the prompt
(``calc.estimate.core.values_for``)."""
