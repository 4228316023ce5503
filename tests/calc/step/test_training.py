"""The training step's replay: accumulation is played out for a bounded number of micro-batches.

The expected values here are full replays of every micro-batch (``REPLAYED_MICRO_BATCHES``
raised above ``grad_accum`` for the comparison), not numbers from the bounded path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

import calc
from calc.estimate import core
from calc.step import training
from tests.specs import tiny_llama

JOBS = {
    "fp32-adamw-ref": calc.Training(micro_batch=8, seq_len=64, precision="fp32", implementation="reference"),
    "amp-fp16-sgd": calc.Training(micro_batch=8, seq_len=64, precision="amp-fp16", optimizer="sgd"),
    "bf16-master-adamw": calc.Training(micro_batch=8, seq_len=64, precision="bf16-master"),
    "zero-grad-before-backward": calc.Training(micro_batch=8, seq_len=64, zero_grad="before_backward"),
    "recompute-full": calc.Training(micro_batch=8, seq_len=64, precision="bf16", recompute="full"),
    "lora": calc.Training(micro_batch=8, seq_len=64, precision="bf16", lora=calc.LoRA(rank=4)),
    "adam8bit": calc.Training(micro_batch=8, seq_len=64, optimizer="adam8bit"),
}  # fmt: skip
LAYOUTS = {
    "single": None,
    "ddp": calc.Parallelism(dp=2),
    "fsdp2": calc.Parallelism(dp=2, zero=3),
    "tp": calc.Parallelism(tp=2),
}


def _replay_every_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on the replay plays out every micro-batch; compiled replays are forgotten (the
    caches key on the job, not on the bound)."""
    monkeypatch.setattr(training, "REPLAYED_MICRO_BATCHES", 1 << 20)
    core.compiled_for.cache_clear()
    core._compile.cache_clear()


@pytest.fixture(autouse=True)
def _forget_compiled_replays() -> Iterator[None]:
    yield
    core.compiled_for.cache_clear()
    core._compile.cache_clear()


def _summary(est: calc.Estimate) -> tuple:
    return (est.peak_bytes, est.peak_phase, dict(est.phases), dict(est.breakdown), est.rank)


@pytest.mark.parametrize("accum", [3, 6])
@pytest.mark.parametrize("name", sorted(JOBS))
def test_bounded_accumulation_equals_the_full_replay(
    name: str, accum: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama()
    job = replace(JOBS[name], grad_accum=accum)
    bounded = _summary(calc.estimate(model, job, device="cpu"))
    _replay_every_micro_batch(monkeypatch)
    assert _summary(calc.estimate(model, job, device="cpu")) == bounded


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bounded_accumulation_equals_the_full_replay_in_parallel(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, parallel = tiny_llama(), LAYOUTS[layout]
    job = calc.Training(micro_batch=8, seq_len=64, precision="bf16", grad_accum=4,
                        implementation="reference")  # fmt: skip
    bounded = _summary(calc.estimate(model, job, parallel))
    _replay_every_micro_batch(monkeypatch)
    assert _summary(calc.estimate(model, job, parallel)) == bounded


def test_accumulation_is_more_than_one_micro_batch() -> None:
    """Two micro-batches differ from one (the first's gradients are alive through the second's
    forward and backward): the bound could not be 1."""
    model = tiny_llama()
    job = calc.Training(micro_batch=8, seq_len=64, precision="fp32", optimizer="sgd")
    one = calc.estimate(model, job, device="cpu").peak_bytes
    assert calc.estimate(model, replace(job, grad_accum=2), device="cpu").peak_bytes > one


def test_the_largest_accumulation_costs_what_two_cost() -> None:
    """``grad_accum`` up to the field's limit replays two micro-batches: one estimate of 65,536
    takes about the time of one of 2 (the issue: it replayed all of them, 7 s and 2.9 GB at 64)."""
    model = tiny_llama()
    job = calc.Training(micro_batch=8, seq_len=64, grad_accum=2)
    calc.estimate(model, job)  # compile the shared structure
    start = time.perf_counter()
    big = calc.estimate(model, replace(job, grad_accum=1 << 16))
    assert time.perf_counter() - start < 5.0  # generous: a replay of 65,536 would take minutes
    assert big.peak_bytes == calc.estimate(model, job).peak_bytes
