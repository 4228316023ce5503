"""`verify.gpu_probe` up to the CUDA calls, on the CPU: its arguments and its refusal without a
device (the readings themselves need a GPU; scripts/gpu_check.sh runs it there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verify import gpu_probe


def test_usage_without_exactly_one_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_probe.main([]) == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_cuda_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "probe.json"
    assert gpu_probe.main([str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not out.exists()


def test_smi_reports_its_error_when_nvidia_smi_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    assert "error" in gpu_probe.smi()
