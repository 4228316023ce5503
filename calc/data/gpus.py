"""The GPU catalog: each GPU's memory, as the vendor states it and as PyTorch can use it.

The catalog is a data file, ``hardware/gpus.json`` (read by ``calc.data.cards``, the one module of
``calc`` that reads files). Units are explicit: vendors sell memory in "GB" that, for HBM and
GDDR parts, is a binary capacity (an "80 GB" H100 carries 80 GiB = 80 x 2**30 bytes of DRAM),
while the driver keeps part of it; ``total_bytes`` is what ``cudaMemGetInfo`` / ``nvidia-smi``
report as total, ``usable_bytes`` what ``torch.cuda.memory_reserved`` can reach: the total
less the memory outside PyTorch's allocator (``reserved_bytes``: the driver's reservation and
the CUDA context, `calc.data.outside`, each at the upper end of what its sources support).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from calc.config.parallelism import Parallelism
from calc.data.cards import load_gpu_catalog_data
from calc.data.outside import Outside, communicators, nccl_term, outside_pytorch
from calc.units import GIB

_ARCH = ("compute_capability", "compute_capability_source", "gfx_arch", "gfx_arch_source")
"""The optional architecture fields of a catalog GPU."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GPU:
    """One GPU model of the catalog."""

    id: str
    """Catalog id, lower-case (``h100-80gb``)."""
    name: str
    """Vendor's product name (``NVIDIA H100 80GB HBM3 (SXM5)``)."""
    vendor: str
    """``nvidia`` or ``amd``."""
    marketed: str
    """Capacity as the vendor's datasheet writes it (``80 GB HBM3``)."""
    total_bytes: int
    """Device memory total as the driver reports it (``cudaMemGetInfo`` total,
    ``nvidia-smi`` "Total" x 2**20, ``rocm-smi`` VRAM total), in bytes."""
    cuda_total_bytes: int | None = None
    """Total as the CUDA runtime reports it to a process (``cudaMemGetInfo`` / PyTorch's
    ``total_memory``, "total capacity of X GiB", vLLM's "total_gpu_memory"), a little below
    ``nvidia-smi``'s: what vLLM's ``gpu_memory_utilization`` multiplies. ``None`` where no
    published reading is known (``calc.serve(gpu=...)`` then refuses)."""
    cuda_total_source: str = ""
    """Where ``cuda_total_bytes`` comes from (a cited log line)."""
    reserved_bytes: int
    """Bytes of ``total_bytes`` PyTorch's allocator cannot hand out on one GPU: the driver's
    reservation and the CUDA/HIP context with its kernel images. The catalog fills it with
    `calc.data.outside`'s upper end (``outside().high_bytes``)."""
    source: str
    """Where ``total_bytes`` comes from (a cited nvidia-smi/rocm-smi reading)."""
    marketed_source: str = ""
    """Where ``marketed`` comes from (the vendor's datasheet or product page)."""
    compute_capability: str = ""
    """NVIDIA's compute capability, ``major.minor`` (``9.0`` for Hopper); empty for AMD. Decides
    PyTorch's CUDA-side defaults (`calc.estimate.workspace`)."""
    compute_capability_source: str = ""
    """Where ``compute_capability`` comes from (NVIDIA's CUDA GPUs page)."""
    gfx_arch: str = ""
    """AMD's LLVM target (``gfx942``); empty for NVIDIA."""
    gfx_arch_source: str = ""
    """Where ``gfx_arch`` comes from (AMD's ROCm GPU specifications)."""

    def __post_init__(self) -> None:
        for name in (
            "id", "name", "vendor", "marketed", "source", "marketed_source",
            "cuda_total_source", *_ARCH,
        ):  # fmt: skip
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a string")
        if not self.id or self.id != self.id.lower():
            raise ValueError(f"id={self.id!r} must be a non-empty lower-case string")
        for name in ("total_bytes", "reserved_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer (bytes)")
        cuda = self.cuda_total_bytes
        if cuda is not None and (
            isinstance(cuda, bool) or not isinstance(cuda, int) or not 0 < cuda <= self.total_bytes
        ):
            raise ValueError(
                f"cuda_total_bytes={cuda!r} must be None or an integer in [1, total_bytes]"
            )
        cc = self.compute_capability
        if cc and not (cc.count(".") == 1 and all(p.isdigit() for p in cc.split("."))):
            raise ValueError(f"compute_capability={cc!r} must be 'major.minor' (e.g. '9.0')")
        if self.gfx_arch and not self.gfx_arch.startswith("gfx"):
            raise ValueError(f"gfx_arch={self.gfx_arch!r} must be an LLVM target 'gfx...'")
        if self.reserved_bytes >= self.total_bytes:
            raise ValueError(
                f"reserved_bytes={self.reserved_bytes} must be below total_bytes={self.total_bytes}"
            )

    @property
    def cc_major(self) -> int | None:
        """The compute capability's major number (9 for Hopper), or None (AMD, or not given)."""
        return int(self.compute_capability.split(".")[0]) if self.compute_capability else None

    @property
    def usable_bytes(self) -> int:
        """Bytes a job's ``max_memory_allocated`` may reach: ``total - reserved``."""
        return self.total_bytes - self.reserved_bytes

    def outside(self, parallel: Parallelism | None = None) -> Outside:
        """The memory outside PyTorch's allocator of one rank, term by term with its sources
        (`calc.data.outside`; NCCL's communicators when ``parallel`` spans several GPUs)."""
        return outside_pytorch(self.total_bytes, self.cuda_total_bytes, parallel)

    def usable_for(self, parallel: Parallelism | None = None) -> int:
        """Bytes PyTorch's allocator may reserve on one rank of ``parallel``: ``usable_bytes``
        less the upper end of its NCCL communicators' buffers (`calc.data.outside`)."""
        count = communicators(parallel)
        return self.usable_bytes - (nccl_term(count).high_bytes if count else 0)

    @property
    def usable_gib(self) -> float:
        """``usable_bytes`` in GiB (2**30 bytes)."""
        return self.usable_bytes / GIB


_FIELDS = ("id", "name", "vendor", "marketed", "total_bytes", "source")
_OPTIONAL = ("marketed_source", "cuda_total_source", *_ARCH)


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GPU]:
    """Every GPU of ``hardware/gpus.json``, by id, smallest usable memory first."""
    rows = load_gpu_catalog_data().get("gpus")
    if not isinstance(rows, list):
        raise ValueError("hardware/gpus.json: 'gpus' must be a list of GPU objects")
    gpus = []
    for row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"hardware/gpus.json: each GPU must be an object, got {row!r}")
        fields: dict[str, Any] = {name: row.get(name) for name in _FIELDS}  # GPU checks them
        fields.update({name: str(row[name]) for name in _OPTIONAL if name in row})
        fields["cuda_total_bytes"] = row.get("cuda_total_bytes")  # GPU checks it
        fields["reserved_bytes"] = _outside_bytes(fields)
        gpus.append(GPU(**fields))
    gpus.sort(key=lambda g: (g.usable_bytes, g.id))
    return {g.id: g for g in gpus}


def _outside_bytes(fields: dict[str, Any]) -> int:
    """The upper end of `calc.data.outside` for a catalog row (0 where its totals are not
    integers: `GPU` then names the bad field)."""
    total, cuda = fields["total_bytes"], fields["cuda_total_bytes"]
    if not isinstance(total, int) or not (cuda is None or isinstance(cuda, int)):
        return 0
    return outside_pytorch(total, cuda).high_bytes


DEFAULT_GPU = "h100-80gb"
"""The GPU a verdict uses when none is named: the same in the CLI, the planner and the web app."""


def get_gpu(gpu_id: str) -> GPU:
    """The catalog GPU ``gpu_id`` (case-insensitive); ``ValueError`` lists the known ids."""
    catalog = gpu_catalog()
    key = gpu_id.strip().lower() if isinstance(gpu_id, str) else gpu_id
    if key not in catalog:
        raise ValueError(f"gpu={gpu_id!r} is not in the GPU catalog; known: {', '.join(catalog)}")
    return catalog[key]
