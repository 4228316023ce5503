"""cuBLAS workspaces by GPU architecture (`calc.estimate.workspace`) and the catalog's compute
capabilities.

Expected values: compute capabilities as NVIDIA's "CUDA GPUs - Compute Capability" page lists
them (developer.nvidia.com/cuda-gpus) and AMD's ROCm GPU specifications (MI300X: gfx942); the
workspace sizes from ``parseChosenWorkspaceSize`` in ``aten/src/ATen/cuda/CublasHandlePool.cpp``:
``:4096:2:16:8`` = 4096 KiB * 2 + 16 KiB * 8 = 8,388,608 + 131,072 = 8,519,680 bytes before
Hopper, 4096 KiB * 8 = 33,554,432 bytes for majors 9, 10 and 12; ROCm 128 MiB on gfx94x.
"""

from __future__ import annotations

import dataclasses

import pytest

import calc
from calc.data.gpus import GPU, get_gpu, gpu_catalog
from calc.estimate.workspace import cublas_workspace_bytes
from tests.specs import tiny_llama

PUBLISHED_CC = {
    "t4-16gb": "7.5", "a10-24gb": "8.6", "rtx3090-24gb": "8.6", "rtx4090-24gb": "8.9",
    "a100-40gb": "8.0", "a100-80gb": "8.0", "l40s-48gb": "8.9", "h100-80gb": "9.0",
    "h200-141gb": "9.0",
}  # fmt: skip
SMALL = 8_519_680
LARGE = 33_554_432


def test_every_nvidia_gpu_has_its_published_compute_capability_and_amd_its_target() -> None:
    for gpu in gpu_catalog().values():
        if gpu.vendor == "nvidia":
            assert gpu.compute_capability == PUBLISHED_CC[gpu.id], gpu.id
            assert "cuda-gpus" in gpu.compute_capability_source
        else:
            assert gpu.gfx_arch == "gfx942" and gpu.compute_capability == ""


@pytest.mark.parametrize(
    ("gpu_id", "nbytes"),
    [("t4-16gb", SMALL), ("a100-80gb", SMALL), ("l40s-48gb", SMALL), ("h100-80gb", LARGE),
     ("h200-141gb", LARGE), ("mi300x-192gb", 128 * 2**20)],
)  # fmt: skip
def test_workspace_follows_the_compute_capability(gpu_id: str, nbytes: int) -> None:
    assert cublas_workspace_bytes(get_gpu(gpu_id)) == nbytes


def test_blackwell_and_no_gpu() -> None:
    h100 = get_gpu("h100-80gb")
    assert cublas_workspace_bytes(dataclasses.replace(h100, compute_capability="10.0")) == LARGE
    assert cublas_workspace_bytes(dataclasses.replace(h100, compute_capability="12.0")) == LARGE
    assert cublas_workspace_bytes(dataclasses.replace(h100, compute_capability="8.9")) == SMALL
    assert cublas_workspace_bytes(None) == LARGE  # the default charge: Hopper's


def test_bad_compute_capability_names_the_field() -> None:
    h100 = get_gpu("h100-80gb")
    with pytest.raises(ValueError, match="compute_capability"):
        dataclasses.replace(h100, compute_capability="9")
    with pytest.raises(ValueError, match="gfx_arch"):
        dataclasses.replace(h100, gfx_arch="942")


TINY = tiny_llama()  # hidden 16, 2 layers (tests/specs.py)


@pytest.mark.parametrize(("job", "handles"), [
    (calc.Training(micro_batch=1, seq_len=8), 2),  # forward thread + autograd device thread
    (calc.Inference(batch=1, context=8, implementation="reference"), 1),
])  # fmt: skip
def test_estimate_on_an_a100_charges_its_smaller_workspaces(job, handles: int) -> None:
    hopper = calc.estimate(TINY, job)
    a100 = calc.estimate(TINY, job, gpu="a100-80gb")
    delta = handles * (LARGE - SMALL)
    assert hopper.peak_bytes - a100.peak_bytes == delta
    assert a100.breakdown["cuda/cublas_workspace"] == handles * SMALL
    assert a100.breakdown["total"] == a100.peak_bytes
    assert all(hopper.phases[p] - a100.phases[p] == delta for p in hopper.phases)
    assert calc.estimate(TINY, job, gpu="h100-80gb").peak_bytes == hopper.peak_bytes
    cpu = calc.estimate(TINY, job, device="cpu", gpu="a100-80gb")
    assert cpu.peak_bytes == calc.estimate(TINY, job, device="cpu").peak_bytes


def test_parallel_estimate_moves_every_rank() -> None:
    job = calc.Training(micro_batch=1, seq_len=8)
    par = calc.Parallelism(dp=2)
    hopper = calc.estimate(TINY, job, par)
    t4 = calc.estimate(TINY, job, par, gpu="t4-16gb")
    delta = 2 * (LARGE - SMALL)
    assert {r: v - delta for r, v in hopper.rank_peaks.items()} == dict(t4.rank_peaks)


def test_unknown_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu"):
        calc.estimate(TINY, calc.Training(micro_batch=1, seq_len=8), gpu="v100")
    with pytest.raises(ValueError, match="gpu"):
        calc.estimate(TINY, calc.Training(micro_batch=1, seq_len=8), gpu=3)  # type: ignore[arg-type]


def test_gpu_type_is_the_catalog_class() -> None:
    assert isinstance(get_gpu("a10-24gb"), GPU)
