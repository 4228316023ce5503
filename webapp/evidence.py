"""The latest verification report, read for the evidence page."""

from __future__ import annotations

import json
from pathlib import Path

import streamlit as st

REPORT = Path(__file__).resolve().parent.parent / "verify" / "reports" / "latest" / "report.json"
"""The committed report of the full verify battery (``python -m verify`` writes it)."""


@st.cache_data(show_spinner=False)
def _load(path: str, mtime_ns: int) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_report(path: Path = REPORT) -> dict | None:
    """The report as a dict (re-read when the file changes), or None if there is none."""
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    return _load(str(path), mtime)
