"""calc.serve against published vLLM start-up logs (tests/data/vllm_startup_logs.json, each
with its source): the KV cache size in tokens, and the terms the logs print."""

from __future__ import annotations

import statistics

import pytest

from tests.calc.serving.published import compare, records

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
