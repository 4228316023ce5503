"""`calc.present.serving.startup_failure`: how vLLM fails to start, in the order it checks (the
weights load, then ``_check_enough_kv_cache_memory``), from hand-made estimates."""

from __future__ import annotations

from dataclasses import replace

import pytest

from calc.present.serving import startup_failure
from calc.serving.api import ServeEstimate
from calc.units import GIB

STARTS = ServeEstimate(
    total_bytes=80 * GIB, budget_bytes=72 * GIB, weights_bytes=60 * GIB, non_torch_bytes=GIB,
    activation_peak_bytes=GIB, cuda_graph_bytes=0, kv_cache_bytes=10 * GIB, gpu_blocks=2560,
    kv_cache_tokens=40960, max_concurrency=1.25, engine="v1", max_model_len=32768,
    max_num_seqs=256, max_num_batched_tokens=8192, page_bytes=65536, layers_per_rank=64,
)  # fmt: skip
"""A 32k-token request on 2560 blocks of 16 tokens: 40960 tokens, 1.25 requests."""


def test_a_server_whose_kv_cache_holds_one_request_starts() -> None:
    assert startup_failure(STARTS) is None
    assert startup_failure(replace(STARTS, max_concurrency=1.0)) is None


def test_weights_larger_than_the_gpu_fail_while_loading() -> None:
    est = replace(STARTS, weights_bytes=87 * GIB, kv_cache_bytes=-17 * GIB, max_concurrency=0.0)
    message = startup_failure(est)
    assert message is not None and message.startswith("CUDA out of memory while loading")
    assert "87.00 GiB per GPU on a 80.00 GiB GPU" in message


@pytest.mark.parametrize("kv_gib", [0, -3])
def test_no_kv_budget_is_vllms_no_available_memory_error(kv_gib: int) -> None:
    est = replace(STARTS, kv_cache_bytes=kv_gib * GIB, gpu_blocks=0, max_concurrency=0.0)
    message = startup_failure(est)
    assert message is not None
    assert message.startswith("ValueError: No available memory for the cache blocks")


def test_a_kv_cache_short_of_one_request_names_max_model_len_and_never_rounds_up_to_1x() -> None:
    # 1154 blocks for a request of cdiv(18465, 16) = 1155 blocks: 0.99913..., shown as 0.999x
    est = replace(STARTS, max_model_len=18465, gpu_blocks=1154, max_concurrency=1154 / 1155)
    message = startup_failure(est)
    assert message is not None
    assert "max_model_len=18,465" in message and "0.999x" in message
