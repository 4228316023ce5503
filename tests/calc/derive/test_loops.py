"""The loops, losses and optimizer variants of a training job on the derived replay
(`calc.derive.loops`): against the hand-written graphs and the CPU tracker."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc

pytest.importorskip("transformers")

TINY_QWEN2 = {
    "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 4096,
    "max_position_embeddings": 1024, "tie_word_embeddings": True,
}  # fmt: skip


@pytest.mark.parametrize(
    "variant",
    [
        {"loop": "hold-output"},
        {"loop": "del-logits", "precision": "amp-bf16"},
        {"loss": "sum", "loop": "hold-output"},
        {"loss": "chunked-ce", "loss_chunks": 4, "precision": "bf16"},
        {"loss": "chunked-ce", "loop": "hold-output"},
        {"optimizer": None, "loop": "hold-output"},
        {"optimizer_in_backward": True, "optimizer": "sgd-momentum"},
    ],
)
def test_each_variant_derived_equals_the_hand_graph(variant: dict) -> None:
    # The hand-written graph of qwen2 (calc/models/hf.py with calc/models/head.py) replays
    # each variant and is itself checked against the CPU tracker (verify's loop-*, loss-*,
    # opt-in-bwd-* cases); the replay recorded from transformers' code gives the same bytes.
    spec = calc.ModelSpec.from_hf_config(TINY_QWEN2, name="tiny-qwen2")
    job = calc.Training(**{"micro_batch": 2, "seq_len": 64, "precision": "fp32", **variant})
    hand = calc.estimate(spec, job, device="cpu")
    derived = calc.estimate(spec, replace(job, implementation="derived"), device="cpu")
    assert derived.peak_bytes == hand.peak_bytes
    assert derived.peak_phase == hand.peak_phase


@pytest.mark.parametrize("variant", [{}, {"grad_accum": 2}, {"loop": "hold-output"}])
def test_fp16_autocast_with_its_grad_scaler_derived_equals_the_hand_graph(variant: dict) -> None:
    # amp-fp16 steps through torch's GradScaler, whose step reads found_inf (.item()), a value
    # fake tensors lack; the recording takes the step. The hand graph's GradScaler terms are
    # checked against the CPU tracker by verify's prec-amp-fp16-* cases.
    spec = calc.ModelSpec.from_hf_config(TINY_QWEN2, name="tiny-qwen2")
    job = calc.Training(micro_batch=2, seq_len=64, precision="amp-fp16", **variant)
    hand = calc.estimate(spec, job, device="cpu")
    derived = calc.estimate(spec, replace(job, implementation="derived"), device="cpu")
    assert (derived.peak_bytes, derived.peak_phase) == (hand.peak_bytes, hand.peak_phase)


@pytest.mark.parametrize(
    "variant", [{}, {"optimizer": "sgd-momentum"}, {"optimizer_impl": "for-loop"}]
)
def test_bf16_master_weights_derived_equal_the_hand_graph_in_every_phase(variant: dict) -> None:
    # bf16 weights and gradients, fp32 masters made at the first step, the fp32 optimizer over
    # them (calc.derive.loops.Masters, verify's MasterWeights); the hand graph's bf16-master
    # step is checked against the CPU tracker by verify's prec-bf16-master-* cases.
    spec = calc.ModelSpec.from_hf_config(TINY_QWEN2, name="tiny-qwen2")
    job = calc.Training(micro_batch=2, seq_len=64, precision="bf16-master", **variant)
    hand = calc.estimate(spec, job, device="cpu")
    derived = calc.estimate(spec, replace(job, implementation="derived"), device="cpu")
    assert dict(derived.phases) == dict(hand.phases)


@pytest.mark.parametrize("variant", [{}, {"optimizer_impl": "for-loop", "weight_decay": 0.1}])
def test_adafactor_derived_equals_the_hand_graph_in_every_phase(variant: dict) -> None:
    # torch.optim.Adafactor reads its step count and norms as Python numbers (values the fake
    # tensors lack; they size nothing); its factored states and temporaries are recorded. The
    # hand graph's Adafactor is checked against the CPU tracker by verify's opt-adafactor-*.
    spec = calc.ModelSpec.from_hf_config(TINY_QWEN2, name="tiny-qwen2")
    job = calc.Training(micro_batch=2, seq_len=64, precision="fp32", optimizer="adafactor",
                        **variant)  # fmt: skip
    hand = calc.estimate(spec, job, device="cpu")
    derived = calc.estimate(spec, replace(job, implementation="derived"), device="cpu")
    assert dict(derived.phases) == dict(hand.phases)


def test_a_value_read_outside_the_optimizer_step_is_still_refused_by_name() -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from calc.derive.book import DeriveError, _scalar_read

    with FakeTensorMode():
        t = torch.empty(3)
    assert _scalar_read(t, "step1/optimizer") == 1.0
    with pytest.raises(DeriveError, match=r"reads a value of a torch\.float32 tensor"):
        _scalar_read(t, "step1/forward")


def test_bf16_master_holds_fp32_masters_beside_the_bf16_weights() -> None:
    # Hand count of tiny Phi-3 (tied embedding 4096 x 64; per layer qkv_proj 64 x 128,
    # o_proj 64 x 64, gate_up_proj 64 x 256, down_proj 128 x 64, two norms of 64; final norm):
    # 262,144 + 2 x 36,992 + 64 = 336,192 parameters. Plain SGD keeps no state, so from the
    # first step on bf16-master holds the fp32 masters (4 B each, one 512-B-rounded tensor per
    # parameter) beside what bf16 holds: the second forward weighs at least that much more.
    params = 4096 * 64 + 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64 + 2 * 64) + 64
    assert params == 336_192
    phi3 = {**TINY_QWEN2, "model_type": "phi3", "pad_token_id": 0}
    spec = calc.ModelSpec.from_hf_config(phi3, name="tiny-phi3")
    job = calc.Training(micro_batch=2, seq_len=64, precision="bf16", optimizer="sgd")
    bf16 = calc.estimate(spec, job, device="cpu").phases["step2/forward"]
    master = calc.estimate(spec, replace(job, precision="bf16-master"), device="cpu")
    assert master.phases["step2/forward"] - bf16 >= 4 * params


def test_on_cuda_the_derived_replay_lacks_only_the_flash_kernels_rng_tensors() -> None:
    # A stated gap: CUDA's flash kernel returns rng_state (uint64[2]) and an unused uint64[]
    # that its backward saves (aten/src/ATen/native/transformers/cuda/attention.cu), each one
    # 512-B block, which the hand graph replays (calc.replay.ops.attention); the CPU kernel the
    # recording runs has neither. 2 layers x 2 x 512 B, and nothing else differs.
    spec = calc.ModelSpec.from_hf_config(TINY_QWEN2, name="tiny-qwen2")
    job = calc.Training(micro_batch=2, seq_len=64, precision="amp-fp16")
    hand = calc.estimate(spec, job, device="cuda")
    derived = calc.estimate(spec, replace(job, implementation="derived"), device="cuda")
    assert hand.peak_bytes - derived.peak_bytes == 2 * 2 * 512


def test_eager_attention_under_autocast_is_answered_by_the_derived_replay() -> None:
    # The hand graph refuses eager attention under autocast; calc.estimate answers with the
    # replay recorded from transformers' code and says so. Eager attention holds the
    # [b, heads, s, s] scores the SDPA kernel never makes: with 4 heads at 2 x 64 tokens the
    # backward holds more than the sdpa job's (2 x 4 x 64 x 64 x 2 B = 64 KiB per score tensor).
    spec = calc.ModelSpec.from_hf_config(TINY_QWEN2, name="tiny-qwen2")
    job = calc.Training(micro_batch=2, seq_len=64, precision="amp-fp16", attention="eager")
    est = calc.estimate(spec, job, device="cpu")
    assert any("derived from transformers' code" in note for note in est.notes)
    sdpa = calc.estimate(spec, replace(job, attention="sdpa"), device="cpu")
    assert est.phases["step2/backward"] > sdpa.phases["step2/backward"]


def test_the_variant_is_part_of_the_recording() -> None:
    # Holding the output keeps the logits (2 x 64 tokens x 4096 vocab x 4 B = 2 MiB) alive
    # into the backward; the default loop drops them: the held recording must weigh more.
    phi3 = {**TINY_QWEN2, "model_type": "phi3", "pad_token_id": 0}
    spec = calc.ModelSpec.from_hf_config(phi3, name="tiny-phi3")
    job = calc.Training(micro_batch=2, seq_len=64, precision="fp32")
    dropped = calc.estimate(spec, job, device="cpu").peak_bytes
    held = calc.estimate(spec, replace(job, loop="hold-output"), device="cpu").peak_bytes
    assert held - dropped >= 2 * 64 * 4096 * 4


@pytest.mark.parametrize(
    "name", ["dtrain-gemma2-hold-fp32", "dtrain-phi3-opt-in-bwd-fp32", "dtrain-phi3-lora-r8-fp32"]
)
def test_derived_variant_equals_the_cpu_tracker(name: str) -> None:
    # The expected value is measured here by verify's CPU storage tracker running
    # transformers' model through verify.models.loops / build_optimizer.
    from verify.cases.single import CASES
    from verify.run.runner import run_case

    case = next(c for c in CASES if c.name == name)
    rec = run_case(case)
    assert rec.measured_peak is not None and rec.predicted_peak == rec.measured_peak


def test_uneven_loss_chunks_are_refused_by_name() -> None:
    # 3 chunks split 3 x 64 tokens evenly, but not the recording's 2 x 64 sample: refused
    # before recording, naming the field.
    spec = calc.ModelSpec.from_hf_config({**TINY_QWEN2, "model_type": "phi3", "pad_token_id": 0})
    job = calc.Training(micro_batch=3, seq_len=64, loss="chunked-ce", loss_chunks=3)
    with pytest.raises(NotImplementedError, match="loss_chunks=3"):
        calc.estimate(spec, job, device="cpu")


@pytest.mark.parametrize(
    "lora",
    [
        calc.LoRA(rank=8),
        calc.LoRA(rank=4, modules=("q", "v"), adapter_dtype="fp32"),
    ],
)
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "bf16"])
def test_lora_derived_equals_the_hand_graph(lora: calc.LoRA, precision: str) -> None:
    # calc/compress/lora.py replays verify's adapters on the hand graph (checked against the
    # CPU tracker by verify's lora-* and hf-lora-* cases); the recording applies the same
    # adapters to transformers' model and must give the same bytes.
    spec = calc.ModelSpec.from_hf_config(TINY_QWEN2, name="tiny-qwen2")
    job = calc.Training(micro_batch=2, seq_len=64, precision=precision, lora=lora)
    hand = calc.estimate(spec, job, device="cpu").peak_bytes
    derived = calc.estimate(spec, replace(job, implementation="derived"), device="cpu")
    assert derived.peak_bytes == hand


@pytest.mark.parametrize(
    ("config", "modules", "says"),
    [
        # Phi-3 computes q, k and v in one qkv_proj: an adapter takes all three or none
        ({"model_type": "phi3", "pad_token_id": 0}, ("q", "v"), "qkv_proj"),
        # Mixtral's MLP is its experts: no gate_proj/up_proj/down_proj linear to adapt, and
        # nothing else chosen; the message offers the attention projections it has
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
         ("gate", "up", "down"), "try LoRA(modules=('q', 'k', 'v', 'o'))"),
        # latent attention computes k and v in the same two linears
        ({"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "q_lora_rank": 32,
          "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
         ("q", "k"), "kv_a_proj_with_mqa"),
    ],
)  # fmt: skip
def test_lora_on_linears_a_model_lacks_is_refused_by_name(
    config: dict, modules: tuple, says: str
) -> None:
    spec = calc.ModelSpec.from_hf_config({**TINY_QWEN2, **config})
    job = calc.Training(micro_batch=2, seq_len=64, lora=calc.LoRA(rank=8, modules=modules))
    with pytest.raises(NotImplementedError) as info:
        calc.estimate(spec, job, device="cpu")
    assert says in str(info.value) and "\n" not in str(info.value)


def test_lora_on_gpt2_recorded_names_its_conv1d_projections() -> None:
    # GPT-2's c_attn/c_proj/c_fc are transformers' Conv1D: no llama-family nn.Linear to
    # adapt, and no LoRA(modules=...) to offer
    spec = calc.ModelSpec.from_hf_config({
        "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512,
        "n_positions": 256,
    })  # fmt: skip
    job = calc.Training(micro_batch=1, seq_len=32, implementation="derived",
                        lora=calc.LoRA(rank=4))  # fmt: skip
    with pytest.raises(NotImplementedError, match="Conv1D") as info:
        calc.estimate(spec, job, device="cpu")
    assert "try LoRA" not in str(info.value)
