"""calc.derive.generate: HF ``generate`` recorded from transformers' code, its regime, and the
derived estimate against the hand graph and the CPU tracker."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from calc.derive.generate import generate_regime


def test_regime_far_from_every_window_samples_batch_and_prompt() -> None:
    # b=2, prompt 100, 20 new tokens, window 4096: the generation (100 .. 120) is far from it.
    # Limits 4096 - 20 - 2 = 4074 and 4096 + 2 = 4098: s lies in (1, 4074], every sampled
    # prompt plus its 20 tokens stays 2 tokens under the window. n is fixed at 20.
    reg = generate_regime(2, 100, 20, [4096])
    assert reg.free == (("b", 1, -1), ("s", 1, 4074))
    assert reg.fixed == (("n", 20),)


def test_regime_of_a_generation_that_crosses_a_window_fixes_the_prompt() -> None:
    # prompt 12 with 8 new tokens crosses a window of 16 (Gemma-2's verify config): the decode
    # step where the sliding layers stop growing depends on the prompt, so it is fixed.
    reg = generate_regime(2, 12, 8, [16, 512])
    assert ("s", 12) in reg.fixed and ("n", 8) in reg.fixed
    assert [name for name, *_ in reg.free] == ["b"]
    # beyond the window (24 > 16 + 2), one row: b fixed at 1; s sampled in (18, 4089] (4096
    # - 5 - 2: every sampled generation ends 2 tokens before max_position_embeddings)
    beyond = generate_regime(1, 24, 5, [16, 4096])
    assert ("b", 1) in beyond.fixed and ("s", 18, 4089) in beyond.free


def test_regime_refuses_no_new_tokens() -> None:
    with pytest.raises(ValueError, match="new_tokens=0"):
        generate_regime(2, 12, 0, [])


pytest.importorskip("transformers")

TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 7, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
    "max_position_embeddings": 1024,
}  # fmt: skip


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))  # record, never read a stale trace


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_derived_generate_equals_the_hand_graph(cache: str) -> None:
    # The hand-written generate replay of llama (calc/models/hf_generate.py, checked against
    # the CPU tracker by the gen-* verify cases) gives the same bytes as the one recorded from
    # transformers' generate; 7 layers, recorded with 5 and generalised.
    spec = calc.ModelSpec.from_hf_config(TINY_LLAMA, name="tiny-llama")
    job = calc.Inference(batch=2, prompt=8, new_tokens=5, precision="fp32", cache=cache)
    hand = calc.estimate(spec, job, device="cpu")
    derived = calc.estimate(spec, replace(job, implementation="derived"), device="cpu")
    assert derived.peak_bytes == hand.peak_bytes
    assert derived.phases["decode"] == hand.phases["decode"]


@pytest.mark.parametrize("name", ["dgen-gemma2-cross-fp32", "dgen-phi3-static-bf16"])
def test_derived_generate_equals_the_cpu_tracker(name: str) -> None:
    # The expected value is measured here by verify's CPU storage tracker running
    # transformers' generate (verify.run.runner.run_case). The phi3 static case needs each
    # recording to start as a fresh model (generate sizes a static cache for the longest call).
    from verify.cases.single import CASES
    from verify.run.runner import run_case

    case = next(c for c in CASES if c.name == name)
    rec = run_case(case)
    assert rec.measured_peak is not None and rec.predicted_peak == rec.measured_peak


def test_the_stop_check_is_restored() -> None:
    from transformers.generation import utils

    from calc.derive.generate import stop_after

    original = utils.StopCheck.__call__
    with stop_after(10):
        assert utils.StopCheck.__call__ is not original
    assert utils.StopCheck.__call__ is original
