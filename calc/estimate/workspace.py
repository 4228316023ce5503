"""The cuBLAS workspace PyTorch allocates per (handle, stream), by GPU architecture.

torch 2.13, ``aten/src/ATen/cuda/CublasHandlePool.cpp`` (``parseChosenWorkspaceSize``,
``getChosenWorkspaceSize``, ``setWorkspaceForHandle``; the 2.13 wheel's
``include/ATen/cuda/CUDAContextLight.h`` declares the ``cublas_handle_stream_to_workspace`` map
keyed by (handle, stream), so the forward's thread and the autograd engine's device thread
each get one):

* CUDA: ``CUBLAS_WORKSPACE_CONFIG``'s default ``:4096:2:16:8`` = 4096 KiB x 2 + 16 KiB x 8 =
  8,519,680 bytes, except compute capability major 9, 10 and 12 (Hopper, Blackwell):
  4096 KiB x 8 = 32 MiB ("32MiB for Hopper and Blackwell").
* ROCm: 32 MiB, 128 MiB on gfx94x/gfx95x (MI300).
* cuBLASLt: with ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` (the default on open-source CUDA builds:
  the note of ``torch.backends.cuda.blas_workspace_size`` in the 2.13 wheel) it reuses the
  cuBLAS allocation, so it adds nothing (``unified_cublas_and_lt_workspaces`` decides both the
  size and the pointer in 2.13). Older torch read the variable for the size only and gave each
  thread that runs an Lt GEMM (addmm with a bias) its own ``CUBLASLT_WORKSPACE_SIZE`` = 1 MiB
  workspace: measured on an H200 with torch 2.11 (+1 MiB, verify/measurements/superseded/);
  not charged, as calc models 2.13. On ROCm hipBLASLt keeps its own workspace (76 MiB,
  ``parseCUDABlasLtWorkspaceSize``) when it runs a GEMM: not charged (which GEMMs take
  hipBLASLt is not modelled).

`calc.estimate.core` charges the Hopper size when no GPU is named; `for_gpu` moves an
estimate to a named GPU's size (a constant on every allocation, so the peak stays where it is).
"""

from __future__ import annotations

from dataclasses import replace

from calc.config.jobs import Inference, Training
from calc.data.gpus import GPU
from calc.estimate.core import CUBLAS_WORKSPACE_BYTES, _device_terms
from calc.estimate.result import Estimate

KIB = 1024
SMALL_WORKSPACE_BYTES = 4096 * KIB * 2 + 16 * KIB * 8
"""``:4096:2:16:8``: the default before Hopper."""
LARGE_WORKSPACE_MAJORS = (9, 10, 12)
"""Compute capability majors that get 32 MiB (``use32mb``)."""
ROCM_WORKSPACE_BYTES = 32 * KIB * KIB
ROCM_MI300_WORKSPACE_BYTES = 128 * KIB * KIB
ROCM_LARGE_PREFIXES = ("gfx94", "gfx95")


def cublas_workspace_bytes(gpu: GPU | None) -> int:
    """Bytes of one cuBLAS (hipBLAS) workspace on ``gpu``; Hopper's when ``gpu`` is None or
    its architecture is not in the catalog."""
    if gpu is None:
        return CUBLAS_WORKSPACE_BYTES
    if gpu.gfx_arch:
        large = gpu.gfx_arch.startswith(ROCM_LARGE_PREFIXES)
        return ROCM_MI300_WORKSPACE_BYTES if large else ROCM_WORKSPACE_BYTES
    major = gpu.cc_major
    if major is None:
        return CUBLAS_WORKSPACE_BYTES
    return CUBLAS_WORKSPACE_BYTES if major in LARGE_WORKSPACE_MAJORS else SMALL_WORKSPACE_BYTES


def workspace_charge(job: Training | Inference, device: str) -> int:
    """Bytes of cuBLAS workspaces the default (Hopper) charge adds for ``job`` on ``device``."""
    return _device_terms(job, device)[0]


def gpu_delta_bytes(job: Training | Inference, device: str, gpu: GPU) -> int:
    """Bytes ``gpu``'s cuBLAS workspaces add to (negative: take off) the default Hopper charge
    for ``job`` on ``device``: handles x (``cublas_workspace_bytes(gpu)`` - 32 MiB), 0 off
    CUDA. A constant on every allocation (what `for_gpu` adds; the planner adds it to its
    vectorised peaks, `calc.plan.engine`)."""
    charged = workspace_charge(job, device)
    if not charged:
        return 0
    return (
        charged // CUBLAS_WORKSPACE_BYTES * (cublas_workspace_bytes(gpu) - CUBLAS_WORKSPACE_BYTES)
    )


def for_gpu(est: Estimate, job: Training | Inference, gpu: GPU) -> Estimate:
    """``est`` (a ``device="cuda"`` estimate, charged Hopper's workspaces) with ``gpu``'s
    workspace size instead: every total, phase and rank peak moves by the same constant."""
    charged = workspace_charge(job, est.device)
    if not charged:
        return est
    handles = charged // CUBLAS_WORKSPACE_BYTES
    size = cublas_workspace_bytes(gpu)
    delta = gpu_delta_bytes(job, est.device, gpu)
    arch = gpu.compute_capability or gpu.gfx_arch or "unknown"
    note = f"cuBLAS workspaces: {handles} x {size:,} B ({gpu.id}, {arch}; from PyTorch's source)"
    old_breakdown, old_expr, old_peak_expr = (
        est.breakdown_fn,
        est.expression_fn,
        est.peak_expression_fn,
    )

    def breakdown() -> dict[str, int]:
        tree = dict(old_breakdown())
        for key in ("cuda/cublas_workspace", "cuda", "total"):
            tree[key] = tree.get(key, 0) + delta
        return tree

    return replace(
        est,
        peak_bytes=est.peak_bytes + delta,
        phases={phase: v + delta for phase, v in est.phases.items()},
        rank_peaks={rank: v + delta for rank, v in est.rank_peaks.items()},
        breakdown_fn=breakdown,
        expression_fn=lambda: old_expr() + delta,
        peak_expression_fn=lambda: old_peak_expr() + delta,
        notes=tuple(note if n.startswith("cuBLAS workspaces") else n for n in est.notes),
    )
