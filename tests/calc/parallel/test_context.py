"""Context parallelism (`calc.parallel.context`, analytic): a rank runs ``s / cp`` tokens.

Model (llama, fp32): h=64, L=2, a=k=4, d=16, f=128, V=64; job b=1, s=16, cp=2. A cp rank is the
single-GPU step at s=8 (every activation divided by cp, parameters replicated) plus the K/V
chunks of ring attention in flight: 2 chunks x (K, V) x [1, 4, 8, 16] fp32 = 2 x 2 x 2048 B
= 8192 B (each 2048 B, a multiple of 512).
"""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama64

RING_KV = 8192


def _llama() -> calc.ModelSpec:
    return tiny_llama64(name="tiny-cp")


def _job(seq_len: int) -> calc.Training:
    return calc.Training(micro_batch=1, seq_len=seq_len, precision="fp32", optimizer="sgd",
                         implementation="reference")  # fmt: skip


def test_a_cp_rank_is_the_step_at_s_over_cp_plus_the_ring() -> None:
    cp = calc.estimate(_llama(), _job(16), calc.Parallelism(cp=2), device="cpu")
    one = calc.estimate(_llama(), _job(8), device="cpu")
    assert cp.peak_bytes == one.peak_bytes + RING_KV
    assert cp.breakdown["context_parallel/ring_kv"] == RING_KV


def test_sequence_must_split_into_two_cp_chunks() -> None:
    with pytest.raises(ValueError, match="seq_len=10"):
        calc.estimate(_llama(), _job(10), calc.Parallelism(cp=2), device="cpu")
