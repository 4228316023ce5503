"""scripts/: the set-up helpers behave as the README says, checked on a stub virtual environment
(a ``.venv/bin/python`` that records its calls instead of installing anything)."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _stub_checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "venv.sh", tmp_path / "scripts" / "venv.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'stub'\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/calls"\n')
    python.chmod(0o755)
    return tmp_path


def _ensure(root: Path, *extras: str) -> list[str]:
    calls = "; ".join(f'ensure_venv "{e}"' for e in extras)
    subprocess.run(["bash", "-c", f"source scripts/venv.sh; {calls}"], cwd=root, check=True,
                   capture_output=True)  # fmt: skip
    log = root / "calls"
    return log.read_text().splitlines() if log.exists() else []


def test_run_after_test_installs_nothing_again(tmp_path: Path) -> None:
    """test.sh installs every extra; run.sh's "verify,app" and the CLI's "verify" are then
    already there (issue 16: run.sh reinstalled the app extras after test.sh)."""
    root = _stub_checkout(tmp_path)
    assert len(_ensure(root, "verify,dev,app,e2e", "verify,app", "verify", "")) == 1


def test_a_new_extra_or_a_changed_pyproject_installs(tmp_path: Path) -> None:
    root = _stub_checkout(tmp_path)
    assert len(_ensure(root, "app", "app", "verify")) == 2
    (root / "pyproject.toml").write_text("[project]\nname = 'stub2'\n")
    assert len(_ensure(root, "app")) == 3


def test_the_server_watches_no_files() -> None:
    """Streamlit's watcher over the checkout and its .venv flooded run.sh's terminal with
    "Inotify queue overflowed" (issue 16); the app's server runs without one."""
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["fileWatcherType"] == "none"
