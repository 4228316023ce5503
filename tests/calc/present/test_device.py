"""The device table (`calc.present.device`): the verdict's terms side by side, by hand."""

from __future__ import annotations

import calc
from calc.data.gpus import get_gpu
from calc.estimate.device_fit import DeviceFit
from calc.present import device

GIB = 2**30
MIB = 2**20


def test_device_rows_put_the_verdicts_terms_side_by_side() -> None:
    # T4: peak 1 GiB; driver reservation 15360 MiB - 14.75 GiB = 256 MiB (catalog readings);
    # CUDA context 287,047,680 B to 1000 MiB (pytorch PR #86509, issue #107667)
    rows = device.device_rows(GIB, get_gpu("t4-16gb"), None, "cuda")
    by_term = {r["term"]: r for r in rows}
    assert by_term["outside PyTorch: driver_reserved"]["GiB"] == 0.25
    assert by_term["outside PyTorch: cuda_context"]["low GiB"] == round(287_047_680 / GIB, 3)
    # in use: 1 GiB + 0.25 GiB + 1000/1024 GiB = 2.2265625 GiB
    assert by_term["in use (peak + outside PyTorch)"]["GiB"] == 2.227
    assert by_term["device total (nvidia-smi)"]["GiB"] == 15.0
    assert "CPU tracker" in str(by_term["allocated peak (max_memory_allocated)"]["basis"])
    assert device.peak_status("cpu").startswith("verified by measurement")
    # two GPUs of DDP: one NCCL communicator, 544 MiB to 1638 MiB (nccl issues #964, #864)
    ddp = {
        r["term"]: r
        for r in device.device_rows(GIB, get_gpu("t4-16gb"), calc.Parallelism(dp=2), "cuda")
    }
    assert (ddp["outside PyTorch: nccl"]["low GiB"], ddp["outside PyTorch: nccl"]["GiB"]) == (
        round(544 / 1024, 3),
        round(1638 / 1024, 3),
    )


def test_reserved_rows_and_markdown() -> None:
    fit = DeviceFit(setting="default", allocated_bytes=GIB, reserved_bytes=2 * GIB, segments=3,
                    outside_bytes=GIB // 2, total_bytes=3 * GIB)  # fmt: skip
    (row,) = device.reserved_rows([fit])
    # nvidia-smi would show reserved + outside = 2.5 GiB of 3 GiB: fits
    assert (row["nvidia-smi GiB"], row["fits"]) == (2.5, True)
    table = device.markdown_table([{"a": 0.25, "b": "x|y"}])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 0.250 | x\\|y |"]
    assert device.markdown_table([]) == ""
