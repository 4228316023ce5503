"""Display rows of a vLLM serving estimate (`calc.serve`): the budget's terms and the
concurrency a KV cache gives at each context length, in GiB (2**30 bytes), for the Serve page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from math import floor

from calc.config.model_spec import ModelSpec
from calc.config.serving import Serving
from calc.serving.api import ServeEstimate, resolve_model, serve
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


def startup_failure(est: ServeEstimate) -> str | None:
    """How vLLM fails to start with ``est``'s terms, in its own words, or ``None`` when it starts.

    The order is vLLM's: the weights load first (``torch.OutOfMemoryError`` when they exceed the
    GPU); then ``_check_enough_kv_cache_memory`` (``vllm/v1/core/kv_cache_utils.py``) raises
    "No available memory for the cache blocks" when the KV budget is not positive, and "To
    serve at least one request with the models's max seq len ..." when one ``max_model_len``
    request needs more KV cache than is available (`ServeEstimate.fits` is false)."""
    if est.weights_bytes > est.total_bytes:
        return (
            f"CUDA out of memory while loading the weights: {est.weights_bytes / GIB:.2f} GiB "
            f"per GPU on a {est.total_bytes / GIB:.2f} GiB GPU (more GPUs: tensor_parallel, or "
            "a quantized checkpoint)"
        )
    if est.kv_cache_bytes <= 0:
        return (
            "ValueError: No available memory for the cache blocks (available KV cache memory "
            f"{est.kv_cache_bytes / GIB:.2f} GiB): raise gpu_memory_utilization, or free memory "
            "(fewer batched tokens, more GPUs, a quantized checkpoint)"
        )
    if not est.fits:
        return (
            f"ValueError: one request of max_model_len={est.max_model_len:,} tokens needs more "
            f"KV cache than the {est.kv_cache_bytes / GIB:.2f} GiB available (maximum "
            f"concurrency {floor(est.max_concurrency * 1000) / 1000:.3f}x): lower max_model_len or raise "
            "gpu_memory_utilization"
        )
    return None


def term_rows(est: ServeEstimate) -> list[dict[str, object]]:
    """One row per term of the GPU's memory: ``term``, ``GiB``, ``order`` (stacking order)."""
    parts = est.breakdown()
    return [
        {"term": label, "GiB": parts[key] / GIB, "order": i} for i, (key, label) in enumerate(TERMS)
    ]


def concurrency_rows(
    model: ModelSpec | Mapping[str, object], serving: Serving, lengths: Sequence[int],
    total_bytes: int | None = None, gpu: str | None = None,
) -> list[dict[str, object]]:  # fmt: skip
    """``max_model_len`` -> vLLM's maximum concurrency (and KV tokens), one `calc.serve` per
    length (lengths beyond the model's ``max_positions`` are skipped); ``model`` as
    `calc.serve` takes it."""
    longest = resolve_model(model)[1].max_positions
    rows: list[dict[str, object]] = []
    for length in lengths:
        if length > longest:
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
