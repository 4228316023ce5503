"""Model cards, and the other data files of ``calc``: with ``calc.data.hub`` (a config.json by
Hugging Face id), the only module of ``calc`` that touches files (model cards, the GPU catalog
``hardware/gpus.json``, the latest verify report, and the planner's compiled cache).

A card is a folder ``model_cards/<id>/`` holding the upstream Hugging Face ``config.json``
(unedited) and ``published.json`` with a parameter count published elsewhere, with its source.
"""

from __future__ import annotations

import json
from pathlib import Path

from calc.config.model_spec import ModelSpec

CARDS_DIR: Path = Path(__file__).resolve().parents[2] / "model_cards"
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


def _positive_int(path: Path, key: str, default: int | None = None) -> int:
    value = _read_json(path).get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{key}={value!r} in {path} must be a positive integer")
    return value


def published_params(card_id: str) -> int:
    """The published parameter count from the card's ``published.json`` (exact, or rounded
    to `published_params_precision` where the publisher only gives a rounded figure)."""
    return _positive_int(_card_dir(card_id) / "published.json", "n_params")


def published_params_precision(card_id: str) -> int:
    """The unit the published count is rounded to (``n_params_precision`` in
    ``published.json``, e.g. 100,000,000 for "27.2B"); 1 where the count is exact."""
    return _positive_int(_card_dir(card_id) / "published.json", "n_params_precision", 1)


GPU_CATALOG_PATH: Path = CARDS_DIR.parent / "hardware" / "gpus.json"
"""The GPU catalog (``calc.data.gpus`` reads it through ``load_gpu_catalog_data``)."""
VERIFY_REPORT_PATH: Path = CARDS_DIR.parent / "verify" / "reports" / "latest" / "report.json"
"""The latest ``python -m verify`` report (error bars of ``calc.plan``)."""


def load_gpu_catalog_data() -> dict:
    """``hardware/gpus.json`` as a dict (``{"about": ..., "gpus": [...]}``)."""
    return _read_json(GPU_CATALOG_PATH)


_REPORTS: dict[tuple, dict] = {}


def load_verify_report(path: Path | None = None) -> dict | None:
    """The latest verify report (``verify/reports/latest/report.json``), or None if absent.
    Parsed once per version of the file (its size and modification time); treat it as
    read-only."""
    path = VERIFY_REPORT_PATH if path is None else Path(path)
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _REPORTS:
        _REPORTS.clear()
        _REPORTS[key] = _read_json(path)
    return _REPORTS[key]


def plan_cache_dir() -> Path:
    """Folder of the planner's persistent compiled cache: ``$VRAMPLAN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/vramplan``, else ``~/.cache/vramplan``."""
    import os

    env = os.environ.get("VRAMPLAN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vramplan"


def read_plan_cache(name: str) -> dict | None:
    """The cache entry ``name`` (a hex digest) as parsed JSON, or None when absent or
    unreadable (a damaged entry is recompiled, never trusted)."""
    path = plan_cache_dir() / f"{name}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_plan_cache(name: str, data: dict) -> bool:
    """Store a cache entry atomically (write then rename); False if the folder is not
    writable (the planner then only caches in memory)."""
    folder = plan_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.{id(data)}.tmp"
        tmp.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
        tmp.replace(folder / f"{name}.json")
    except OSError:
        return False
    return True


def calc_source_digest(exclude: frozenset[str] = frozenset()) -> str:
    """SHA-256 over the source files of ``calc`` (sorted by path), leaving out the files named
    in ``exclude`` (paths relative to ``calc/``): the planner's cache key, so any change to the
    cost model invalidates every compiled entry."""
    import hashlib

    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        if str(path.relative_to(root)) in exclude:
            continue
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
