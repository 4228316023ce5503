"""calc.derive end to end: derived estimates against the CPU tracker and the hand graphs, and
the one message for a model that cannot be derived."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

import calc
from tests.specs import TINY_PHI3_CONFIG

pytest.importorskip("transformers")

TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 7, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
    "max_position_embeddings": 1024,
}  # fmt: skip


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))  # record, never read a stale trace


@pytest.mark.parametrize(
    "name",
    [
        "derived-olmo2-fp32",
        "derived-gemma2-infer-bf16",
        "derived-mixtral-fp32",  # seeded routing, uneven
        "derived-mixtral-worst-routing-fp32",  # two experts get every token
    ],
)
def test_derived_estimate_equals_the_cpu_tracker(name: str) -> None:
    # The expected value is measured here by verify's CPU storage tracker running
    # transformers' model (verify.run.runner.run_case); calc predicts it from the derived replay.
    from verify.cases.single import CASES
    from verify.run.runner import run_case

    case = next(c for c in CASES if c.name == name)
    rec = run_case(case)
    assert rec.measured_peak is not None and rec.predicted_peak == rec.measured_peak


def test_five_layers_generalise_like_the_hand_graph() -> None:
    # 7 layers, recorded with 5 and generalised (calc.replay.timeline): the hand-written graph
    # of llama (calc/models/hf.py, itself checked against the CPU tracker) gives the same bytes
    # for training and for a prefill.
    spec = calc.ModelSpec.from_hf_config(TINY_LLAMA, name="tiny-llama")
    train = calc.Training(micro_batch=2, seq_len=64, precision="fp32", optimizer="adamw")
    infer = calc.Inference(batch=2, context=320, prompt=96, precision="bf16")
    for job in (train, infer):
        hand = calc.estimate(spec, job, device="cpu").peak_bytes
        derived = calc.estimate(spec, replace(job, implementation="derived"), device="cpu")
        assert derived.peak_bytes == hand
        assert any("derived" in note for note in derived.notes)


@pytest.mark.parametrize(
    ("model_type", "extra", "says"),
    [
        ("nosuchmodel", {}, "model_type='nosuchmodel'"),
        (
            "mixtral",
            {"num_local_experts": 4, "num_experts_per_tok": 2, "experts_implementation": "eager"},
            "experts_implementation='eager'",
        ),
    ],
)
def test_a_model_that_cannot_be_derived_gets_one_message(
    model_type: str, extra: dict, says: str
) -> None:
    spec = calc.ModelSpec.from_hf_config({**TINY_LLAMA, "model_type": model_type, **extra})
    with pytest.raises(NotImplementedError) as info:
        calc.estimate(spec, calc.Training(micro_batch=2, seq_len=64), device="cpu")
    message = str(info.value)
    assert says in message and "\n" not in message and len(message) < 500


def test_calc_imports_without_torch() -> None:
    code = (
        "import sys, calc; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


TINY_PHI3 = TINY_PHI3_CONFIG


def test_param_count_of_a_derived_model_by_hand() -> None:
    # transformers/models/phi3/modeling_phi3.py, untied head (Phi3Config's default):
    # embed 512*64 = 32768; per layer: qkv_proj (4*16 + 2*4*16)*64 = 12288, o_proj 64*64 =
    # 4096, gate_up_proj 2*128*64 = 16384, down_proj 64*128 = 8192, two norms 2*64 = 128:
    # 41088, times 2 layers = 82176; final norm 64; lm_head 512*64 = 32768. Total 147776.
    spec = calc.ModelSpec.from_hf_config(TINY_PHI3)
    assert spec.derived and calc.param_count(spec) == 147776


@pytest.mark.parametrize(
    ("extra", "differ"),
    [
        (
            {"model_type": "gemma2", "sliding_window": 16},
            True,
        ),  # alternating, built by Gemma2Config
        ({"model_type": "qwen3_moe", "mlp_only_layers": [0]}, True),  # a dense layer first
        ({}, False),  # phi3: every layer alike
    ],
)
def test_layers_that_differ_are_found(extra: dict, differ: bool) -> None:
    from calc.derive.replay import heterogeneous

    assert heterogeneous({**TINY_PHI3, **extra}) is differ


@pytest.mark.parametrize(
    ("shape_a", "shape_b", "offsets"),
    [
        ((6, 8), (3, 8, 12), [2, 2, 6]),  # the experts' forward: rows x every expert's weight
        ((8, 12), (12, 4), [4, 4, 12]),  # the weights' gradient: one [8, 4] per expert
    ],
)
def test_grouped_mm_fake_output_is_the_cpu_kernels(shape_a, shape_b, offsets) -> None:
    # The expected output is the real CPU kernel's (torch._grouped_mm in fp32, which torch's
    # meta rule refuses): same shape, strides and dtype from the recorder's rule on fake tensors.
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from calc.derive.book import grouped_mm_fake

    a, b = torch.randn(shape_a), torch.randn(shape_b)
    offs = torch.tensor(offsets, dtype=torch.int32)
    real = torch._grouped_mm(a, b, offs=offs)
    with FakeTensorMode() as mode:
        args = tuple(mode.from_tensor(t) for t in (a, b, offs))
        fake = grouped_mm_fake(args[:2], {"offs": args[2]})
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


@pytest.mark.parametrize(
    ("card", "published"),
    [
        # model_cards/*/published.json: Keras-Hub presets and the safetensors index totals
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen3-30b-a3b", 30_532_122_624),
    ],
)
def test_moe_param_count_is_the_published_one(card: str, published: int) -> None:
    from calc.data.cards import load_card

    assert calc.param_count(load_card(card)) == published


def test_a_moe_estimate_says_both_routing_bounds_are_equal() -> None:
    from verify.cases.derived import CONFIGS

    spec = calc.ModelSpec.from_hf_config(CONFIGS["qwen3_moe"], name="tiny-qwen3-moe")
    job = calc.Inference(batch=2, context=128, prompt=64, precision="bf16")
    notes = calc.estimate(spec, job, device="cpu").notes
    assert any("worst-case routing give these same bytes" in n for n in notes)
    dense = calc.estimate(calc.ModelSpec.from_hf_config(TINY_PHI3), job, device="cpu").notes
    assert not any("routing" in n for n in dense)


def test_building_the_model_leaves_the_users_config_as_it_was() -> None:
    # transformers' config classes complete a rope_scaling dict in place (rope_theta,
    # rope_type): on a shared dict that changed the disk cache's key after the first build,
    # so every new process recorded again. The dict given must come back unchanged.
    import copy

    from calc.derive.record import count_parameters, layer_signatures, layer_types

    config = {**TINY_LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}}
    before = copy.deepcopy(config)
    layer_signatures(config), count_parameters(config), layer_types(config)
    assert config == before


DEEPSEEK_V2_HEADS = {
    "model_type": "deepseek_v2", "num_key_value_heads": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "q_lora_rank": None,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "differ"),
    [
        (DEEPSEEK_V2_HEADS, True),  # q/k heads 16 + 8 = 24 wide, value heads 16
        ({**DEEPSEEK_V2_HEADS, "v_head_dim": 24}, False),
        (TINY_LLAMA, False),  # one head_dim for q, k and v
    ],
)
def test_value_heads_of_another_width_are_found(config: dict, differ: bool) -> None:
    from calc.derive.replay import head_dims_differ

    assert head_dims_differ(config) is differ


@pytest.mark.parametrize(
    ("extra", "recorded_as", "says"),
    [
        # Gemma2ForCausalLM._supports_sdpa is False: from_config builds it eager
        ({"model_type": "gemma2", "sliding_window": 16}, "eager", "no SDPA"),
        # CPU flash refuses heads of two widths; CPU PyTorch runs math
        ({**DEEPSEEK_V2_HEADS, "num_hidden_layers": 2}, "math", "math kernel"),
    ],
)
def test_sdpa_that_the_model_cannot_run_is_recorded_as_torch_runs_it(
    extra: dict, recorded_as: str, says: str
) -> None:
    # The expected bytes are the same job asked with the attention that really runs (each
    # checked against the CPU tracker by verify's derived-gemma2-* and -deepseek_v2-* cases).
    spec = calc.ModelSpec.from_hf_config({**TINY_LLAMA, "num_hidden_layers": 2, **extra})
    job = calc.Training(micro_batch=2, seq_len=64, precision="amp-bf16", attention="sdpa")
    est = calc.estimate(spec, job, device="cpu")
    assert (
        est.peak_bytes
        == calc.estimate(spec, replace(job, attention=recorded_as), device="cpu").peak_bytes
    )
    assert any(says in note for note in est.notes)


def test_fp32_grouped_query_inference_on_cuda_is_refused_not_answered_with_cpu_kernels() -> None:
    # CUDA's memory-efficient kernel takes no grouped key/value heads, so fp32 grouped-query
    # SDPA runs math there (an H200 raised "No available kernel" with efficient forced:
    # verify/measurements/nvidia-h200-2026-12-04-derived.json), while the recording runs CPU
    # flash: neither the derived fallback of a hand-modelled type nor a derived type answers
    gqa_phi3 = calc.ModelSpec.from_hf_config({**TINY_PHI3, "num_key_value_heads": 2})
    hand_llama = calc.ModelSpec.from_hf_config(TINY_LLAMA, name="tiny-llama")
    fp32 = calc.Inference(batch=1, prompt=16, new_tokens=4, precision="fp32")
    for spec in (gqa_phi3, hand_llama):
        with pytest.raises(NotImplementedError, match="math kernel on CUDA"):
            calc.estimate(spec, fp32, device="cuda")
        assert calc.estimate(spec, fp32, device="cpu").peak_bytes > 0
        assert calc.estimate(spec, replace(fp32, precision="bf16"), device="cuda").peak_bytes > 0
    # equal heads: memory-efficient runs on CUDA as CPU flash does on the tracker
    assert calc.estimate(calc.ModelSpec.from_hf_config(TINY_PHI3), fp32).peak_bytes > 0


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_the_checkpoint_dtype_of_a_config_does_not_set_the_weights_dtype(key: str) -> None:
    # Real configs say "torch_dtype": "bfloat16"; transformers' from_config would build the
    # model in it. The job's precision decides. The tensors of the hand count above, each
    # rounded up to 512 B: fp32 embed 131072, per layer qkv 49152 + o 16384 + gate_up 65536 +
    # down 32768 + two norms 2 x 512 = 164864 (x 2), final norm 512, lm_head 131072: 592384;
    # bf16 embed 65536, per layer 24576 + 8192 + 32768 + 16384 + 1024 = 82944 (x 2), 512,
    # 65536: 297472.
    spec = calc.ModelSpec.from_hf_config({**TINY_PHI3, key: "bfloat16"})
    job = calc.Training(micro_batch=1, seq_len=32, optimizer="sgd")
    fp32 = calc.estimate(spec, replace(job, precision="fp32"), device="cpu")
    bf16 = calc.estimate(spec, replace(job, precision="bf16"), device="cpu")
    assert fp32.breakdown["weights"] == 592384
    assert bf16.breakdown["weights"] == 297472
