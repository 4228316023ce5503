"""The GPU catalog (`calc.data.gpus`, data in hardware/gpus.json) against the published figures.

Totals are the driver-reported totals cited in the catalog: nvidia-smi's "Total" in MiB
(x 2**20 bytes) or rocm-smi's VRAM total in bytes. modal-labs/modal-client PR #2797 also
states the H100's total in bytes, 85,520,809,984 = 81559 MiB, which checks the unit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calc.data.gpus import GPU, get_gpu, gpu_catalog

MIB = 2**20
GIB = 2**30
PUBLISHED_TOTAL_BYTES = {
    "h200-141gb": 143771 * MIB,  # nvidia-smi on this project's H200 machine
    "h100-80gb": 85_520_809_984,  # modal-labs/modal-client PR #2797, in bytes
    "a100-80gb": 81920 * MIB,  # modal-labs/modal-client PR #2797
    "a100-40gb": 40960 * MIB,  # modal-labs/modal-client PR #2797
    "l40s-48gb": 46068 * MIB,  # modal-labs/modal-client PR #2797
    "a10-24gb": 23028 * MIB,  # modal-labs/modal-client PR #2797
    "t4-16gb": 15360 * MIB,  # modal-labs/modal-client PR #2797
    "rtx4090-24gb": 24564 * MIB,  # RLinf/RLinf issue #255
    "rtx3090-24gb": 24576 * MIB,  # noonghunna/club-3090 issue #1128
    "mi300x-192gb": 206_141_652_992,  # ROCm/legacy-rocm-build issue #4750 (rocm-smi, bytes)
}
MARKETED_GB = {
    "h200-141gb": "141", "h100-80gb": "80", "a100-80gb": "80", "a100-40gb": "40",
    "l40s-48gb": "48", "a10-24gb": "24", "t4-16gb": "16", "rtx4090-24gb": "24",
    "rtx3090-24gb": "24", "mi300x-192gb": "192",
}  # fmt: skip


def test_catalog_holds_the_gpus_the_issue_names_with_published_totals() -> None:
    catalog = gpu_catalog()
    assert set(PUBLISHED_TOTAL_BYTES) <= set(catalog)
    for gpu_id, total in PUBLISHED_TOTAL_BYTES.items():
        gpu = catalog[gpu_id]
        assert gpu.total_bytes == total, gpu_id
        assert gpu.marketed.startswith(MARKETED_GB[gpu_id] + " GB"), gpu_id
        assert gpu.source and gpu.marketed_source  # every figure is cited


def test_usable_is_total_less_reserved_and_catalog_is_sorted() -> None:
    catalog = list(gpu_catalog().values())
    for gpu in catalog:
        assert gpu.usable_bytes == gpu.total_bytes - gpu.reserved_bytes
        assert 0 < gpu.usable_bytes < gpu.total_bytes
    usable = [g.usable_bytes for g in catalog]
    assert usable == sorted(usable)
    # H100: the total less the driver's reservation (nvidia-smi 81559 MiB less PyTorch's
    # "total capacity of 79.11 GiB", vllm-project/vllm issue #27508) is 79.11 GiB; less the
    # CUDA context's upper end, ">1000MB" (pytorch/pytorch issue #107667): 79.11 GiB - 1000 MiB
    assert get_gpu("h100-80gb").usable_bytes == round(79.11 * GIB) - 1000 * MIB


def test_lookup_is_case_insensitive_and_names_known_ids() -> None:
    assert get_gpu(" H100-80GB ").id == "h100-80gb"
    with pytest.raises(ValueError, match="h100-80gb"):
        get_gpu("h300")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"id": "H100"}, "id"),
        ({"name": None}, "name"),
        ({"total_bytes": -1}, "total_bytes"),
        ({"reserved_bytes": 1.5}, "reserved_bytes"),
        ({"reserved_bytes": 10 * GIB, "total_bytes": GIB}, "reserved_bytes"),
    ],
)
def test_bad_gpu_fields_raise_naming_the_field(changes: dict, field: str) -> None:
    fields = dict(id="x", name="x", vendor="nvidia", marketed="1 GB", total_bytes=2 * GIB,
                  reserved_bytes=GIB, source="test")  # fmt: skip
    fields.update(changes)
    with pytest.raises(ValueError, match=field):
        GPU(**fields)  # type: ignore[arg-type]


PUBLISHED_CUDA_TOTAL_GIB = {
    "h100-80gb": 79.11,  # vllm-project/vllm issue #27508: "a total capacity of 79.11 GiB"
    "a100-80gb": 79.25,  # HiDream-ai/VAREdit issue #6: "a total capacity of 79.25 GiB"
    "a100-40gb": 39.50,  # TianheWu/CoSeR issue #10: "a total capacity of 39.50 GiB"
    "l40s-48gb": 44.40,  # QwenLM/Qwen3-VL issue #2097 (an L40): "a total capacity of 44.40 GiB"
    "rtx4090-24gb": 23.64,  # ali-vilab/VGen issue #104: "a total capacity of 23.64 GiB"
    "rtx3090-24gb": 23.58,  # vllm-project/vllm issue #10517: "total_gpu_memory=23.58GiB"
    "t4-16gb": 14.75,  # hpcaitech/Open-Sora issue #697: "a total capacity of 14.75 GiB"
}
MEASURED_H200 = (
    Path(__file__).resolve().parents[3] / "verify/measurements/nvidia-h200-2026-12-04.json"
)


def test_cuda_totals_are_the_published_readings() -> None:
    catalog = gpu_catalog()
    for gpu_id, gib in PUBLISHED_CUDA_TOTAL_GIB.items():
        gpu = catalog[gpu_id]
        assert gpu.cuda_total_bytes is not None
        assert abs(gpu.cuda_total_bytes / GIB - gib) < 0.005, gpu_id  # printed to 0.01 GiB
        assert gpu.cuda_total_source, gpu_id
    for gpu in catalog.values():  # a little below the driver's total, or unknown (None)
        if gpu.cuda_total_bytes is not None:
            assert 0.9 * gpu.total_bytes < gpu.cuda_total_bytes <= gpu.total_bytes, gpu.id
    # the H200's is this project's own measurement (verify/measurements/, probe stage "init")
    measured = json.loads(MEASURED_H200.read_text())["outside"]["stages"]
    init = next(s for s in measured if s["stage"] == "init")
    assert catalog["h200-141gb"].cuda_total_bytes == init["total_bytes"]


def test_cuda_total_is_validated() -> None:
    with pytest.raises(ValueError, match="cuda_total_bytes=200"):
        GPU(
            id="x", name="X", vendor="nvidia", marketed="1 GB", total_bytes=100,
            cuda_total_bytes=200, reserved_bytes=10, source="s",
        )  # fmt: skip
