"""A model's ``config.json`` by its Hugging Face id (``Qwen/Qwen3-32B``): the config only, never
the weights, through ``huggingface_hub`` (an optional dependency, imported when first used:
``pip install vramplan[hub]``) and its local cache.

Online, ``hf_hub_download`` fetches the file into the cache (or finds it there up to date).
Offline (``HF_HUB_OFFLINE=1``, or the Hub cannot be reached), the cached copy is used and
`HubConfig.offline_reason` says why; without a cached copy the answer is one ``ValueError``
naming the id and what to do. Like ``calc.data.cards``, this module reads files and nothing
else in ``calc`` does.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calc.config.model_spec import ModelSpec

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
# The Hub's own rule (huggingface_hub.utils.validate_repo_id): letters, digits, ``-``, ``_``,
# ``.``; at most 96 characters a part; ``--`` and ``..`` are refused.
_TRUE = ("1", "ON", "YES", "TRUE")


@dataclass(frozen=True, kw_only=True, slots=True)
class HubConfig:
    """A ``config.json`` read by Hugging Face id, and where it came from."""

    repo_id: str
    """The Hugging Face id, ``ORG/NAME`` (or ``NAME``)."""
    revision: str | None
    """The branch, tag or commit asked for (None: the Hub's default branch)."""
    path: Path
    """The file read, inside the Hugging Face cache."""
    config: dict[str, Any]
    """The parsed ``config.json``."""
    offline_reason: str | None
    """Why the cached copy was used without asking the Hub (``HF_HUB_OFFLINE`` set, or the Hub
    could not be reached); None when the Hub answered."""

    @property
    def notice(self) -> str | None:
        """One line for the user when the config came from the cache offline, else None."""
        if self.offline_reason is None:
            return None
        return f"offline ({self.offline_reason}): using the cached config.json of {self.repo_id} ({self.path})"


def _check_repo_id(repo_id: object) -> str:
    if not isinstance(repo_id, str) or not _REPO_ID.fullmatch(repo_id.strip()):
        raise ValueError(
            f"model={repo_id!r} must be a Hugging Face id ORG/NAME (letters, digits, '-', '_', "
            "'.'; e.g. 'Qwen/Qwen3-32B')"
        )
    repo_id = repo_id.strip()
    if "--" in repo_id or ".." in repo_id:
        raise ValueError(f"model={repo_id!r} must not contain '--' or '..' (Hugging Face id rule)")
    return repo_id


def _offline_by_env() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value, as huggingface_hub
    reads it (``huggingface_hub/constants.py``, ``HF_HUB_OFFLINE``)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def _import_hub() -> Any:
    try:  # its submodules load lazily: import the two read here by attribute
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
    except ImportError:
        raise ValueError(
            "loading a model by Hugging Face id needs huggingface_hub: pip install 'vramplan[hub]' "
            "(or pass a config.json file instead)"
        ) from None
    return huggingface_hub


def _cached(hub: Any, repo_id: str, revision: str | None, cache_dir: Path | None, why: str) -> str:
    """The cached ``config.json`` (no network), or a ValueError naming ``why`` it is needed."""
    try:
        return hub.hf_hub_download(
            repo_id, "config.json", revision=revision, cache_dir=cache_dir, local_files_only=True
        )
    except hub.errors.LocalEntryNotFoundError:
        where = cache_dir if cache_dir is not None else hub.constants.HF_HUB_CACHE
        raise ValueError(
            f"model={repo_id!r}: {why}, and the Hugging Face cache ({where}) holds no config.json "
            "of it; run once with network access, or pass the config.json file instead"
        ) from None


def _ask_hub(hub: Any, repo_id: str, revision: str | None) -> str | None:
    """None when the Hub answers for the file; a reason when it cannot be reached. A missing
    repository, revision or file is a ValueError (no cached copy can be trusted for it)."""
    errors = hub.errors
    url = hub.hf_hub_url(repo_id, "config.json", revision=revision)
    try:
        hub.get_hf_file_metadata(url)
    except errors.GatedRepoError:
        raise ValueError(
            f"model={repo_id!r} is gated on the Hugging Face Hub: accept its licence on the model "
            "page and log in (hf auth login), or pass its config.json file instead"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ValueError(
            f"model={repo_id!r} is not a model on the Hugging Face Hub (or it is private: log in "
            "with hf auth login)"
        ) from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"revision={revision!r} of model={repo_id!r} does not exist") from None
    except errors.EntryNotFoundError:
        raise ValueError(f"model={repo_id!r} has no config.json on the Hugging Face Hub") from None
    except Exception as exc:  # connection, timeout, proxy, Hub down: the cache may answer
        return f"the Hugging Face Hub could not be reached: {type(exc).__name__}"
    return None


def load_hub_config(
    repo_id: str, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> HubConfig:
    """The ``config.json`` of Hugging Face model ``repo_id`` (``"Qwen/Qwen3-32B"``), through
    ``huggingface_hub.hf_hub_download`` and its cache (``cache_dir``, default the Hub's own:
    ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``). Only ``config.json`` is fetched.

    Offline (``HF_HUB_OFFLINE=1``, or the Hub unreachable) the cached copy is read and
    ``offline_reason`` says so. Raises ``ValueError`` with one line for a malformed id, a
    repository/revision/file the Hub does not have, no cached copy offline, a file that is
    not a JSON object, or huggingface_hub not installed."""
    repo_id = _check_repo_id(repo_id)
    hub = _import_hub()
    cache = None if cache_dir is None else Path(cache_dir)
    reason: str | None
    if _offline_by_env() or hub.constants.HF_HUB_OFFLINE:
        reason = "HF_HUB_OFFLINE is set"
    else:
        reason = _ask_hub(hub, repo_id, revision)
    if reason is None:
        path = hub.hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache)
    else:
        path = _cached(hub, repo_id, revision, cache, reason)
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"config.json of model={repo_id!r} ({path}) cannot be read: {exc}"
        ) from None
    if not isinstance(config, dict):
        got = type(config).__name__
        raise ValueError(f"config.json of model={repo_id!r} must hold a JSON object, got {got}")
    return HubConfig(
        repo_id=repo_id, revision=revision, path=path, config=config, offline_reason=reason
    )


def from_pretrained(
    repo_id: str, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> ModelSpec:
    """The ``ModelSpec`` of Hugging Face model ``repo_id``, named by it: the
    ``transformers``-style entry point (config only, see `load_hub_config`), e.g.
    ``calc.from_pretrained("Qwen/Qwen3-32B")``. A model type ``ModelSpec`` does not read is its
    ``ValueError``."""
    hub_config = load_hub_config(repo_id, revision=revision, cache_dir=cache_dir)
    return ModelSpec.from_hf_config(hub_config.config, name=hub_config.repo_id)
