"""Invalid input is refused with a ValueError naming the field; counts follow a closed form."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calc.config.model_spec import ModelSpec
from tests.specs import tiny_llama

BASE = tiny_llama(
    name="tiny",
    hidden=8,
    n_kv_heads=1,
    head_dim=4,
    ffn=16,
    vocab=10,
    max_positions=32,
    norm_eps=1e-5,
)
"""Hidden 8, 2 layers, 2 query heads of 4 sharing 1 KV head, ffn 16, vocabulary 10."""


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", ""),
        ("model_type", "bert"),
        ("hidden", 0),
        ("hidden", True),
        ("hidden", 8.0),
        ("n_layers", -1),
        ("n_heads", 0),
        ("n_kv_heads", 0),
        ("n_kv_heads", 3),
        ("head_dim", 0),
        ("ffn", "16"),
        ("vocab", 0),
        ("max_positions", 0),
        ("mlp", "relu"),
        ("norm", "batchnorm"),
        ("qkv_bias", 1),
        ("o_bias", None),
        ("mlp_bias", "no"),
        ("norm_bias", True),
        ("qk_norm", 0),
        ("tied_embeddings", "yes"),
        ("learned_positions", 1),
        ("attention_dropout", 1.0),
        ("attention_dropout", -0.1),
        ("hidden_dropout", 1.5),
        ("embedding_dropout", True),
        ("norm_eps", 0.0),
        ("rope_theta", -1.0),
    ],
)
def test_invalid_field_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}="):
        dataclasses.replace(BASE, **{field: value})


def test_kv_heads_message_names_both_values() -> None:
    with pytest.raises(ValueError, match=r"n_kv_heads=3 must divide n_heads=8"):
        dataclasses.replace(BASE, n_heads=8, n_kv_heads=3, hidden=32)


GPT2 = {"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 4,
        "vocab_size": 10}  # fmt: skip
"""A one-layer GPT-2 config.json: hidden 8 in 2 heads."""


def test_gpt2_head_dim_must_split_hidden() -> None:
    gpt2 = ModelSpec.from_hf_config(GPT2)
    with pytest.raises(ValueError, match="head_dim=3"):
        gpt2.with_overrides(head_dim=3)


LLAMA = {
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 16,
    "vocab_size": 10,
}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": "8"}, "hidden_size"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers"),
        ({"num_attention_heads": 3}, "hidden_size"),  # 8 not divisible by 3, no head_dim
        ({"num_key_value_heads": 3}, "n_kv_heads"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"vocab_size": True}, "vocab_size"),
        ({"head_dim": "4"}, "head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"attention_bias": 1}, "attention_bias"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
        ({"rope_theta": "1e4"}, "rope_theta"),
        ({"attention_dropout": 1.0}, "attention_dropout"),
        ({"model_type": "no such type!"}, "model_type"),
        ({"model_type": None}, "model_type"),
    ],
)
def test_bad_hf_config_names_key(change: dict, field: str) -> None:
    config = {**LLAMA, **change}
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_missing_required_key(key: str) -> None:
    config = {k: v for k, v in LLAMA.items() if k != key}
    with pytest.raises(ValueError, match=rf"missing required key '{key}'"):
        ModelSpec.from_hf_config(config)


def test_gpt2_bad_keys() -> None:
    with pytest.raises(ValueError, match="n_positions"):
        ModelSpec.from_hf_config({k: v for k, v in GPT2.items() if k != "n_positions"})
    with pytest.raises(ValueError, match="n_embd=8 must be divisible by n_head=3"):
        ModelSpec.from_hf_config({**GPT2, "n_head": 3})
    with pytest.raises(ValueError, match="activation_function"):
        ModelSpec.from_hf_config({**GPT2, "activation_function": "relu"})
    with pytest.raises(ValueError, match="resid_pdrop"):
        ModelSpec.from_hf_config({**GPT2, "resid_pdrop": 1.0})


@pytest.mark.parametrize("config", [[1, 2], "llama", None, 3])
def test_non_dict_config(config: object) -> None:
    with pytest.raises(ValueError, match="config must be a JSON object"):
        ModelSpec.from_hf_config(config)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["{", "{'model_type': 'llama'}", "", "__import__('os')"])
def test_malformed_json(text: str) -> None:
    with pytest.raises(ValueError, match="config JSON is malformed"):
        ModelSpec.from_json(text)


def test_json_array_is_not_a_config() -> None:
    with pytest.raises(ValueError, match="config must be a JSON object"):
        ModelSpec.from_json("[1, 2]")


@settings(max_examples=200, deadline=None)
@given(
    model_type=st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]),
    kv=st.integers(1, 4),
    group=st.integers(1, 4),
    d=st.integers(1, 16),
    h=st.integers(1, 64),
    n_layers=st.integers(1, 6),
    f=st.integers(1, 128),
    vocab=st.integers(1, 1000),
    tied=st.booleans(),
    attention_bias=st.booleans(),
    mlp_bias=st.booleans(),
)
def test_llama_family_closed_form(
    model_type: str,
    kv: int,
    group: int,
    d: int,
    h: int,
    n_layers: int,
    f: int,
    vocab: int,
    tied: bool,
    attention_bias: bool,
    mlp_bias: bool,
) -> None:
    a = kv * group
    config = {
        "model_type": model_type,
        "hidden_size": h,
        "num_hidden_layers": n_layers,
        "num_attention_heads": a,
        "num_key_value_heads": kv,
        "head_dim": d,
        "intermediate_size": f,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "attention_bias": attention_bias,
        "mlp_bias": mlp_bias,
    }
    spec = ModelSpec.from_hf_config(config)
    # Closed form, per modeling file:
    #   attention weights  q: a*d*h, k and v: k*d*h each, o: h*a*d
    #   biases: llama/qwen3 follow attention_bias on q,k,v,o; qwen2 always has q,k,v bias and
    #           no o bias; mistral none. MLP biases (2f + h) only for llama with mlp_bias.
    #   qwen3 adds q_norm and k_norm of d each; every layer has 2 RMSNorms of h.
    per_layer = 2 * a * d * h + 2 * kv * d * h + 3 * h * f + 2 * h
    if model_type in ("llama", "qwen3") and attention_bias:
        per_layer += a * d + 2 * kv * d + h
    if model_type == "qwen2":
        per_layer += a * d + 2 * kv * d
    if model_type == "llama" and mlp_bias:
        per_layer += 2 * f + h
    if model_type == "qwen3":
        per_layer += 2 * d
    expected = vocab * h * (1 if tied else 2) + n_layers * per_layer + h
    assert spec.n_params == expected
    assert int(spec.n_params_expr.subs(spec.dims())) == expected


@pytest.mark.parametrize("value", [1e30, 4096.0])
def test_an_integral_float_size_says_it_is_read_as_a_float(value: float) -> None:
    """``hidden_size: 1e30`` got "must be a positive integer", which 1e30 looks like (issue 16)."""
    with pytest.raises(ValueError, match=r"hidden_size=.* without a decimal point or exponent"):
        ModelSpec.from_hf_config({**LLAMA, "hidden_size": value})


def test_another_model_type_keeps_its_config_for_the_derived_replay() -> None:
    config = {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 512}  # fmt: skip
    spec = ModelSpec.from_hf_config(config, name="tiny")
    assert spec.derived and json.loads(spec.hf_config or "") == config
    # sizes read from the shared keys; head_dim = hidden / heads = 16; kv heads default to heads
    assert (spec.hidden, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim) == (
        64, 2, 4, 4, 16,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="derived"):
        spec.param_tensors()
    with pytest.raises(ValueError, match="hidden_size"):
        ModelSpec.from_hf_config({**config, "hidden_size": 0})
