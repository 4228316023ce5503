"""Full-width cases of derived architectures: a real card's own ``config.json`` with one or two
decoder layers (``wide-*``).

The derived replay is recorded on tiny configs' structure and generalised over batch and
sequence; the sizes a real model lives at (a 256,000- or 100,352-token vocabulary, 14,336-wide
MLPs, 256-dimensional heads) come from the card's config itself, unscaled. Only the layer
count is cut, to two or one, so that a CPU step fits in about 10 GB and a few minutes:
everything else (vocabulary, widths, heads, norms, soft-capping, tied or untied head) is the
published model's.
The layer count is the one dimension the replay generalises by repetition, checked elsewhere
(`verify.cases.derived`, five-layer generalisation). Each runs in a child process of its own,
like the ``full-*`` cases; tagged ``full``, never ``quick``.
"""

from __future__ import annotations

import json
from typing import Any

from calc.config.jobs import Inference, Training
from calc.data.cards import load_card_config
from verify.cases.case import Case
from verify.cases.derived import config_case

__all__ = ["wide_cases"]

LAYERS = 2
"""Decoder layers kept of the card's config (the first two of its pattern), unless a case says
fewer (a layer of Phi-4 or Qwen3-30B-A3B holds 0.3 to 0.6 billion parameters; fp32 weights and
gradients of the whole model stay near 10 GB)."""


def _config(card: str, layers: int) -> str:
    """The card's upstream ``config.json`` with ``layers`` decoder layers (a per-layer list, such
    as ``layer_types``, cut to its first ``layers`` entries)."""
    config: dict[str, Any] = dict(load_card_config(card))
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    return json.dumps(config, sort_keys=True)


def _case(card: str, label: str, note: str, layers: int, job: Training | Inference) -> Case:
    name = f"wide-{card}-{label}"
    return config_case(name, card, job, _config(card, layers), note, "full", "wide")


def _attention(card: str) -> str:
    return "eager" if card.startswith("gemma") else "sdpa"


def _infer(card: str, label: str, note: str, layers: int = LAYERS, **job: Any) -> Case:
    """``wide-<card>-<label>``: an fp32 prefill of 1 x 512 tokens into a cache of 1,024 unless
    ``job`` says otherwise."""
    fields: dict[str, Any] = {
        "batch": 1,
        "context": 1024,
        "prompt": 512,
        "precision": "fp32",
        "implementation": "hf",
        "attention": _attention(card),
        **job,
    }
    return _case(card, label, note, layers, Inference(**fields))


def _wide(card: str, label: str, note: str, layers: int = LAYERS, **job: Any) -> Case:
    """``wide-<card>-<label>``: a training step of ``card`` at full width with ``layers``
    decoder layers, fp32 SGD, 1 x 128 tokens unless ``job`` says otherwise, transformers' model
    (eager attention for Gemma, as `verify.cases.derived`)."""
    fields: dict[str, Any] = {
        "micro_batch": 1, "seq_len": 128, "precision": "fp32", "optimizer": "sgd",
        "implementation": "hf", "attention": _attention(card), **job,
    }  # fmt: skip
    return _case(card, label, note, layers, Training(**fields))


def wide_cases() -> list[Case]:
    """The ``wide-*`` cases, in fp32: on a CPU without AVX-512 (this one, torch 2.13) a bf16
    matmul runs at 0.1 to 5 GFLOP/s against fp32's 30 (measured one thread, 256 x 3,584 by
    3,584 x 25,600), and the 256,000-token head alone would take an hour."""
    return [
        _wide("gemma-2-9b", "2l-sgd-fp32",
              "256,000-token tied head, logit soft-capping (30) over the whole logits, "
              "head_dim 256, one sliding and one full layer"),
        _wide("olmo-2-7b-instruct", "2l-sgd-fp32",
              "100,352-token untied head, q/k RMSNorm over all heads"),
        _wide("granite-3.3-8b-instruct", "2l-sgd-fp32-hold",
              "49,159-token tied head (an odd vocabulary), logits scaled by 1/16, "
              "embedding and residual multipliers; the output held through backward",
              loop="hold-output"),
        _wide("phi-4", "1l-sgd-fp32",
              "fused qkv and gate_up projections split in the forward, 100,352-token head",
              layers=1),
        _wide("qwen3-30b-a3b", "1l-sgd-fp32",
              "128 experts of 768, 8 per token, transformers' grouped_mm experts; "
              "151,936-token untied head", layers=1),
        _infer("gemma-2-9b", "2l-prefill-fp32",
               "a sliding and a full layer's caches at full width (8 KV heads of 256), "
               "the 256,000-token head"),
        _infer("phi-4", "1l-prefill-fp32", "fused qkv split into the cache's K and V",
               layers=1),
    ]  # fmt: skip
