"""Sizes up to the fields' limits: the estimate is exact or refuses, and never shrinks as the job
grows (issue 16: int64 wraparound gave negative peaks and peaks that fell as tokens grew).

The peak at twice the sizes can only be larger (every tensor of a job is at least as big in a
bigger one), so monotonicity is checked without any expected number from the code under test;
a refusal must be a ``ValueError`` naming the sizes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import calc

CARDS = ("gpt2", "llama-2-13b", "mistral-7b-v0.1")
EXTREME = settings(max_examples=40, deadline=None)


def _peak(model: calc.ModelSpec, job: calc.Training | calc.Inference, **kw: object) -> int | None:
    """The peak, or None when the estimate refuses the sizes with the range message."""
    try:
        peak = calc.estimate(model, job, **kw).peak_bytes  # type: ignore[arg-type]
    except ValueError as exc:
        assert "2**53 bytes" in str(exc), exc
        return None
    assert isinstance(peak, int) and peak > 0
    return peak


def _not_less(small: int | None, big: int | None) -> None:
    if small is None:  # refused: the bigger job must be refused too
        assert big is None
    elif big is not None:
        assert big >= small


def _pow2(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi).map(lambda e: 1 << e)


@pytest.mark.parametrize(
    "card, job, parallel",
    [
        ("llama-2-13b", calc.Inference(batch=1 << 20, context=1 << 24, implementation="reference"), None),
        ("mistral-7b-v0.1", calc.Training(micro_batch=262145, seq_len=1 << 24, implementation="reference"),
         calc.Parallelism(dp=14)),
        ("llama-3.1-8b", calc.Training(micro_batch=1 << 20, seq_len=1 << 24), None),
    ],
)  # fmt: skip
def test_jobs_that_wrapped_around_are_refused_naming_the_sizes(card, job, parallel) -> None:
    with pytest.raises(ValueError, match=r"(batch|micro_batch)=1,048,576|262,145") as info:
        calc.estimate(calc.load_card(card), job, parallel)
    assert "8 PiB" in str(info.value)


@EXTREME
@given(card=st.sampled_from(CARDS), b=_pow2(0, 20), s=_pow2(0, 24), grow=st.sampled_from("bs"))
def test_inference_peak_never_decreases_up_to_the_limits(
    card: str, b: int, s: int, grow: str
) -> None:
    model = calc.load_card(card)
    job = calc.Inference(batch=b, context=s, implementation="reference")
    bigger = (
        replace(job, batch=min(2 * b, 1 << 20))
        if grow == "b"
        else replace(job, context=min(2 * s, 1 << 24))
    )
    _not_less(_peak(model, job), _peak(model, bigger))


@EXTREME
@given(
    card=st.sampled_from(CARDS), b=_pow2(0, 20), s=_pow2(0, 24), accum=st.integers(1, 1 << 16),
    grow=st.sampled_from(("micro_batch", "seq_len", "grad_accum")),
)  # fmt: skip
def test_training_peak_never_decreases_up_to_the_limits(
    card: str, b: int, s: int, accum: int, grow: str
) -> None:
    model = calc.load_card(card)
    job = calc.Training(micro_batch=b, seq_len=s, grad_accum=accum, implementation="reference")
    limit = {"micro_batch": 1 << 20, "seq_len": 1 << 24, "grad_accum": 1 << 16}[grow]
    bigger = replace(job, **{grow: min(2 * getattr(job, grow), limit)})
    _not_less(_peak(model, job), _peak(model, bigger))


@EXTREME
@given(layers=st.integers(1, 200), s=_pow2(0, 24))
def test_peak_never_decreases_with_layers(layers: int, s: int) -> None:
    base = calc.load_card("llama-2-13b")
    job = calc.Training(micro_batch=1, seq_len=s, implementation="reference")
    small = base.with_overrides(n_layers=layers)
    big = base.with_overrides(n_layers=layers + 1)
    _not_less(_peak(small, job), _peak(big, job))


def test_the_planners_evaluate_refuses_like_the_estimate() -> None:
    """It raised the grid's OverflowError (found by tests/fuzz)."""
    from calc.plan import planner

    job = calc.Training(micro_batch=1 << 20, seq_len=1 << 24)
    with pytest.raises(
        ValueError, match=r"micro_batch=1,048,576, seq_len=16,777,216 with llama-3.1-8b: .*8 PiB"
    ):
        planner.evaluate(calc.load_card("llama-3.1-8b"), job, gpu="h100-80gb")
