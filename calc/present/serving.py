"""Display rows of a vLLM serving estimate (`calc.serve`): the budget's terms and the
concurrency a KV cache gives at each context length, in GiB (2**30 bytes), for the Serve page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from calc.config.model_spec import ModelSpec
from calc.config.serving import Serving
from calc.serving.api import ServeEstimate, serve
from calc.units import GIB

TERMS: tuple[tuple[str, str], ...] = (
    ("weights", "weights"),
    ("non_torch", "non-torch memory"),
    ("activation_peak", "activation peak"),
    ("cuda_graphs", "CUDA graphs"),
    ("kv_cache", "KV cache"),
    ("free", "outside the budget"),
)
"""Breakdown keys of `ServeEstimate.breakdown` and their labels, bottom to top of the bar."""


def term_rows(est: ServeEstimate) -> list[dict[str, object]]:
    """One row per term of the GPU's memory: ``term``, ``GiB``, ``order`` (stacking order)."""
    parts = est.breakdown()
    return [
        {"term": label, "GiB": parts[key] / GIB, "order": i} for i, (key, label) in enumerate(TERMS)
    ]


def concurrency_rows(
    model: ModelSpec, serving: Serving, lengths: Sequence[int],
    total_bytes: int | None = None, gpu: str | None = None,
) -> list[dict[str, object]]:  # fmt: skip
    """``max_model_len`` -> vLLM's maximum concurrency (and KV tokens), one `calc.serve` per
    length (lengths beyond the model's ``max_positions`` are skipped)."""
    rows: list[dict[str, object]] = []
    for length in lengths:
        if length > model.max_positions:
            continue
        est = serve(model, replace(serving, max_model_len=length), total_bytes=total_bytes, gpu=gpu)
        rows.append(
            {"max_model_len": length, "concurrency": est.max_concurrency,
             "kv_tokens": est.kv_cache_tokens}
        )  # fmt: skip
    return rows


def context_lengths(max_positions: int) -> list[int]:
    """Powers of two from 1024 up to ``max_positions`` (and ``max_positions`` itself)."""
    lengths = []
    length = 1024
    while length < max_positions:
        lengths.append(length)
        length *= 2
    lengths.append(max_positions)
    return lengths
