"""The language model inside a multimodal ``config.json``.

Gemma 3 from 4B up (``Gemma3ForConditionalGeneration``), Mistral Small 3.1 and later
(``Mistral3ForConditionalGeneration``), Llama 4 and most vision-language models keep their
decoder's keys under ``text_config`` (``transformers``' composite configs,
``PretrainedConfig.sub_configs``) beside a ``vision_config``; the top level has no
``hidden_size``. calc models the decoder: `language_model_config` returns its keys with the
top level's dtype, tying and quantization where the sub-config leaves them out (and the size
keys it leaves to its class, from transformers' defaults when installed), and
`multimodal_note` says what is left out (the vision tower and projector's weights, the image
tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SIZE_KEYS = ("hidden_size", "n_embd", "d_model")
"""Keys that give a decoder's width; a config with none of them at its top level and a
``text_config`` is a composite one."""
DEFAULTED_KEYS = ("vocab_size", "max_position_embeddings", "tie_word_embeddings")
"""Keys a ``text_config`` often leaves to its class (Gemma 3's omits ``vocab_size``, 262,208 in
``Gemma3TextConfig``, and ``max_position_embeddings``): filled from transformers' defaults,
as its composite config does when it builds the sub-config."""
INHERITED_KEYS = ("torch_dtype", "dtype", "tie_word_embeddings", "quantization_config")
"""Top-level keys a sub-config takes when it does not set them itself (a quantized checkpoint
declares its format once, at the top)."""


def is_multimodal(config: Mapping[str, object]) -> bool:
    """Whether ``config`` keeps its decoder under ``text_config`` (no width at its top level)."""
    inner = config.get("text_config")
    return isinstance(inner, Mapping) and not any(key in config for key in SIZE_KEYS)


def language_model_config(config: Mapping[str, object]) -> Mapping[str, object]:
    """The decoder's config of a composite ``config`` (``text_config`` with the top level's
    `INHERITED_KEYS` where it lacks them); ``config`` itself otherwise. ``ValueError`` when the
    ``text_config`` names no ``model_type``."""
    if not is_multimodal(config):
        return config
    inner = config["text_config"]
    assert isinstance(inner, Mapping)
    if not isinstance(inner.get("model_type"), str):
        outer = config.get("model_type")
        raise ValueError(
            f"text_config of model_type={outer!r} has no model_type: the decoder's type is "
            "needed (e.g. 'gemma3_text', 'mistral')"
        )
    merged: dict[str, Any] = dict(inner)
    for key in INHERITED_KEYS:
        if key in config and key not in merged:
            merged[key] = config[key]
    missing = [key for key in DEFAULTED_KEYS if key not in merged]
    if missing:
        merged.update(class_defaults(merged["model_type"], missing))
    return merged


def class_defaults(model_type: str, keys: list[str]) -> dict[str, Any]:
    """The defaults of transformers' config class for ``model_type`` of those ``keys`` it has
    (empty without transformers, or for a type it does not know: the missing key is then named
    where it is read)."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return {}
    try:
        defaults = CONFIG_MAPPING[model_type]()
    except (KeyError, ValueError, TypeError):
        return {}
    return {key: getattr(defaults, key) for key in keys if getattr(defaults, key, None) is not None}


def multimodal_note(config: Mapping[str, object]) -> str | None:
    """One line naming what a composite ``config``'s estimate leaves out; None otherwise."""
    if not is_multimodal(config):
        return None
    arch = config.get("architectures")
    name = arch[0] if isinstance(arch, list) and arch else config.get("model_type")
    inner = config["text_config"]  # its model_type only: no merge, no transformers defaults
    assert isinstance(inner, Mapping)
    towers = [key for key in config if key.endswith("_config") and key != "text_config"]
    left = ", ".join(towers) if towers else "the other towers"
    return (
        f"multimodal config ({name}): its language model (text_config, model_type "
        f"{inner.get('model_type')!r}) is estimated; {left} (weights, image tokens) not counted"
    )
