"""Tiny model specifications shared by the tests: small enough that every byte count can be
derived by hand in the test that uses it.

``tiny_llama()`` is a llama-family model with hidden 16, 2 layers, 2 heads of 8 (no GQA), feed-
forward 24 (SwiGLU), vocabulary 50, RMSNorm, RoPE, no biases, untied head, no dropout;
``tiny_llama(**changes)`` changes any field (``n_layers=5``, ``model_type="qwen2"``, ...).
``tiny_llama64()`` is the same at hidden 64 (4 heads of 16, feed-forward 128, vocabulary 64), the
size the parallelism tests split (tp 2 and 4 divide the heads). ``tiny_training()`` is the job
those tests run: one sequence of 8 tokens, fp32, AdamW as a per-tensor loop, reference model.
``TINY_LLAMA_HF_CONFIG`` is a tiny llama as a Hugging Face config.json (1352 parameters);
``TINY_PHI3_CONFIG`` a tiny Phi-3 one (a derived type).
``recorded(name)`` is a verify case as the committed report recorded it, with the peak the CPU
tracker measured: an expected value calc did not make.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import calc
from calc.config.jobs import Inference, Training
from calc.config.model_spec import MODEL_TYPES

REPORT = Path(__file__).resolve().parents[1] / "verify" / "reports" / "latest" / "report.json"
"""The committed report of the full verification battery (peaks measured by the CPU tracker)."""

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


TINY_CONFIG: dict[str, object] = {
    "model_type": "llama", "hidden_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 24,
    "vocab_size": 50, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}  # fmt: skip
"""`tiny_llama`'s shapes as a Hugging Face ``config.json`` (what the CLI tests write to disk)."""


TINY_PHI3_CONFIG: dict[str, object] = {
    "model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 512,
    "max_position_embeddings": 512, "pad_token_id": 0,
}  # fmt: skip
"""A tiny Phi-3 config.json (a derived type: fused qkv_proj and gate_up_proj, untied head):
147,776 parameters, counted by hand in tests/calc/derive/test_replay.py."""


TINY_LLAMA_HF_CONFIG: dict[str, object] = {
    "model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 10,
    "tie_word_embeddings": False,
}  # fmt: skip
"""A Hugging Face config.json of a tiny llama (head_dim 4, GQA 2:1, untied): 1352 parameters,
counted by hand in tests/calc/data/test_model_cards.py (test_tiny_llama_hand_count)."""


TINY_LLAMA64_CHANGES: dict[str, object] = {
    "hidden": 64, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "ffn": 128, "vocab": 64,
}  # fmt: skip


def tiny_llama64(**changes: object) -> calc.ModelSpec:
    """`tiny_llama` at hidden 64 (4 heads of 16, ffn 128, vocab 64), with ``changes`` applied."""
    return tiny_llama(**{**TINY_LLAMA64_CHANGES, **changes})


def tiny_training(**changes: object) -> Training:
    """micro_batch 1, seq_len 8, fp32, AdamW for-loop, reference; ``changes`` applied."""
    job: dict[str, object] = dict(micro_batch=1, seq_len=8, precision="fp32", optimizer="adamw",
                                  optimizer_impl="for-loop", implementation="reference")  # fmt: skip
    return Training(**{**job, **changes})  # type: ignore[arg-type]


@cache
def _recorded_cases() -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(REPORT.read_text())["cases"]}


def recorded(name: str) -> tuple[calc.ModelSpec, Training | Inference, int]:
    """The scaled model, the job and the measured peak (bytes, CPU tracker) of the verify case
    ``name`` in `REPORT`."""
    case = _recorded_cases()[name]
    job_class = Training if case["kind"] == "training" else Inference
    return calc.ModelSpec(**case["spec"]), job_class(**case["job"]), case["measured_peak"]


def modelled_cards() -> list[str]:
    """The cards whose ``model_type`` has a hand-written graph (the others are derived from
    their modeling code, `calc.derive`)."""
    return [c for c in calc.list_cards() if calc.load_card_config(c)["model_type"] in MODEL_TYPES]
