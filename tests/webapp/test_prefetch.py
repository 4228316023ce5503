"""The web calculator's background compiling of the structures one choice away
(``webapp/prefetch.py``): which jobs it compiles, that a page queues them, and that a queued
structure is then a compile-cache hit for ``calc.estimate`` (what makes the next rerun fast)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import calc
from calc.estimate import core as _estimate
from calc.plan import planner
from tests.specs import tiny_llama
from webapp import prefetch

APP = str(Path(__file__).resolve().parents[2] / "app.py")

SMALL = tiny_llama(name="prefetch-check", hidden=48, n_layers=3, n_heads=4, head_dim=12,
                   ffn=80, vocab=200, max_positions=256, tied_embeddings=True)  # fmt: skip
"""A model no other test compiles (tied embeddings, odd sizes), so cache hits here are ours."""


def _differences(a: object, b: object) -> list[str]:
    return [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]  # type: ignore[arg-type]


def test_neighbours_differ_in_exactly_one_structural_choice() -> None:
    job = calc.Training(micro_batch=2, seq_len=64)
    others = prefetch.neighbours(job)
    assert len(set(others)) == len(others)
    for other in others:
        (field,) = _differences(job, other)
        assert field in ("precision", "optimizer", "recompute", "attention", "implementation")
    # Every other optimizer is one step away (Training accepts each with the defaults).
    optimizers = {o.optimizer for o in others if _differences(job, o) == ["optimizer"]}
    assert optimizers == set(calc.config.jobs.OPTIMIZERS) - {job.optimizer}


def test_inference_neighbours_use_the_inference_precisions() -> None:
    job = calc.Inference(batch=1, context=32)
    precisions = {o.precision for o in prefetch.neighbours(job) if o.precision != job.precision}
    assert precisions == set(calc.config.jobs.INFERENCE_PRECISIONS) - {job.precision}


def test_off_switch_queues_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMPLAN_PREFETCH", "0")
    spec = SMALL
    assert (
        prefetch.warm(spec, "off-switch", calc.Training(micro_batch=1, seq_len=32), None, "cpu")
        == 0
    )


def test_recordings_are_never_prefetched(monkeypatch: pytest.MonkeyPatch) -> None:
    # A recording of transformers' code takes seconds and holds calc.derive.record.RECORDING
    # (one per process): prefetched, it would keep the page's own estimate waiting. So no
    # neighbour is implementation="derived", and a derived model (phi3) queues nothing.
    monkeypatch.setenv("VRAMPLAN_PREFETCH", "1")
    job = calc.Training(micro_batch=1, seq_len=32)
    assert "derived" in calc.config.jobs.IMPLEMENTATIONS
    assert all(o.implementation != "derived" for o in prefetch.neighbours(job))
    phi3 = calc.ModelSpec.from_hf_config({
        "model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
        "vocab_size": 512, "max_position_embeddings": 512, "pad_token_id": 0,
    })  # fmt: skip
    assert prefetch.warm(phi3, "derived-check", job, None, "cpu") == 0
    assert prefetch.warm_plan(phi3, "derived-plan-check", task="inference", seq_len=32) == 0


def test_a_warmed_neighbour_is_compiled_before_it_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VRAMPLAN_PREFETCH", "1")
    spec = SMALL
    job = calc.Training(micro_batch=1, seq_len=32, implementation="reference")
    neighbour = dataclasses.replace(job, recompute="full")
    queued = prefetch.warm(spec, "warm-check", job, None, "cpu")
    assert queued == len(prefetch.neighbours(job))
    prefetch.wait_idle()
    assert prefetch.warm(spec, "warm-check", job, None, "cpu") == 0  # remembered
    before = _estimate._compile.cache_info()
    calc.estimate(spec, neighbour, device="cpu")
    after = _estimate._compile.cache_info()
    assert after.misses == before.misses  # nothing replayed now: the thread did it


def _calculator_page(monkeypatch: pytest.MonkeyPatch, query: dict[str, str]) -> None:
    """Run the calculator page with prefetching on, then wait for the thread."""
    monkeypatch.setenv("VRAMPLAN_PREFETCH", "1")
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params.update(query)
    at.run()
    assert not at.exception
    prefetch.wait_idle()


def test_the_calculator_page_queues_its_neighbours(monkeypatch: pytest.MonkeyPatch) -> None:
    _calculator_page(monkeypatch, {"card": "qwen2.5-0.5b", "train.precision": "bf16"})
    keys = {k for k in prefetch._queued if k[0] == "card:qwen2.5-0.5b"}
    precisions = {k[1].precision for k in keys}
    assert "amp-bf16" in precisions  # the default, one change away from bf16


def test_a_warmed_plan_is_compiled_before_the_planner_page_asks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Opening the planner page cold compiled its structures then (39 s for a 32B card, issue
    16): the calculator page queues them in the background."""
    monkeypatch.setenv("VRAMPLAN_PREFETCH", "1")
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))
    args = dict(task="full-finetune", seq_len=32, global_batch=2, gpu_count=1, device="cpu")
    assert prefetch.warm_plan(SMALL, "plan-check", **args) == 1
    prefetch.wait_idle()
    assert prefetch.warm_plan(SMALL, "plan-check", **args) == 0  # remembered
    assert planner.precompile(SMALL, **args) == 0  # nothing left to compile


def test_the_calculator_page_queues_the_planners_question(monkeypatch: pytest.MonkeyPatch) -> None:
    _calculator_page(monkeypatch, {"card": "qwen2.5-0.5b", "global_batch": "3"})
    plans = [k[1] for k in list(prefetch._queued) if k[0] == "plan"]
    assert any(
        getattr(r, "model_key", "") == "card:qwen2.5-0.5b" and r.global_batch == 3 for r in plans
    )
