"""``python -m verify``'s ``--cuda-alloc``: the allocator variable is set (or unset) before torch
loads, by running the battery again in a child process whose environment has it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

import verify.__main__ as verify_main

VAR = "PYTORCH_CUDA_ALLOC_CONF"


def test_cuda_alloc_sets_or_unsets_the_allocator_variable(monkeypatch) -> None:
    monkeypatch.setenv(VAR, "max_split_size_mb:64")
    assert verify_main._alloc_env("expandable")[VAR] == "expandable_segments:True"
    assert VAR not in verify_main._alloc_env("default")


def test_a_different_allocator_setting_reruns_in_a_child_process(monkeypatch) -> None:
    calls = []

    def fake_run(cmd, env, check):
        calls.append((cmd, env))
        return SimpleNamespace(returncode=3)

    monkeypatch.setattr(verify_main.subprocess, "run", fake_run)
    monkeypatch.delenv(VAR, raising=False)
    argv = ["--cuda-alloc", "expandable", "--cases", "no-such-case"]
    assert verify_main.main(argv) == 3  # the child's exit code
    [(cmd, env)] = calls
    assert cmd[1:] == ["-m", "verify", *argv]
    assert env[VAR] == "expandable_segments:True"


def test_an_allocator_setting_already_in_place_runs_here(monkeypatch, capsys) -> None:
    monkeypatch.setattr(verify_main.subprocess, "run", lambda *a, **k: pytest.fail("reran"))
    monkeypatch.delenv(VAR, raising=False)
    assert verify_main.main(["--cuda-alloc", "default", "--cases", "no-such-case"]) == 2
    assert "no case matches" in capsys.readouterr().err
