"""Every derive test records into a folder of its own (never a stale cached trace)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))
