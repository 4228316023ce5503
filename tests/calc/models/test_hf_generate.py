"""The HF ``generate`` replay (`calc.models.hf_generate`): the bounded replay (prefill, first
and last decode step, a jump between) has the peak of the replay of every step, the decode peak
sits in the last step, the symbolic replay is the numeric one, and `calc.estimate` (compiled,
five-layer generalisation) equals the numeric replay of every layer and every step.

The replay against a measurement is verify's ``gen-*`` cases (`verify.cases.generate`: exact to
the byte on the CPU storage tracker).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import pytest
import sympy as sp

import calc
from calc import symbols as S
from calc.models import hf_generate, shape
from calc.step.sizes import values_for
from verify.cases.scale import scaled_spec

CARDS = ("llama-2-7b", "qwen3-32b", "mistral-7b-v0.1", "qwen2.5-0.5b", "gpt2")


def _shape(card: str, batch: int, prompt: int, new_tokens: int, precision: str, layers: int = 2,
           cache: str = "dynamic"):  # fmt: skip
    spec = scaled_spec(card, layers=layers)
    job = calc.Inference(batch=batch, prompt=prompt, new_tokens=new_tokens,
                         precision=precision, cache=cache)  # fmt: skip
    sh, context = shape.numeric_shape(spec, job, "cpu", lambda *a: None)
    return spec, job, sh, context


def _replay(spec, job, sh, context, steps=None, n=None):
    return hf_generate.replay(
        sh, context, job.new_tokens if n is None else n, steps=steps,
        batch_over_one=job.batch > 1, sliding=spec.sliding_window is not None,
        static=job.cache_impl == "static",
    )  # fmt: skip


def _live_bytes(event) -> int:
    return sum(int(size) * count for (_, _, _, size), count in event.live)


def _peak(events, phase: str | None = None) -> int:
    return max(_live_bytes(e) for e in events if phase is None or e.phase == phase)


CONFIGS = [
    (card, batch, prompt, new_tokens, precision, "dynamic")
    for card in CARDS
    for batch, prompt, new_tokens, precision in (
        (1, 1, 2, "fp32"), (3, 5, 3, "bf16"), (2, 17, 4, "fp32"), (5, 3, 20, "bf16"),
    )
] + [
    (card, batch, prompt, new_tokens, precision, "static")
    for card in CARDS
    for batch, prompt, new_tokens, precision in ((1, 2, 3, "fp32"), (4, 3, 20, "bf16"))
]  # fmt: skip
ARGS = ("card", "batch", "prompt", "new_tokens", "precision", "cache")


@pytest.mark.parametrize(ARGS, CONFIGS)
def test_bounded_replay_has_the_peak_of_every_step(card, batch, prompt, new_tokens, precision,
                                                   cache):  # fmt: skip
    spec, job, sh, context = _shape(card, batch, prompt, new_tokens, precision, cache=cache)
    bounded = _replay(spec, job, sh, context)
    every = _replay(spec, job, sh, context, steps=list(range(1, new_tokens)))
    assert _peak(bounded) == _peak(every)
    assert _peak(bounded, "prefill") == _peak(every, "prefill")
    assert _peak(bounded, "decode") == _peak(every, "decode")


def _step_peaks(events) -> list[int]:
    """The peak of each decode step (a step starts at its ``gen.input_clone``)."""
    peaks: list[int] = []
    for e in events:
        if e.phase != "decode":
            continue
        if e.label == "+gen.input_clone":
            peaks.append(0)
        peaks[-1] = max(peaks[-1], _live_bytes(e))
    return peaks


@pytest.mark.parametrize(ARGS, CONFIGS)
def test_the_decode_peak_is_in_the_last_step(card, batch, prompt, new_tokens, precision, cache):
    spec, job, sh, context = _shape(card, batch, prompt, new_tokens, precision, cache=cache)
    every = _replay(spec, job, sh, context, steps=list(range(1, new_tokens)))
    peaks = _step_peaks(every)
    assert len(peaks) == new_tokens - 1
    assert peaks == sorted(peaks)
    assert peaks[-1] == _peak(every, "decode")


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_decode_peak_grows_at_least_one_token_per_step(card, precision):
    # batch 64: every growing tensor is a whole number of 512-byte blocks, so nothing rounds.
    # Step i + 1 holds one more token per sequence than step i: b * k * d * itemsize more in
    # each layer's K and V, and 8 bytes per sequence more in the ids and in the position ids:
    # every moment of a step is at least that much above the same moment of the step before
    # (more, while a layer's old and new cache are both alive), so its peak is too
    spec, job, sh, context = _shape(card, 64, 3, 9, precision)
    peaks = _step_peaks(_replay(spec, job, sh, context, steps=list(range(1, 9))))
    grow = 2 * sh.n_layers * 64 * sh.k * sh.d * sh.weight_itemsize + 2 * 8 * 64
    steps = [b - a for a, b in itertools.pairwise(peaks)]
    assert min(steps) == grow


SYMBOLIC = [
    (card, new_tokens, cache)
    for card in CARDS
    for new_tokens, cache in ((1, "dynamic"), (2, "dynamic"), (3, "dynamic"), (4, "dynamic"),
                              (9, "dynamic"), (2, "static"), (9, "static"))
]  # fmt: skip


@pytest.mark.parametrize(("card", "new_tokens", "cache"), SYMBOLIC)
def test_symbolic_replay_is_the_numeric_one(card, new_tokens, cache):
    spec, job, sh, context = _shape(card, 3, 6, new_tokens, "bf16", cache=cache)
    n = hf_generate.replayed_new_tokens(new_tokens)
    sym = hf_generate.replay(
        replace(sh, b=S.b, s=S.s), S.c, n, batch_over_one=True,
        sliding=spec.sliding_window is not None, static=cache == "static",
    )  # fmt: skip
    num = _replay(spec, job, sh, context)
    values = values_for(spec, job)
    assert [e.label for e in sym] == [e.label for e in num]
    sized: dict = {}
    for es, en in zip(sym, num, strict=True):
        # (kind, name, bytes) with their counts: two symbolic sizes may round to one block
        live_s = Counter()
        for (kind, name, _, size), count in es.live:
            if size not in sized:
                sized[size] = int(sp.sympify(size).subs(values))
            live_s[kind, name, sized[size]] += count
        live_n = Counter()
        for (kind, name, _, size), count in en.live:
            live_n[kind, name, size] += count
        assert live_s == live_n, es.label


@pytest.mark.parametrize(
    ("card", "batch", "prompt", "new_tokens", "cache"),
    [("llama-2-7b", 2, 3, 12, "dynamic"), ("mistral-7b-v0.1", 1, 40, 5, "dynamic"),
     ("gpt2", 3, 4, 7, "dynamic"), ("qwen2.5-0.5b", 4, 2, 9, "static")],
)  # fmt: skip
def test_estimate_is_the_replay_of_every_layer_and_step(card, batch, prompt, new_tokens, cache):
    spec, job, sh, context = _shape(card, batch, prompt, new_tokens, "bf16", layers=9,
                                    cache=cache)  # fmt: skip
    every = _replay(spec, job, sh, context, steps=list(range(1, new_tokens)))
    est = calc.estimate(spec, job, device="cpu")
    assert est.peak_bytes == _peak(every)


def test_the_replay_refuses_no_new_tokens():
    _, _, sh, context = _shape("llama-2-7b", 1, 4, 1, "fp32")
    with pytest.raises(ValueError, match="new_tokens"):
        hf_generate.replay(sh, context, 0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"new_tokens": 4}, "needs prompt"),
        ({"prompt": 5, "new_tokens": 4, "context": 8}, "prompt \\+ new_tokens = 9"),
        ({"prompt": 5, "new_tokens": -1}, "new_tokens=-1 is out of range"),
        ({"prompt": 5, "new_tokens": 2, "cache": "paged"}, "cache='paged'"),
        ({"context": 5, "cache": "dynamic"}, "needs new_tokens >= 1"),
        ({}, "context=0 needs prompt"),
        ({"context": 8, "sampling": calc.Sampling()}, "sampling needs new_tokens >= 1"),
        ({"context": 8, "num_beams": 2}, "num_beams=2 needs new_tokens >= 1"),
        ({"prompt": 5, "new_tokens": 2, "num_beams": 0}, "num_beams=0 is out of range"),
        ({"prompt": 5, "new_tokens": 2, "num_beams": True}, "num_beams=True must be an integer"),
        (
            {"prompt": 5, "new_tokens": 2, "num_return_sequences": 2},
            "num_return_sequences=2 needs sampling or num_beams >= 2",
        ),
        (
            {"prompt": 5, "new_tokens": 2, "num_beams": 2, "num_return_sequences": 3},
            "num_return_sequences=3 must be at most num_beams=2",
        ),
        (
            {"prompt": 5, "new_tokens": 2, "sampling": calc.Sampling(), "num_return_sequences": 0},
            "num_return_sequences=0 is out of range",
        ),
        ({"prompt": 5, "new_tokens": 2, "sampling": {"top_k": 5}}, "calc.Sampling"),
        ({"prompt": 5, "new_tokens": 2, "padding": "right"}, "padding='right' is not one of"),
    ],
)
def test_inference_fields_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        calc.Inference(batch=1, **kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"temperature": 0}, "temperature=0 must be a number > 0"),
        ({"top_k": -1}, "top_k=-1 is out of range"),
        ({"top_p": 0}, "top_p=0 must be a number in \\(0, 1\\]"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"repetition_penalty": True}, "repetition_penalty=True"),
    ],
)
def test_sampling_fields_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        calc.Sampling(**kw)


def test_sampling_is_generate_with_do_sample_and_transformers_defaults():
    # transformers' GenerationConfig._get_default_generation_params: temperature 1, top_k 50,
    # top_p 1, repetition_penalty 1
    assert calc.Sampling().generate_kwargs() == {
        "do_sample": True, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
        "repetition_penalty": 1.0,
    }  # fmt: skip


def test_sampling_is_answered_by_the_derived_replay():
    # the hand graph refuses sampling; the replay recorded from transformers' generate answers
    # (verify: gen-sample-*), naming what the hand graph lacks
    job = calc.Inference(batch=1, prompt=4, new_tokens=2, sampling=calc.Sampling(top_p=0.9))
    notes = calc.estimate(scaled_spec("llama-2-7b"), job, device="cpu").notes
    assert any("hand-written graph does not model" in n and "sampling" in n for n in notes)


@pytest.mark.parametrize("new_tokens", [0, 3])
def test_left_padding_is_answered_by_the_derived_replay(new_tokens: int):
    # the hand graphs write no attention mask; the replay recorded from transformers' code
    # passes the prompts' mask (verify: dgen-*-padded-*), and the note names the hand graph's gap
    job = calc.Inference(batch=2, prompt=6, new_tokens=new_tokens, context=0 if new_tokens
                         else 12, precision="fp32", padding="left")  # fmt: skip
    est = calc.estimate(scaled_spec("llama-2-7b"), job, device="cpu")
    assert any("hand-written graph does not model" in n and "padding" in n for n in est.notes)
    assert any(n.startswith("padding='left'") for n in est.notes)


def test_decoding_kwargs_select_greedy_sampling_or_beams():
    # what verify's run and calc's recording both pass to model.generate
    job = calc.Inference(batch=1, prompt=4, new_tokens=2)
    assert job.decoding_kwargs() == {"do_sample": False}
    assert replace(job, num_beams=3).decoding_kwargs() == {"do_sample": False, "num_beams": 3}
    beam_sampling = replace(job, num_beams=2, sampling=calc.Sampling(top_k=5))
    assert beam_sampling.decoding_kwargs() == {
        "do_sample": True, "temperature": 1.0, "top_k": 5, "top_p": 1.0,
        "repetition_penalty": 1.0, "num_beams": 2,
    }  # fmt: skip
    best_two = replace(job, num_beams=4, num_return_sequences=2).decoding_kwargs()
    assert best_two == {"do_sample": False, "num_beams": 4, "num_return_sequences": 2}


def test_kept_scores_are_passed_to_generate_and_need_new_tokens():
    job = calc.Inference(batch=1, prompt=4, new_tokens=2, output_scores=True)
    assert job.decoding_kwargs() == {
        "do_sample": False, "return_dict_in_generate": True, "output_scores": True,
        "output_logits": False,
    }  # fmt: skip
    with pytest.raises(ValueError, match="output_logits=True needs new_tokens"):
        calc.Inference(batch=1, context=4, output_logits=True)
    with pytest.raises(ValueError, match="output_scores"):
        calc.Inference(batch=1, prompt=4, new_tokens=2, output_scores="yes")  # type: ignore[arg-type]


def test_kept_scores_hold_one_fp32_row_block_per_new_token():
    # hand count: greedy generate with output_scores keeps each step's
    # ``logits[:, -1, :].to(copy=True, dtype=float32)`` ([batch, vocab] fp32: 4 x 4096 x 4 B =
    # 65,536 B) until it returns; the last step's peak (appending its token to the ids) has
    # all 24 alive (verify: gen-scores-llama-fp32-decode, exact)
    spec = scaled_spec("llama-2-7b", vocab=4096)
    job = calc.Inference(batch=4, prompt=2, new_tokens=24, precision="fp32", output_scores=True)
    est = calc.estimate(spec, job, device="cpu")
    assert est.peak_phase == "decode"
    assert est.breakdown["temporaries/_to_copy"] == 24 * 4 * 4096 * 4


def test_beam_search_is_answered_by_the_derived_replay():
    # the hand graph refuses beams; the replay recorded from transformers' _beam_search answers
    # (verify: gen-beam-*, dgen-*-beam-*), naming what the hand graph lacks
    job = calc.Inference(batch=1, prompt=4, new_tokens=2, num_beams=3)
    notes = calc.estimate(scaled_spec("llama-2-7b"), job, device="cpu").notes
    assert any("hand-written graph does not model" in n and "beam search" in n for n in notes)


def test_beams_hold_a_cache_of_batch_times_beams_rows():
    # hand count: transformers' _beam_search expands the prompt to batch x beams rows before
    # the prefill, so at the prefill's peak (the logits of every prompt token: the peak of a
    # short generation) each of the L layers holds K and V of the prompt for every row
    spec = scaled_spec("llama-2-7b")
    batch, beams, prompt = 2, 3, 6
    job = calc.Inference(batch=batch, prompt=prompt, new_tokens=3, num_beams=beams,
                         precision="fp32")  # fmt: skip
    est = calc.estimate(spec, job, device="cpu")
    assert est.peak_phase == "prefill"
    k_bytes = batch * beams * spec.n_kv_heads * spec.head_dim * prompt * 4  # fp32
    k_bytes = -(-k_bytes // 512) * 512  # the CPU tracker's 512-B rounding
    assert est.breakdown["kv_cache"] == spec.n_layers * 2 * k_bytes  # 36,864 B


def test_sampled_sequences_per_prompt_hold_a_cache_of_batch_times_sequences_rows():
    # hand count: with do_sample, generate expands the prompt to batch x num_return_sequences
    # rows before the prefill (_expand_inputs_for_generation), so at the prefill's peak each of
    # the L layers holds K and V of the prompt for every row, 3 times one sequence's
    spec = scaled_spec("llama-2-7b")
    batch, sequences, prompt = 2, 3, 6
    one = calc.Inference(batch=batch, prompt=prompt, new_tokens=3, precision="fp32",
                         sampling=calc.Sampling())  # fmt: skip
    est = calc.estimate(spec, replace(one, num_return_sequences=sequences), device="cpu")
    assert est.peak_phase == "prefill"
    k_bytes = batch * sequences * spec.n_kv_heads * spec.head_dim * prompt * 4  # fp32
    k_bytes = -(-k_bytes // 512) * 512  # the CPU tracker's 512-B rounding
    assert est.breakdown["kv_cache"] == spec.n_layers * 2 * k_bytes  # 36,864 B


def test_context_defaults_to_prompt_plus_new_tokens():
    job = calc.Inference(batch=2, prompt=512, new_tokens=32)
    assert (job.context, job.prompt_len, job.cache_impl) == (544, 512, "dynamic")
    assert calc.Inference(batch=1, context=64).cache_impl == "static"
    assert calc.Inference(batch=1, prompt=8).context == 8


def test_generate_refusals_name_what_is_modelled():
    spec = scaled_spec("gpt2")
    job = calc.Inference(batch=1, prompt=4, new_tokens=2, attention="eager")
    # the hand graph refuses eager generate; the replay derived from transformers' code answers
    # it (verify: dgen-llama-eager-fallback-fp32), and its note names what the hand graph lacks
    notes = calc.estimate(spec, job, device="cpu").notes
    assert any("hand-written graph does not model" in n and "'eager'" in n for n in notes)
    llama = scaled_spec("llama-2-7b")
    job = calc.Inference(batch=1, prompt=4, new_tokens=2, implementation="reference")
    with pytest.raises(NotImplementedError, match="implementation='hf'"):
        calc.estimate(llama, job, device="cpu")


def test_the_planner_refuses_a_padded_base_job_by_name():
    # the planner sweeps the hand graphs' unpadded prompts; a padded batch is a recording per
    # size: refused before anything compiles, naming the field
    from calc.plan import planner

    base = calc.Inference(batch=1, context=64, padding="left")
    with pytest.raises(ValueError, match=r"base\.padding='left'"):
        planner.plan(scaled_spec("llama-2-7b"), task="inference", seq_len=64, global_batch=1,
                     gpu="h100-80gb", base=base)  # fmt: skip
