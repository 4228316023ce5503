"""``python -m verify``'s ``--cuda-alloc``: the allocator variable is set (or unset) before torch
loads, by running the battery again in a child process whose environment has it."""

from __future__ import annotations

import json
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


def test_device_cuda_reaches_the_cases_and_lists_the_distributed_ones(
    monkeypatch, tmp_path
) -> None:
    """``python -m verify --device cuda`` exited 2 before measuring anything: with no filter it
    selected the distributed cases and refused (issue 14). Checked on CPU: the GPU is faked as
    present and the single-process runner records what it was given instead of running it."""
    given: list = []
    monkeypatch.setattr(verify_main.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(verify_main.report, "run_meta", lambda device: {"device": device})
    monkeypatch.setattr(
        verify_main,
        "_run_single",
        lambda cases, device, progress, predict: given.extend(cases) or [],
    )
    code = verify_main.main(["--device", "cuda", "--no-progress", "--out", str(tmp_path)])
    assert code == 0
    assert given and all(c.kind != "distributed" for c in given)  # the single-process cases
    written = json.loads((tmp_path / "report.json").read_text())
    records = written["records"] if "records" in written else written["cases"]
    distributed = [r for r in records if r["kind"] == "distributed"]
    assert distributed and all(r["status"] == "not-runnable" for r in distributed)
    assert "without --device cuda" in distributed[0]["message"]


def test_measure_only_reaches_the_runner_without_prediction(monkeypatch, tmp_path) -> None:
    seen: list = []
    monkeypatch.setattr(verify_main.report, "run_meta", lambda device: {"device": device})
    monkeypatch.setattr(
        verify_main,
        "_run_single",
        lambda cases, device, progress, predict: seen.append(predict) or [],
    )
    argv = ["--cases", "prec-bf16-llama", "--measure-only", "--no-progress", "--out", str(tmp_path)]
    assert verify_main.main(argv) == 0 and seen == [False]
