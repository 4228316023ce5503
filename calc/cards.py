"""Model cards: the only module of ``calc`` that reads files.

A card is a folder ``model_cards/<id>/`` holding the upstream Hugging Face ``config.json``
(unedited) and ``published.json`` with a parameter count published elsewhere, with its source.
"""

from __future__ import annotations

import json
from pathlib import Path

from calc.model_spec import ModelSpec

CARDS_DIR: Path = Path(__file__).resolve().parent.parent / "model_cards"
"""Folder holding one sub-folder per model card."""


def list_cards() -> list[str]:
    """Ids of every card (folders with a ``config.json``), sorted."""
    if not CARDS_DIR.is_dir():
        return []
    return sorted(p.name for p in CARDS_DIR.iterdir() if (p / "config.json").is_file())


def _card_dir(card_id: str) -> Path:
    if not isinstance(card_id, str):
        raise ValueError(f"card_id={card_id!r} must be a string")
    known = list_cards()
    by_lower = {c.lower(): c for c in known}
    found = by_lower.get(card_id.strip().lower())
    if found is None:
        raise ValueError(f"card_id={card_id!r} is not a known model card; known: {known}")
    return CARDS_DIR / found


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        got = type(data).__name__
        raise ValueError(f"{path} must hold a JSON object, got {got}")
    return data


def load_card_config(card_id: str) -> dict:
    """The card's upstream ``config.json`` as a dict (case-insensitive id)."""
    return _read_json(_card_dir(card_id) / "config.json")


def load_card(card_id: str) -> ModelSpec:
    """The card's ``ModelSpec``, named by the card id (case-insensitive)."""
    folder = _card_dir(card_id)
    return ModelSpec.from_hf_config(_read_json(folder / "config.json"), name=folder.name)


def published_params(card_id: str) -> int:
    """The published parameter count from the card's ``published.json``."""
    path = _card_dir(card_id) / "published.json"
    value = _read_json(path).get("n_params")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"n_params={value!r} in {path} must be a positive integer")
    return value
