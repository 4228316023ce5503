"""The model of the web calculator: a model card, a Hugging Face id (its ``config.json`` through
huggingface_hub's cache), or a ``config.json`` the user pasted or uploaded.

A user's config is read as JSON (``json.loads``), never evaluated, and refused with one message
naming the problem when it is too large, not UTF-8, not JSON, not an object, or has fields
``calc.ModelSpec.from_hf_config`` does not accept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import calc
from calc.config.multimodal import multimodal_note

MAX_CONFIG_BYTES = 256 * 1024
"""Largest accepted config.json (a Hugging Face config is a few KiB)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Model:
    """A model ready for ``calc.estimate``, with what the page shows about it."""

    spec: calc.ModelSpec
    """Its dimensions and parameter tensors."""
    label: str
    """Card id, or ``custom config.json`` for a user's config."""
    config: dict | None
    """A user's parsed config (None for a card: the card id is enough for a link)."""
    notice: str | None = None
    """A line for the page: the config came from the Hugging Face cache offline."""
    left_out: str | None = None
    """A line for the page: a multimodal config's towers the estimate leaves out
    (`calc.config.multimodal.multimodal_note`)."""


def from_card(card_id: str) -> Model:
    """A model card by id (``ValueError`` naming the known ids if unknown)."""
    spec = calc.load_card(card_id)
    return Model(spec=spec, label=spec.name, config=None)


def from_hub(repo_id: str) -> Model:
    """A model by Hugging Face id (``calc.load_hub_config``: config.json only, the cached copy
    offline). Raises ``ValueError`` with one line naming the problem."""
    hub_config = calc.load_hub_config(repo_id)
    spec = calc.ModelSpec.from_hf_config(hub_config.config, name=hub_config.repo_id)
    return Model(
        spec=spec,
        label=hub_config.repo_id,
        config=hub_config.config,
        notice=hub_config.notice,
        left_out=multimodal_note(hub_config.config),
    )


def from_config_bytes(data: bytes | str, name: str = "config.json") -> Model:
    """A user's ``config.json`` (bytes of an upload, or pasted text), checked and parsed.

    Raises ``ValueError`` with one line naming the problem."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{name} is {len(raw):,} bytes: the limit is {MAX_CONFIG_BYTES:,} bytes "
            "(a Hugging Face config.json is a few KiB)"
        )
    if not raw.strip():
        raise ValueError(f"{name} is empty: paste or upload a Hugging Face config.json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{name} is not UTF-8 text (byte {exc.start}): is it a config.json?"
        ) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is malformed JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply to be a config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"{name} must hold a JSON object, got {type(config).__name__}")
    spec = calc.ModelSpec.from_hf_config(config, name="custom")
    return Model(spec=spec, label=f"custom {name}", config=config, left_out=multimodal_note(config))
