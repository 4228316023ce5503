"""Every card's count equals its published figure; tiny configs equal hand-derived counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sympy as sp

from calc import symbols as S
from calc.config.model_spec import MODEL_TYPES, ModelSpec
from calc.data.cards import (
    CARDS_DIR,
    list_cards,
    load_card,
    load_card_config,
    plan_cache_dir,
    published_params,
    published_params_precision,
)
from tests.specs import TINY_LLAMA_HF_CONFIG

EXPECTED_CARDS = {
    "gpt2",
    "gpt2-xl",
    "llama-2-7b",
    "llama-2-13b",
    "llama-3.1-8b",
    "mistral-7b-v0.1",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "qwen2.5-32b",
    "qwen3-32b",
    "yi-34b",
    # Architectures calc reads today, added for issue 12:
    "qwen3-8b",
    "qwen3-14b",
    # Architectures calc does not read yet (issue 12's derived replay); transformers builds
    # them and tests/calc/config/test_meta_param_counts.py checks their counts:
    "phi-4",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "olmo-2-7b-instruct",
    "granite-3.3-8b-instruct",
    "deepseek-v3",
    "gemma-2-9b",
    "gemma-3-1b-it",
}

MODELLED_CARDS = [c for c in list_cards() if load_card_config(c).get("model_type") in MODEL_TYPES]
"""Cards whose ``model_type`` ``ModelSpec`` reads (the others raise its ValueError)."""


def test_all_cards_present() -> None:
    assert EXPECTED_CARDS <= set(list_cards())


@pytest.mark.parametrize("card_id", list_cards())
def test_published_json_is_well_formed(card_id: str) -> None:
    # Every card cites where its count and its config.json came from.
    published = json.loads((CARDS_DIR / card_id / "published.json").read_text(encoding="utf-8"))
    assert published["id"] == card_id
    assert "/" in published["hf_repo"]
    assert published["source"].strip() and published["config_source"].strip()
    assert published_params(card_id) % published_params_precision(card_id) == 0


@pytest.mark.parametrize("card_id", MODELLED_CARDS)
def test_count_equals_published(card_id: str) -> None:
    # At the precision published (exact where the publisher gives the exact count).
    unit = published_params_precision(card_id)
    assert round(load_card(card_id).n_params / unit) * unit == published_params(card_id)


@pytest.mark.parametrize("card_id", MODELLED_CARDS)
def test_symbolic_tensors_agree_with_numeric(card_id: str) -> None:
    spec = load_card(card_id)
    dims = spec.dims()
    numeric = spec.param_tensors()
    symbolic = spec.param_tensors(symbolic=True)
    assert [t.name for t in numeric] == [t.name for t in symbolic]
    assert [t.group for t in numeric] == [t.group for t in symbolic]
    for num, sym in zip(numeric, symbolic, strict=True):
        assert all(isinstance(x, int) for x in num.shape)
        assert tuple(int(sp.sympify(x).subs(dims)) for x in sym.shape) == num.shape
    assert spec.n_params_expr.free_symbols <= set(S.MODEL_SYMBOLS)
    assert int(spec.n_params_expr.subs(dims)) == spec.n_params


def test_card_lookup_is_case_insensitive_and_unknown_lists_ids() -> None:
    assert load_card("Llama-2-7B") == load_card("llama-2-7b")
    assert load_card_config("GPT2")["model_type"] == "gpt2"
    with pytest.raises(ValueError, match=r"known.*gpt2"):
        load_card("no-such-model")


def test_tiny_llama_hand_count() -> None:
    # h=8, L=2, a=2 heads, k=1 kv head, d=h/a=4, f=16, V=10, untied.
    #   embed_tokens      V*h              = 10*8        =   80
    #   per layer: q_proj (a*d)*h          = 8*8         =   64
    #              k_proj (k*d)*h          = 4*8         =   32
    #              v_proj (k*d)*h          = 4*8         =   32
    #              o_proj h*(a*d)          = 8*8         =   64
    #              gate+up+down 3*f*h      = 3*16*8      =  384
    #              two RMSNorms 2*h        = 16
    #              layer total             = 592, times L=2 = 1184
    #   final norm        h                = 8
    #   lm_head           V*h              = 80
    #   total = 80 + 1184 + 8 + 80 = 1352
    spec = ModelSpec.from_hf_config(TINY_LLAMA_HF_CONFIG)
    assert spec.head_dim == 4
    assert spec.n_params == 1352


def test_tiny_gpt2_hand_count() -> None:
    # h=8, L=2, 2 heads, P=6 positions, V=10, n_inner=None -> f=4h=32, tied head.
    #   wte V*h = 80;  wpe P*h = 48
    #   per layer: ln_1 weight+bias 2h           =  16
    #              c_attn h*3h + 3h = 192 + 24   = 216
    #              c_proj h*h + h   = 64 + 8     =  72
    #              ln_2 2h                       =  16
    #              c_fc h*f + f     = 256 + 32   = 288
    #              c_proj f*h + h   = 256 + 8    = 264
    #              layer total                   = 872, times L=2 = 1744
    #   ln_f 2h = 16; lm_head tied -> 0
    #   total = 80 + 48 + 1744 + 16 = 1888
    config = {
        "model_type": "gpt2",
        "n_embd": 8,
        "n_layer": 2,
        "n_head": 2,
        "n_inner": None,
        "n_positions": 6,
        "vocab_size": 10,
    }
    spec = ModelSpec.from_hf_config(config)
    assert spec.ffn == 32 and spec.tied_embeddings and spec.learned_positions
    assert spec.n_params == 1888
    assert spec.dims()[S.P] == 6
    assert [t.name for t in spec.param_tensors()][:3] == [
        "wte.weight",
        "wpe.weight",
        "h.*.ln_1.weight",
    ]


def test_tiny_qwen3_hand_count() -> None:
    # Qwen3 with explicit head_dim=2 != h/a: h=8, L=1, a=2, k=1, d=2, f=4, V=5, untied.
    #   embed V*h = 40; q (a*d)*h = 32; k,v (k*d)*h = 16 each; o h*(a*d) = 32
    #   q_norm, k_norm d each = 4; mlp 3*f*h = 96; 2 norms = 16
    #   layer = 32+16+16+32+4+96+16 = 212; final norm 8; lm_head 40
    #   total = 40 + 212 + 8 + 40 = 300
    config = {
        "model_type": "qwen3",
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 2,
        "intermediate_size": 4,
        "vocab_size": 5,
    }
    assert ModelSpec.from_hf_config(config).n_params == 300


def test_with_overrides_scales_down() -> None:
    spec = load_card("llama-2-7b").with_overrides(n_layers=1)
    assert spec.n_layers == 1
    assert spec.n_params < load_card("llama-2-7b").n_params
    with pytest.raises(ValueError, match="n_layers"):
        load_card("llama-2-7b").with_overrides(n_layers=0)


def test_the_test_suite_never_writes_into_the_users_cache() -> None:
    """tests/conftest.py points the planner's disk cache at a folder of the run (issue 16)."""
    assert plan_cache_dir() != Path.home() / ".cache" / "vramplan"


def test_docs_list_every_card() -> None:
    # docs/cli.md's table of model cards stays complete as cards are added.
    text = (CARDS_DIR.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    for card_id in list_cards():
        assert f"| `{card_id}` |" in text, card_id
