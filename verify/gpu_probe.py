"""What a CUDA process holds outside PyTorch's caching allocator, measured (issue 14).

``python -m verify.gpu_probe OUT.json`` (run by ``scripts/gpu_check.sh`` in its own process, before
any case) reads, at each stage, ``torch.cuda.mem_get_info()`` (the CUDA runtime's free and total
bytes, ``cudaMemGetInfo``) together with ``torch.cuda.memory_reserved()``: the device memory the
process uses outside the allocator is ``total - free - reserved`` (on a GPU no other process
uses). The stages:

* ``init``: after the first tensor on the device (the CUDA context, lazy module loading);
* ``cublas``: after an fp32, a bf16 and a tf32 matrix product (cuBLAS and cuBLASLt handles, their
  kernel images; the workspaces themselves go through the allocator and are in ``reserved``);
* ``kernels``: after a forward and backward of SDPA (each backend), layer norm, cross-entropy and
  a fused AdamW step (more kernel images loaded lazily);
* ``nccl``: after ``init_process_group("nccl")`` on one rank and a 4 MiB all-reduce (one rank:
  NCCL's fixed cost per communicator, not the ring buffers of several GPUs).

``calc.data.outside`` states these terms as ranges from published sources; the recorded file
lets the tests check those ranges against a measurement. Also recorded: ``nvidia-smi``'s
total/used/reserved and the environment (``CUDA_MODULE_LOADING``, versions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

SCHEMA = "vramplan-gpu-probe/1"
SMI_FIELDS = "name,driver_version,memory.total,memory.reserved,memory.used,memory.free"


def smi() -> dict[str, str]:
    """``nvidia-smi``'s reading of GPU 0 (MiB as printed), or the error it gave."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    return dict(zip(SMI_FIELDS.split(","), values, strict=False))


def reading(stage: str) -> dict[str, Any]:
    """One stage: free/total from the runtime, the allocator's reserved and allocated bytes,
    and the bytes outside the allocator (``total - free - reserved``)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    return {
        "stage": stage, "free_bytes": int(free), "total_bytes": int(total),
        "reserved_bytes": int(reserved), "allocated_bytes": int(allocated),
        "outside_bytes": int(total - free - reserved), "smi": smi(),
    }  # fmt: skip


def _matmuls() -> None:
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum().item()
    b = a.bfloat16()
    (b @ b).float().sum().item()
    torch.backends.cuda.matmul.allow_tf32 = True
    (a @ a).sum().item()
    torch.backends.cuda.matmul.allow_tf32 = False


def _kernels() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    for backend, dtype in (
        (SDPBackend.FLASH_ATTENTION, torch.bfloat16),
        (SDPBackend.EFFICIENT_ATTENTION, torch.float32),
        (SDPBackend.MATH, torch.float32),
    ):
        q = torch.randn(2, 4, 256, 64, device="cuda", dtype=dtype, requires_grad=True)
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1).sum().backward()
    x = torch.randn(64, 512, device="cuda", requires_grad=True)
    ln = torch.nn.LayerNorm(512, device="cuda")
    logits = torch.nn.Linear(512, 1000, device="cuda")(ln(x))
    F.cross_entropy(logits, torch.randint(0, 1000, (64,), device="cuda")).backward()
    opt = torch.optim.AdamW([x], fused=True)
    opt.step()
    torch.cuda.synchronize()


def _nccl() -> dict[str, Any]:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    out = reading("nccl")
    out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    dist.destroy_process_group()
    return out


def probe() -> dict[str, Any]:
    """Every stage in order (module docstring); a stage that raises is recorded with its error
    and the later ones still run."""
    stages: list[dict[str, Any]] = [{"stage": "before", "smi": smi()}]
    torch.empty(1, device="cuda")
    stages.append(reading("init"))
    steps: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("cublas", _matmuls), ("kernels", _kernels), ("nccl", _nccl),
    )  # fmt: skip
    for stage, fn in steps:
        try:
            result = fn()
            stages.append(result if isinstance(result, dict) else reading(stage))
        except Exception as exc:
            stages.append({"stage": stage, "error": f"{type(exc).__name__}: {exc}"})
    return {
        "schema": SCHEMA,
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", ""),
        "stages": stages,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m verify.gpu_probe OUT.json", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("verify.gpu_probe: no CUDA device is available", file=sys.stderr)
        return 2
    data = probe()
    Path(args[0]).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(data["stages"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
