"""A Hugging Face cache folder written by a test (tests/calc/data/test_hub.py, the CLI's
--model tests): the layout huggingface_hub keeps, so the code under test reads it as it would a
real download, with no network."""

from __future__ import annotations

import json
from pathlib import Path

from tests.specs import TINY_LLAMA_HF_CONFIG

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY = TINY_LLAMA_HF_CONFIG
"""The tiny llama of tests/specs.py: 1352 parameters, counted by hand."""


def write_snapshot(cache: Path, repo_id: str, config: dict | str) -> Path:
    """The layout huggingface_hub's cache keeps (huggingface_hub/file_download.py,
    ``repo_folder_name``, ``refs/<revision>``, ``snapshots/<commit>/<file>``)."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (snapshot / "config.json").write_text(text)
    return snapshot / "config.json"
