"""A recording reports its runs (`calc.derive.progress`): what a first estimate waits for."""

from __future__ import annotations

import pytest

import calc
from calc.derive import progress
from verify.cases.derived import CONFIGS

TINY_OLMO2 = {**CONFIGS["olmo2"], "vocab_size": 256, "max_position_embeddings": 512}
"""A type no hand-written graph models: every estimate of it is recorded."""


def test_the_callback_hears_what_is_reported_inside_the_block_only() -> None:
    heard: list[calc.Progress] = []
    progress.report(1, 2, "outside")  # no callback: nothing happens
    with calc.reporting(heard.append):
        progress.report(0, 4, "qwen3 prefill")
        with calc.reporting(lambda p: None):  # an inner block takes over, then gives back
            progress.report(1, 4, "qwen3 prefill")
        progress.report(2, 4, "qwen3 prefill")
    progress.report(3, 4, "after")
    assert heard == [calc.Progress(0, 4, "qwen3 prefill"), calc.Progress(2, 4, "qwen3 prefill")]
    assert heard[1].fraction == 0.5
    assert calc.Progress(5, 4, "grew").fraction == 1.0
    assert calc.Progress(0, 0, "nothing planned").fraction == 1.0


def test_a_callback_must_be_callable() -> None:
    with pytest.raises(ValueError, match="callback=3 must be callable"):
        with calc.reporting(3):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize(
    "job",
    [
        calc.Inference(batch=2, context=16),
        calc.Inference(batch=2, prompt=6, new_tokens=3),
        calc.Training(micro_batch=2, seq_len=16),
    ],
)
def test_a_first_estimate_reports_each_run_and_a_second_reports_none(job) -> None:
    pytest.importorskip("transformers")
    spec = calc.ModelSpec.from_hf_config(TINY_OLMO2, name="tiny-olmo2")
    heard: list[calc.Progress] = []
    with calc.reporting(heard.append):
        calc.estimate(spec, job, device="cpu")
    assert heard, "a derived model's first estimate records, and says so"
    assert heard[0].done == 0 and heard[-1].done == heard[-1].total >= 2
    assert [p.done for p in heard] == sorted(p.done for p in heard)  # never backwards
    kind = {"Training": "training step"}.get(type(job).__name__)
    kind = kind or ("generate" if job.new_tokens else "prefill")
    assert {p.what for p in heard} == {f"olmo2 {kind}"}
    heard.clear()
    with calc.reporting(heard.append):
        calc.estimate(spec, job, device="cpu")  # compiled already: nothing recorded
    assert heard == []
