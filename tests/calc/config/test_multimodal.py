"""A multimodal config.json: its language model (``text_config``) is what calc estimates."""

from __future__ import annotations

import pytest

import calc
from calc.config.multimodal import is_multimodal, language_model_config, multimodal_note
from calc.config.serving import Serving
from calc.serving.api import serve

MISTRAL_TEXT = {
    "model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "num_hidden_layers": 40, "vocab_size": 131072, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000000.0, "sliding_window": None,
    "hidden_act": "silu", "tie_word_embeddings": False,
}  # fmt: skip
"""The shape of Mistral Small 3.1's ``text_config`` (hidden 5,120, 40 layers, 32 heads of 128,
8 KV heads, MLP 32,768, vocabulary 131,072)."""

COMPOSITE = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "model_type": "mistral3",
    "text_config": MISTRAL_TEXT,
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "num_hidden_layers": 24},
    "torch_dtype": "bfloat16",
}
"""The layout of a composite config: the decoder under ``text_config``, no width at the top."""


def test_the_decoder_under_text_config_is_the_model() -> None:
    assert is_multimodal(COMPOSITE) and not is_multimodal(MISTRAL_TEXT)
    spec = calc.ModelSpec.from_hf_config(COMPOSITE)
    alone = calc.ModelSpec.from_hf_config(MISTRAL_TEXT)
    assert (spec.model_type, spec.hidden, spec.n_layers, spec.vocab) == (
        "mistral",
        5120,
        40,
        131072,
    )
    assert spec.n_params == alone.n_params
    # hand count: embedding and untied head 2 x 131,072 x 5,120; per layer q and o 2 x 5,120 x
    # 4,096, k and v 2 x 5,120 x 1,024, the MLP 3 x 5,120 x 32,768, two norms of 5,120; final norm
    layer = 2 * 5120 * 4096 + 2 * 5120 * 1024 + 3 * 5120 * 32768 + 2 * 5120
    assert spec.n_params == 2 * 131072 * 5120 + 40 * layer + 5120


def test_the_top_level_dtype_is_inherited_and_the_decoders_own_keys_win() -> None:
    inner = language_model_config(COMPOSITE)
    assert inner["torch_dtype"] == "bfloat16"
    assert inner["tie_word_embeddings"] is False  # the text_config's own, not a default
    assert language_model_config(MISTRAL_TEXT) is MISTRAL_TEXT


def test_a_text_config_without_a_model_type_is_named() -> None:
    broken = {
        **COMPOSITE,
        "text_config": {k: v for k, v in MISTRAL_TEXT.items() if k != "model_type"},
    }
    with pytest.raises(ValueError, match="text_config of model_type='mistral3' has no model_type"):
        calc.ModelSpec.from_hf_config(broken)


def test_the_note_names_the_towers_left_out() -> None:
    note = multimodal_note(COMPOSITE)
    assert note is not None
    assert "Mistral3ForConditionalGeneration" in note and "vision_config" in note
    assert multimodal_note(MISTRAL_TEXT) is None


def test_serving_a_composite_config_serves_its_decoder_and_says_what_it_leaves_out() -> None:
    serving = Serving(max_model_len=8192)
    whole = serve(COMPOSITE, serving, gpu="h100-80gb")
    alone = serve(MISTRAL_TEXT, serving, gpu="h100-80gb")
    assert whole.weights_bytes == alone.weights_bytes
    assert any("vision_config" in n and "smaller" in n for n in whole.notes)
    assert not any("vision_config" in n for n in alone.notes)


def test_keys_a_gemma3_text_config_leaves_to_its_class_come_from_transformers() -> None:
    pytest.importorskip("transformers")
    # google/gemma-3-27b-it's text_config names no vocab_size, max_position_embeddings or
    # tie_word_embeddings; transformers' Gemma3TextConfig gives 262,208, 131,072 and True
    # (models/gemma3/configuration_gemma3.py)
    text = {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
            "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
            "num_hidden_layers": 62, "sliding_window": 1024}  # fmt: skip
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}  # fmt: skip
    spec = calc.ModelSpec.from_hf_config(config)
    assert (spec.vocab, spec.max_positions, spec.tied_embeddings) == (262208, 131072, True)
    assert (spec.hidden, spec.n_layers) == (5376, 62)
