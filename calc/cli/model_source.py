"""Which model a command line names: a model card id (``--card``), a Hugging Face
``config.json`` (``--config``) or a Hugging Face id (``--model ORG/NAME``: its config.json
through huggingface_hub's cache). Shared by ``python -m calc``, ``plan`` and ``report``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from calc.config.model_spec import ModelSpec
from calc.config.multimodal import multimodal_note
from calc.data.cards import load_card, load_card_config
from calc.data.hub import load_hub_config

DEFAULT_CARD = "qwen2.5-32b"
"""The model card of a command line that names none."""


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A subcommand's parser (``plan``, ``report``) with the model arguments (`add_arguments`)
    already on it."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(p)
    return p


MODEL_HELP = (
    "a Hugging Face model id, e.g. Qwen/Qwen3-32B: its config.json only, through "
    "huggingface_hub's local cache (offline, HF_HUB_OFFLINE=1: the cached copy)"
)
"""The help of ``--model``, shared with ``python -m calc``'s own parser."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--card ID``, ``--config PATH`` or ``--model ORG/NAME`` (mutually exclusive) on ``p``."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--card", metavar="ID", help=f"model card id (default {DEFAULT_CARD})")
    src.add_argument(
        "--config", metavar="PATH", type=Path, help="a Hugging Face config.json instead"
    )
    src.add_argument("--model", metavar="ORG/NAME", help=MODEL_HELP)


def load_model(args: argparse.Namespace) -> tuple[ModelSpec, str]:
    """The ``ModelSpec`` the arguments name (``args.config``: a ``Path`` or None;
    ``args.model``: a Hugging Face id or None; ``args.card``: a card id or None, default
    `DEFAULT_CARD`), and a label for it. ``ValueError`` for a config that cannot be read or is
    not JSON, or a Hugging Face id that cannot be had (see ``calc.data.hub``). A config read
    from the cache offline says so on stderr."""
    if getattr(args, "model", None) is not None:
        hub_config = load_hub_config(args.model)
        if hub_config.notice is not None:
            print(f"note: {hub_config.notice}", file=sys.stderr)
        _say_left_out(hub_config.config)
        spec = ModelSpec.from_hf_config(hub_config.config, name=hub_config.repo_id)
        return spec, hub_config.repo_id
    if args.config is not None:
        config = read_config(args.config)
        _say_left_out(config)
        return ModelSpec.from_hf_config(config), str(args.config)
    card = args.card if args.card is not None else DEFAULT_CARD
    return load_card(card), card


def _say_left_out(config: dict) -> None:
    """A multimodal config's towers the estimate leaves out, on stderr."""
    note = multimodal_note(config)
    if note is not None:
        print(f"note: {note}", file=sys.stderr)


def read_config(path: Path) -> dict:
    """A ``config.json`` file as a dict; ``ValueError`` if it cannot be read or is not JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"config={str(path)!r} cannot be read: {exc.strerror}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"config={str(path)!r} is malformed JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"config={str(path)!r} must hold a JSON object")
    return config


def load_config(args: argparse.Namespace) -> tuple[dict, str]:
    """The Hugging Face config dict the arguments name (as `load_model`, without building a
    ``ModelSpec``: for commands that read any model_type, such as ``serve``), and a label."""
    if getattr(args, "model", None) is not None:
        hub_config = load_hub_config(args.model)
        if hub_config.notice is not None:
            print(f"note: {hub_config.notice}", file=sys.stderr)
        return dict(hub_config.config), hub_config.repo_id
    if args.config is not None:
        return read_config(args.config), str(args.config)
    card = args.card if args.card is not None else DEFAULT_CARD
    return load_card_config(card), card
