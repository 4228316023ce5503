"""calc.derive.generate: HF ``generate`` recorded from transformers' code, its regime, and the
derived estimate against the hand graph and the CPU tracker."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from calc.derive.book import Trace
from calc.derive.generate import MAX_KEPT, cut, generate_regime, is_cut, sample_plan


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


def test_long_generation_samples_prompt_and_context() -> None:
    # 100 + 200 tokens, window 4096: cut regime. s: lengths s .. s + 2 (HEAD) must stay 2
    # tokens above the one-token prompt (s > 1 + 2 + 2 - 2 = 3) and below the window (s + 2 <=
    # 4096 - 3, s <= 4091); samples 4, 8, 12 (16 held). c: the last forward's lengths c - 2 .. c
    # above 1 and 2 tokens under the window (c <= 4093); samples at least 8 tokens beyond the
    # largest prompt sample 16: 28, 32 (36 held).
    reg = generate_regime(2, 100, 200, [4096])
    assert reg.free == (("b", 1, -1), ("s", 3, 4091), ("c", 1, 4093))
    grid, held = sample_plan(reg)
    assert sorted({(p["s"], p["c"]) for p in grid}) == [
        (s, c) for s in (4, 8, 12) for c in (28, 32)
    ]
    assert (held["b"], held["s"], held["c"]) == (4, 16, 36)


def test_long_generation_across_a_window_fixes_the_prompt_only() -> None:
    # prompt 3, 40 new tokens, window 16: the prompt is near the one-token threshold (fixed);
    # the context 43 lies beyond the window: c sampled above 16 + 2 + 2 = 20 (and above 3 + 8).
    reg = generate_regime(6, 3, 40, [16, 512])
    assert ("s", 3) in reg.fixed and ("c", 20, 509) in reg.free
    grid, held = sample_plan(reg)
    assert {p["c"] for p in grid} == {24, 28} and held["c"] == 32


def _trace(stream: list[tuple[bool, int]], baseline: tuple[int, ...] = (0,)) -> Trace:
    n = 1 + max(sid for _, sid in stream)
    return Trace(
        nbytes=tuple(100 + i for i in range(n)),
        info=tuple(("act", f"t{i}", "base") for i in range(n)),
        baseline=baseline,
        stream=tuple((a, sid, "decode", "base") for a, sid in stream),
    )


def test_cut_keeps_what_lives_on_and_drops_the_middle() -> None:
    # Five forwards starting at events 0, 2, 4, 6, 8; the head is forwards 0 and 1, the tail
    # forward 4. Forward 0 makes 1 (its state) and 2 (lives to the end); forward 1 makes 3 and
    # frees 1; forward 2 (middle) makes 4 and frees 3: the free is kept, 3 was made before;
    # forward 3 (middle) makes 5 and frees 4: 4 lived only in the middle, dropped; 5 outlives
    # the middle, kept; forward 4 makes 6, frees 5 and 6.
    stream = [(True, 1), (True, 2), (True, 3), (False, 1), (True, 4), (False, 3), (True, 5),
              (False, 4), (True, 6), (False, 5), (False, 6)]  # fmt: skip
    got = cut(_trace(stream), [0, 2, 4, 6, 8])
    # kept: 1+ 2+ 3+ 1- | 3- 5+ | 6+ 5- 6-; renumbered in order of first use: 5 -> 4, 6 -> 5
    assert [(a, sid) for a, sid, _, _ in got.stream] == [
        (True, 1), (True, 2), (True, 3), (False, 1), (False, 3), (True, 4), (True, 5),
        (False, 4), (False, 5),
    ]  # fmt: skip
    assert got.nbytes == (100, 101, 102, 103, 105, 106) and got.baseline == (0,)
    # too few forwards to have a middle: unchanged
    assert cut(_trace(stream), [0, 4, 8]) == _trace(stream)


def test_kept_scores_record_a_long_generation_whole_up_to_its_limit() -> None:
    # output_scores keeps one tensor per new token: a cut stream (fixed length, sampled
    # contexts) cannot hold it, so 100 + 40 tokens is recorded whole (n fixed, no "c"), and
    # more than MAX_KEPT new tokens is refused by name
    reg = generate_regime(2, 100, 40, [4096], kept=True)
    assert ("n", 40) in reg.fixed and not is_cut(reg)
    assert all(name != "c" for name, *_ in reg.free)
    assert is_cut(generate_regime(2, 100, 40, [4096]))
    with pytest.raises(NotImplementedError, match="output_scores"):
        generate_regime(2, 100, MAX_KEPT + 1, [4096], kept=True)


def test_regime_refuses_no_new_tokens() -> None:
    with pytest.raises(ValueError, match="new_tokens=0"):
        generate_regime(2, 12, 0, [])


pytest.importorskip("transformers")

from tests.calc.derive.test_replay import TINY_LLAMA, _own_cache  # noqa: E402, F401 (fixture)


@pytest.mark.parametrize(
    ("cache", "prompt", "new_tokens"),
    [("dynamic", 8, 5), ("static", 8, 5), ("dynamic", 2, 40), ("static", 40, 30)],
)
def test_derived_generate_equals_the_hand_graph(cache: str, prompt: int, new_tokens: int) -> None:
    # The hand-written generate replay of llama (calc/models/hf_generate.py, checked against
    # the CPU tracker by the gen-* verify cases) gives the same bytes as the one recorded from
    # transformers' generate; 7 layers, recorded with 5 and generalised. 40 and 30 new tokens:
    # recorded at shorter generations and cut.
    spec = calc.ModelSpec.from_hf_config(TINY_LLAMA, name="tiny-llama")
    job = calc.Inference(
        batch=2, prompt=prompt, new_tokens=new_tokens, precision="fp32", cache=cache
    )
    hand = calc.estimate(spec, job, device="cpu")
    derived = calc.estimate(spec, replace(job, implementation="derived"), device="cpu")
    assert derived.peak_bytes == hand.peak_bytes
    assert derived.phases["decode"] == hand.phases["decode"]


@pytest.mark.parametrize(
    "name", ["dgen-gemma2-cross-fp32", "dgen-phi3-static-bf16", "dgen-llama-padded-fp32"]
)
def test_derived_generate_equals_the_cpu_tracker(name: str) -> None:
    # The expected value is measured here by verify's CPU storage tracker running
    # transformers' generate (verify.run.runner.run_case). The phi3 static case needs each
    # recording to start as a fresh model (generate sizes a static cache for the longest call).
    # The padded llama passes a left-padded batch's attention mask: the recording's mask
    # checks must read "padded", as the eager run's do.
    from verify.cases.single import CASES
    from verify.run.runner import run_case

    case = next(c for c in CASES if c.name == name)
    rec = run_case(case)
    assert rec.measured_peak is not None and rec.predicted_peak == rec.measured_peak


def test_the_stop_checks_are_restored() -> None:
    from transformers.generation import utils

    from calc.derive.generate import stop_after

    mixin = utils.GenerationMixin
    original = utils.StopCheck.__call__
    beams = mixin.__dict__["_beam_search_has_unfinished_sequences"]
    with stop_after(6, 4, []):
        assert utils.StopCheck.__call__ is not original
        assert mixin.__dict__["_beam_search_has_unfinished_sequences"] is not beams
    assert utils.StopCheck.__call__ is original
    assert mixin.__dict__["_beam_search_has_unfinished_sequences"] is beams


def test_beam_search_stops_at_its_last_new_token_and_hands_in_the_crop() -> None:
    # one check per new token (transformers _beam_search's loop): "unfinished" until the
    # new_tokens-th, then the output's crop reads prompt + new_tokens and new_tokens
    import torch
    from transformers.generation import utils

    from calc.derive.generate import stop_after

    flags = (torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.bool))
    answers: list[int] = []
    with stop_after(6, 3, answers):
        check = utils.GenerationMixin._beam_search_has_unfinished_sequences
        said = [check(*flags, torch.zeros(1, 2, dtype=torch.bool), False) for _ in range(3)]
    assert said == [True, True, False]
    assert answers == [9, 3]
