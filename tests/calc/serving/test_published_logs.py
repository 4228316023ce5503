"""calc.serve against published vLLM start-up logs (tests/data/vllm_startup_logs.json, each
with its source): the KV cache size in tokens, and the terms the logs print."""

from __future__ import annotations

import statistics

import pytest

import calc
from calc.serving import kv_cache as kv
from tests.calc.serving.published import compare, model_of, records

GIB = 2**30
IDS = [rec["id"] for rec in records()]


@pytest.mark.parametrize("rec", records(), ids=IDS)
def test_kv_tokens_within_ten_percent(rec: dict) -> None:
    # the bar on real start-up logs: max 10 %, median 3 %
    assert abs(compare(rec).error) <= 0.10


def test_median_error_within_three_percent() -> None:
    errors = [abs(compare(rec).error) for rec in records()]
    assert statistics.median(errors) <= 0.03


@pytest.mark.parametrize("rec", records(), ids=IDS)
def test_weights_match_the_logged_figure(rec: dict) -> None:
    # "Model loading took X GiB" / "model weights take X GiB": printed to 0.01 GiB (or 0.0001 GB)
    got = compare(rec).estimate.weights_bytes / GIB
    assert got == pytest.approx(rec["logged"]["weights_gib"], abs=0.012)


@pytest.mark.parametrize(
    "rec", [r for r in records() if "max_concurrency" in r["logged"]],
    ids=[r["id"] for r in records() if "max_concurrency" in r["logged"]],
)  # fmt: skip
def test_concurrency_rule_reproduces_the_logged_concurrency(rec: dict) -> None:
    # vLLM's own blocks through calc's concurrency rule give vLLM's own concurrency (printed
    # to two decimals): the rule, checked independently of calc's KV prediction
    c = compare(rec)
    logged = rec["logged"]
    serving = calc.Serving(vllm_version=rec["vllm_version"], **rec["serving"])
    block = c.estimate.block_size  # vLLM's default 16: none of these models uses MLA
    assert block == 16
    blocks = logged["kv_cache_tokens"] // block
    got = kv.max_concurrency(
        blocks, model_of(rec), serving, c.estimate.engine, c.estimate.max_model_len,
        c.estimate.max_num_batched_tokens, block,
    )  # fmt: skip
    assert got == pytest.approx(logged["max_concurrency"], abs=0.006)
