"""The configurations litgpt builds for Hugging Face configs (`calc.models.litgpt_arch`): the
fields of litgpt 0.5.12's ``config.py`` entries by hand, the parameters each layout registers,
the RoPE width, and what is refused. The whole step of each family is checked against the CPU
tracker by the ``lit-*-phi2``, ``-neox`` and ``-falcon`` verify cases, and verify's copy
against litgpt itself in tests/verify/models/test_litgpt_llama.py."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

import calc
from calc.models import litgpt, litgpt_arch
from calc.replay.tape import Tape
from calc.step.training import shape_for
from tests.specs import tiny_llama

PHI2 = {
    "_name_or_path": "microsoft/phi-2", "architectures": ["PhiForCausalLM"],
    "attention_dropout": 0.0, "bos_token_id": 50256, "embd_pdrop": 0.0, "eos_token_id": 50256,
    "hidden_act": "gelu_new", "hidden_size": 2560, "initializer_range": 0.02,
    "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
    "model_type": "phi", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "partial_rotary_factor": 0.4, "qk_layernorm": False,
    "resid_pdrop": 0.1, "rope_scaling": None, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.37.0",
    "use_cache": True, "vocab_size": 51200,
}  # fmt: skip
"""microsoft/phi-2's config.json (transformers 4.37.0), as copied in onnx-diagnostic's
``get_phi2`` (``onnx_diagnostic/torch_models/llms.py``); LitGPT's ``phi-2``."""
STABLELM_3B = {
    "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 4096,
    "num_hidden_layers": 16, "num_attention_heads": 32, "intermediate_size": 16384,
    "vocab_size": 50688, "max_position_embeddings": 4096, "rotary_pct": 0.25,
    "hidden_act": "gelu", "use_parallel_residual": True, "tie_word_embeddings": False,
    "layer_norm_eps": 1e-5,
}  # fmt: skip
"""stabilityai/stablelm-base-alpha-3b in GPT-NeoX's config keys, with the values of LitGPT's
``stablelm-base-alpha-3b`` entry (litgpt/config.py: 16 layers, n_embd 4096, 32 heads,
padded_vocab_size 50688, rotary_percentage 0.25, block_size 4096, parallel residual,
intermediate 4 x 4096)."""
FALCON_7B = {
    "alibi": False, "architectures": ["FalconForCausalLM"], "bias": False, "hidden_size": 4544,
    "layer_norm_epsilon": 1e-05, "model_type": "falcon", "multi_query": True,
    "new_decoder_architecture": False, "num_attention_heads": 71, "num_hidden_layers": 32,
    "num_kv_heads": 71, "parallel_attn": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 65024,
}  # fmt: skip
"""tiiuae/falcon-7b's config.json (transformers 4.28.1) as copied in tenstorrent tt-metal's
Falcon demo (``auto_map`` left out); LitGPT's ``falcon-7b``."""


GEMMA_2B = {
    "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 256, "intermediate_size": 16384, "vocab_size": 256000,
    "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}  # fmt: skip
"""google/gemma-2b in Gemma's config keys, with the values of LitGPT's ``Gemma-2b`` entry
(litgpt/config.py: n_embd 2048, 18 layers, 8 heads, one query group, head_size 2048 / 8,
intermediate 16384, vocab 256000) and Gemma's tied embedding."""
GEMMA_7B = {**GEMMA_2B, "hidden_size": 3072, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 24576}  # fmt: skip
"""google/gemma-7b as LitGPT's ``Gemma-7b`` (n_embd 3072, 28 layers, 16 heads of 256: wider
than n_embd, intermediate 24576)."""


def built(config: dict) -> litgpt_arch.LitSpec:
    model = litgpt_arch.as_built(calc.ModelSpec.from_hf_config(config))
    assert isinstance(model, litgpt_arch.LitSpec)
    return model


def test_phi2_is_litgpts_parallel_residual_with_biases_everywhere() -> None:
    # litgpt's phi-2: parallel_residual, shared_attention_norm, bias and lm_head_bias,
    # LayerNorm, GptNeoxMLP with gelu_approximate="tanh", rotary_percentage 0.4
    m = built(PHI2)
    assert (m.hidden, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn, m.vocab) == (
        2560, 32, 32, 80, 10240, 51200)  # fmt: skip
    assert (m.mlp, m.norm, m.qkv_bias, m.o_bias, m.mlp_bias, m.norm_bias) == (
        "gelu", "layernorm", True, True, True, True)  # fmt: skip
    assert m.arch == litgpt_arch.Arch(True, True, Fraction(2, 5), "tanh", head_bias=True)


def test_gpt_neox_has_its_own_second_norm_and_no_head_bias() -> None:
    m = built(STABLELM_3B)
    assert (m.n_layers, m.n_heads, m.head_dim, m.ffn, m.vocab) == (16, 32, 128, 16384, 50688)
    assert m.qkv_bias and m.mlp_bias and m.norm == "layernorm"
    assert m.arch == litgpt_arch.Arch(True, False, Fraction(1, 4), "none", head_bias=False)


def test_falcon_7b_is_multi_query_without_biases() -> None:
    # multi_query without new_decoder_architecture: one key/value head (num_kv_heads is
    # ignored); no ffn_hidden_size: 4 x 4544
    m = built(FALCON_7B)
    assert (m.n_heads, m.n_kv_heads, m.head_dim, m.ffn, m.vocab) == (71, 1, 64, 18176, 65024)
    assert not (m.qkv_bias or m.o_bias or m.mlp_bias) and m.norm_bias
    assert m.arch == litgpt_arch.Arch(True, True, Fraction(1), "none")


def test_gemma_is_a_llama_layout_with_its_three_changes_and_its_own_head() -> None:
    # litgpt's GPT has an lm_head of its own whatever the checkpoint ties (tie_embeddings
    # unset in the config hub); GemmaMLP's GeLU is the tanh one
    m = built(GEMMA_7B)
    assert (m.n_heads, m.n_kv_heads, m.head_dim, m.hidden, m.ffn) == (16, 16, 256, 3072, 24576)
    assert not m.tied_embeddings and m.mlp == "swiglu" and m.norm == "rmsnorm"
    assert m.arch == litgpt_arch.Arch(gelu_approximate="tanh", gemma=True)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({**PHI2, "qk_layernorm": True}, "qk_layernorm"),
        ({**STABLELM_3B, "hidden_act": "gelu_fast"}, "hidden_act='gelu_fast'"),
        ({**FALCON_7B, "alibi": True}, "alibi"),
        ({**FALCON_7B, "parallel_attn": False}, "parallel_attn"),
    ],
)
def test_refuses_what_litgpts_configurations_do_not_build(config: dict, words: str) -> None:
    with pytest.raises(NotImplementedError, match=words):
        litgpt_arch.as_built(calc.ModelSpec.from_hf_config(config))


def test_a_model_litgpt_has_no_family_for_is_left_as_it_is() -> None:
    llama = calc.load_card("llama-3.1-8b")
    assert litgpt_arch.as_built(llama) is llama
    assert litgpt_arch.arch_of(llama) == litgpt_arch.LLAMA


def test_fine_tuning_unties_a_tied_checkpoint() -> None:
    # finetune/full.py and lora.py list train.tie_embeddings as unsupported: the GPT they build
    # has its own lm_head (Llama-3.2-1B's tied embedding is copied into it): V x h more
    tied = tiny_llama(tied_embeddings=True)
    built_ = litgpt_arch.as_built(tied)
    assert not built_.tied_embeddings
    job = calc.Training(micro_batch=1, seq_len=8, precision="bf16", implementation="litgpt",
                        loop="hold-output", loss="chunked-ce")  # fmt: skip
    untied = calc.estimate(tiny_llama(), job, device="cpu")
    assert calc.estimate(tied, job, device="cpu").peak_bytes == untied.peak_bytes


def _weights(config: dict, n_layers: int = 1) -> litgpt.Weights:
    model = built(config)
    job = calc.Training(micro_batch=1, seq_len=8, implementation="litgpt", loop="hold-output",
                        loss="chunked-ce")  # fmt: skip
    return litgpt.Weights(Tape(), shape_for(model, job, "cpu", n_layers), model.arch)


def test_parameters_in_litgpts_order_for_each_layout() -> None:
    # GPT.__init__: lm_head (and its bias), wte, the blocks, ln_f; Block: norm_1, attn (qkv,
    # proj), norm_2 unless shared, the MLP (GptNeoxMLP: fc, proj); each weight before its bias
    phi = [p.name for p in _weights(PHI2).parameters()]
    assert phi == ["lm_head", "lm_head.bias", "embed", "norm_1", "norm_1.bias", "attn.qkv",
                   "attn.qkv.bias", "attn.proj", "attn.proj.bias", "mlp.fc", "mlp.fc.bias",
                   "mlp.proj", "mlp.proj.bias", "ln_f", "ln_f.bias"]  # fmt: skip
    neox = [p.name for p in _weights(STABLELM_3B).parameters()]
    assert neox[:2] == ["lm_head", "embed"] and "norm_2.bias" in neox
    falcon = [p.name for p in _weights(FALCON_7B).parameters()]
    assert falcon == ["lm_head", "embed", "norm_1", "norm_1.bias", "attn.qkv", "attn.proj",
                      "mlp.fc", "mlp.proj", "ln_f", "ln_f.bias"]  # fmt: skip


def test_rope_rotates_int_of_the_fraction_of_a_head() -> None:
    # rope_n_elem = int(rotary_percentage * head_size): phi-2 int(0.4 * 80) = 32, StableLM
    # int(0.25 * 128) = 32, Falcon all 64
    for config, width in ((PHI2, 32), (STABLELM_3B, 32), (FALCON_7B, 64)):
        model = built(config)
        job = calc.Training(micro_batch=1, seq_len=8, implementation="litgpt")
        sh = shape_for(model, job, "cpu", 1)
        assert litgpt.rope_width(replace(sh, d=model.head_dim), model.arch) == width


def test_qwen2_has_litgpts_attn_bias_alone() -> None:
    # litgpt's Qwen2.5 entries: bias=False, attn_bias=True: the fused qkv's bias only
    model = litgpt_arch.as_built(tiny_llama(model_type="qwen2", qkv_bias=True))
    job = calc.Training(micro_batch=1, seq_len=8, implementation="litgpt")
    names = [p.name for p in litgpt.Weights(Tape(), shape_for(model, job, "cpu", 1)).parameters()]
    assert names == ["lm_head", "embed", "norm_1", "attn.qkv", "attn.qkv.bias", "attn.proj",
                     "norm_2", "fc_1", "fc_2", "mlp.proj", "ln_f"]  # fmt: skip
