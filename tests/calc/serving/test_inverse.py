"""The inverse serving questions (`calc.serving.inverse`): each answer fits and the next step
past it does not, checked with `calc.serve` itself at the boundary."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from calc.serving import inverse as inv
from tests.specs import tiny_llama, tiny_llama64

TOTAL = 1 << 30  # 1 GiB: room for the non-torch estimate and many tiny KV blocks


def test_largest_max_model_len_is_the_boundary() -> None:
    model = tiny_llama(max_positions=1 << 24)
    serving = calc.Serving(max_num_seqs=4, max_num_batched_tokens=256)
    best = inv.largest_max_model_len(model, serving, 2, total_bytes=TOTAL)
    assert 0 < best < model.max_positions
    at = calc.serve(model, replace(serving, max_model_len=best), total_bytes=TOTAL)
    past = calc.serve(model, replace(serving, max_model_len=best + 1), total_bytes=TOTAL)
    assert at.max_concurrency >= 2 > past.max_concurrency


def test_utilization_for_is_the_least_that_fits() -> None:
    model = tiny_llama()
    serving = calc.Serving(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=256)
    util = inv.utilization_for(model, serving, 100, total_bytes=TOTAL)
    assert util is not None
    fits = calc.serve(model, replace(serving, gpu_memory_utilization=util), total_bytes=TOTAL)
    below = replace(serving, gpu_memory_utilization=round(util - 0.001, 3))
    assert fits.max_concurrency >= 100 > calc.serve(model, below, total_bytes=TOTAL).max_concurrency
    assert inv.utilization_for(model, serving, 10**9, total_bytes=TOTAL) is None


def test_fewest_tensor_parallel() -> None:
    model = tiny_llama64()
    serving = calc.Serving(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=256)
    one = calc.serve(model, serving, total_bytes=TOTAL).max_concurrency
    target = one * 1.5  # more than one GPU holds
    tp = inv.fewest_tensor_parallel(model, serving, target, total_bytes=TOTAL)
    assert tp is not None and tp > 1
    est = calc.serve(model, replace(serving, tensor_parallel=tp), total_bytes=TOTAL)
    assert est.max_concurrency >= target
    with pytest.raises(ValueError, match="concurrency=0"):
        inv.utilization_for(model, serving, 0, total_bytes=TOTAL)
