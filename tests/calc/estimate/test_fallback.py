"""Where a hand-written graph refuses a Hugging Face job, the replay derived from transformers'
code answers (`calc.estimate.fallback`): on one GPU and on each rank of a data-parallel layout
(`calc.estimate.ranks`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc

pytest.importorskip("transformers")

TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
    "max_position_embeddings": 1024,
}  # fmt: skip
HELD_LORA = calc.Training(
    micro_batch=2, seq_len=64, precision="fp32", loop="hold-output", lora=calc.LoRA(rank=8)
)
"""A job the hand graph refuses: a loop other than the default together with LoRA."""


@pytest.mark.parametrize(
    "parallel",
    [
        calc.Parallelism(dp=2),
        calc.Parallelism(dp=2, fsdp=True),
        calc.Parallelism(dp=2, fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32"),
    ],
)
def test_a_rank_the_hand_graph_refuses_is_answered_by_the_derived_replay(
    parallel: calc.Parallelism,
) -> None:
    spec = calc.ModelSpec.from_hf_config(TINY_LLAMA, name="tiny-llama")
    with pytest.raises(NotImplementedError, match=r"LoRA|compression"):  # the hand graph alone
        calc.estimate(spec, replace(HELD_LORA, implementation="reference"), parallel, "cpu")
    est = calc.estimate(spec, HELD_LORA, parallel, device="cpu")
    assert any("the hand-written graph does not model this" in n for n in est.notes)
    derived = calc.estimate(spec, replace(HELD_LORA, implementation="derived"), parallel, "cpu")
    assert (est.peak_bytes, est.rank_peaks) == (derived.peak_bytes, derived.rank_peaks)


def test_a_layout_the_recording_lacks_keeps_the_hand_graphs_refusal() -> None:
    # ZeRO-2 is not recorded from transformers' code: the hand graph's own message about
    # eager attention under autocast stands.
    spec = calc.ModelSpec.from_hf_config(TINY_LLAMA, name="tiny-llama")
    job = calc.Training(micro_batch=2, seq_len=32, precision="amp-bf16", attention="eager")
    with pytest.raises(NotImplementedError, match="eager attention under autocast"):
        calc.estimate(spec, job, calc.Parallelism(dp=2, zero=2), device="cpu")


def test_zero1_by_parameter_is_answered_by_the_recording_of_its_ranks() -> None:
    # ZeroRedundancyOptimizer (zero=1 by-parameter) with the held output and LoRA: the hand
    # graph refuses the loop, each rank's recording (its local optimizer) answers
    spec = calc.ModelSpec.from_hf_config(TINY_LLAMA, name="tiny-llama")
    par = calc.Parallelism(dp=2, zero=1, zero_partition="by-parameter")
    est = calc.estimate(spec, HELD_LORA, par, device="cpu")
    assert any("the hand-written graph does not model this" in n for n in est.notes)
    derived = calc.estimate(spec, replace(HELD_LORA, implementation="derived"), par, "cpu")
    assert (est.peak_bytes, est.rank_peaks) == (derived.peak_bytes, derived.rank_peaks)


def _llama(hidden: int, ffn: int) -> calc.ModelSpec:
    return calc.ModelSpec.from_hf_config({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": False,
    }, name=f"llama-{hidden}")  # fmt: skip


def test_two_sizes_of_one_family_do_not_share_a_derived_replay() -> None:
    # A hand-modelled type answered by the derived replay (sampling here) is recorded from the
    # config its spec writes; a second size of the same family, estimated next in the same
    # process, must get its own weights. Expected: the larger llama's parameters written out
    # by hand, fp32: embedding and head V x h each, per layer q and o h x a d, k and v
    # h x k d, gate/up/down 3 x h x f, two norms h; the final norm h.
    job = calc.Inference(batch=2, prompt=8, new_tokens=2, precision="fp32",
                         sampling=calc.Sampling(top_k=5))  # fmt: skip
    calc.estimate(_llama(128, 256), job, device="cpu")
    h, f, d, v = 256, 512, 64, 512
    per_layer = 2 * h * 4 * d + 2 * h * 2 * d + 3 * h * f + 2 * h
    params = 2 * v * h + 2 * per_layer + h
    est = calc.estimate(_llama(h, f), job, device="cpu")
    assert est.breakdown["weights"] == params * 4  # every tensor a multiple of 512 B


def test_hf_tensor_parallel_on_a_hand_type_is_transformers_tp_plan_recorded() -> None:
    # The hand graph's tensor parallelism is Megatron-style (implementation="reference");
    # implementation="hf" is transformers' own tp_plan, recorded as for implementation="derived"
    # (verify: dist-derived-llama-hf-tp-amp-2, gloo, exact), and the note says why
    spec = _llama(128, 256)
    job = calc.Training(micro_batch=2, seq_len=32, precision="fp32", optimizer_impl="for-loop")
    par = calc.Parallelism(tp=2)
    hf = calc.estimate(spec, job, parallel=par, device="cpu")
    derived = calc.estimate(spec, replace(job, implementation="derived"), parallel=par,
                            device="cpu")  # fmt: skip
    assert hf.peak_bytes == derived.peak_bytes
    assert any("Megatron-style" in n for n in hf.notes)


def test_without_transformers_the_refusal_says_what_to_install(monkeypatch) -> None:
    # a core-only install (no torch or transformers): the hand graph's refusal of sampling
    # stands, and the message names the packages whose recording would answer it
    from calc.estimate import fallback

    monkeypatch.setattr(fallback, "missing_recorder", lambda: ("transformers",))
    spec = calc.ModelSpec.from_hf_config(TINY_LLAMA, name="tiny-llama")
    job = calc.Inference(batch=1, prompt=4, new_tokens=2, sampling=calc.Sampling())
    with pytest.raises(NotImplementedError, match=r"sampling.*install transformers"):
        calc.estimate(spec, job, device="cpu")
    with pytest.raises(NotImplementedError, match="implementation='hf'") as refused:
        calc.estimate(spec, replace(job, implementation="reference"), device="cpu")
    assert "install" not in str(refused.value)  # the reference graph has no recording


def test_a_derived_model_without_transformers_is_one_message_naming_the_install(
    monkeypatch,
) -> None:
    # the web app's install has no torch: a derived card's estimate and parameter count say
    # what to install (calc.RecorderMissing, a NotImplementedError), never an ImportError;
    # a hand-modelled job needs neither
    from calc.derive import replay

    monkeypatch.setattr(replay, "missing_recorder", lambda: ("torch", "transformers"))
    phi4 = calc.load_card("phi-4")
    job = calc.Inference(batch=1, context=128)
    words = (
        r"model_type='phi3'.*install torch and transformers \(pip install 'vramplan\[verify\]'\)"
    )
    with pytest.raises(calc.RecorderMissing, match=words):
        calc.estimate(phi4, job)
    with pytest.raises(calc.RecorderMissing, match=words):
        calc.param_count(phi4)
    qwen = calc.load_card("qwen2.5-0.5b")
    with pytest.raises(calc.RecorderMissing, match="model_type='qwen2'"):
        calc.estimate(qwen, replace(job, implementation="derived"))
    assert calc.estimate(qwen, job).peak_bytes > 0
