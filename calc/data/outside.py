"""Memory outside PyTorch's caching allocator: what ``nvidia-smi`` shows beyond
``torch.cuda.memory_reserved()``, term by term, each with its source and its basis.

PyTorch's own words: the allocator's out-of-memory message counts "memory allocated by PyTorch"
and "does not include memory allocated outside of the caching allocator ... or memory held by
the driver" (``c10/cuda/CUDACachingAllocator.cpp``, ``DeviceCachingAllocator::malloc``'s
out-of-memory branch). The terms, per process on one GPU:

* **driver reservation**: ``nvidia-smi``'s total less the total the CUDA runtime reports to a
  process (``cudaMemGetInfo``): the catalog's two readings (`calc.data.gpus.GPU`), each printed
  to 0.01 GiB. Where the catalog has no CUDA reading, no source gives the figure: the range is
  0 to the largest difference the catalog's readings show.
* **CUDA context and kernel images**: no source gives a figure by GPU generation. Sources by
  module loading mode: lazy loading (CUDA 11.7+, ``CUDA_MODULE_LOADING=LAZY``; the default on
  Linux since CUDA 12.2 per NVIDIA's CUDA Programming Guide, "Lazy Loading", and set by PyTorch
  itself since 1.13 when the user does not, pytorch/pytorch PR #86509) measured 287,047,680 B
  after initialisation in that PR, against 666,632,192 B with eager loading. Kernels used later
  load then, so a training step's context grows above the first figure; eager loading of the
  same modules bounds it from above: "before CUDA 11.7, *all* kernels were loaded into the
  context ..., which took >1000MB" (a PyTorch maintainer, pytorch/pytorch issue #107667). So
  the lazy range is [287,047,680 B, 1000 MiB]; eager is [666,632,192 B, 1000 MiB] (the upper
  end a lower bound in that statement: stated as such). Older readings agree: 200-700 MB on
  CUDA 10.1 (issue #28113), 300-400 MB (issue #20532). This project's H200 run (CUDA 13.0,
  driver 580.159.04, verify/measurements/nvidia-h200-2026-12-04.json) measured 552,402,944 B
  after the first tensor and 787,283,968 B once cuBLAS and the attention, norm, loss and fused
  AdamW kernels were loaded: inside the range.
* **cuBLAS/cuDNN handles**: their workspaces go through PyTorch's allocator (counted in the
  peak, `calc.estimate.workspace`); the handles' own state and the libraries' kernel images are
  loaded into the context (inside the context's range). No source gives a separate figure.
* **NCCL**, per communicator (a ``ProcessGroupNCCL`` makes one per process group on its first
  collective, and one per pair of ranks for send/recv): buffers per channel and peer
  connection for the three protocols, NCCL's ``src/init.cc`` (``DEFAULT_BUFFSIZE`` 4 MiB
  = ``NCCL_BUFFSIZE``'s default, ``DEFAULT_LL_BUFFSIZE`` 8 x 512 x 8 x 16 B = 512 KiB,
  ``DEFAULT_LL128_BUFFSIZE`` 120 x 640 x 8 x 8 B = 4,915,200 B); "the memory usage is linearly
  tied to the number of channels", and a ring keeps 2 connections per channel "regardless of
  the scale" (NCCL maintainer, NVIDIA/nccl issue #864). Channels depend on the topology, so
  the figure comes from measurements: 544 MB for a 2-GPU group and 688 MB for larger groups
  on 4 x A100 NVLink after a 4 MB all-reduce (NVIDIA/nccl issue #964), about 1.6 GB for one
  communicator (issue #864). Range per communicator: [544 MiB, 1.6 GiB] (both readings taken
  as binary units, as ``nvidia-smi`` prints them). One rank alone (no ring peers) measured
  587,202,560 B on the H200 run (NCCL 2.28.9). The source's buffers alone at 32 channels,
  2 connections each: 32 x 2 x 9,633,792 B = 588 MiB, inside the range.

The verdict (``fits``) takes each range's upper end: it fits even if every term is at the top
of what the sources support.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from calc.config.parallelism import Parallelism
from calc.units import MIB

Basis = Literal["published reading", "published measurement", "source", "no source"]
"""Where a term's range comes from: the catalog's readings, a published measurement, a
library's source code, or none (the range is stated, not measured)."""
BASES: tuple[str, ...] = get_args(Basis)
ModuleLoading = Literal["lazy", "eager"]
"""``CUDA_MODULE_LOADING``: lazy (PyTorch's default since 1.13 with CUDA 11.7+) or eager."""
MODULE_LOADINGS: tuple[str, ...] = get_args(ModuleLoading)

CONTEXT_LAZY_INIT_BYTES = 287_047_680
"""The CUDA context after initialisation with lazy loading (pytorch/pytorch PR #86509)."""
CONTEXT_EAGER_INIT_BYTES = 666_632_192
"""The same with eager loading (pytorch/pytorch PR #86509)."""
CONTEXT_EAGER_BYTES = 1000 * MIB
"""">1000MB" with every kernel loaded (pytorch/pytorch issue #107667): the upper end."""
NCCL_BUFFSIZE_BYTES = 1 << 22
"""``DEFAULT_BUFFSIZE`` (``NCCL_BUFFSIZE``), NCCL ``src/init.cc``: the Simple protocol."""
NCCL_LL_BUFFSIZE_BYTES = 8 * 512 * 8 * 16
"""``DEFAULT_LL_BUFFSIZE``: lines per thread x max threads x steps x ``ncclLLFifoLine``."""
NCCL_LL128_BUFFSIZE_BYTES = 120 * 640 * 8 * 8
"""``DEFAULT_LL128_BUFFSIZE``: elements per thread x max threads x steps x 8 B."""
NCCL_COMMUNICATOR_LOW_BYTES = 544 * MIB
"""2-GPU group on 4 x A100 NVLink (NVIDIA/nccl issue #964)."""
NCCL_COMMUNICATOR_HIGH_BYTES = 1638 * MIB
"""About 1.6 GB for one communicator after an all-reduce (NVIDIA/nccl issue #864)."""
DRIVER_RESERVE_HIGH_BYTES = 768 * MIB
"""The largest ``nvidia-smi`` total less CUDA total among the catalog's readings (A100 80GB):
the upper end where a GPU has no CUDA reading."""


@dataclass(frozen=True, slots=True)
class OutsideTerm:
    """One term of the memory outside PyTorch's allocator, as a range."""

    key: str
    """Breakdown key (``cuda_context``, ``driver_reserved``, ``nccl``)."""
    low_bytes: int
    """Lower end of the range the sources support."""
    high_bytes: int
    """Upper end (what the verdict charges)."""
    basis: Basis
    """Where the range comes from (`BASES`)."""
    source: str
    """The source, cited."""

    def __post_init__(self) -> None:
        if not 0 <= self.low_bytes <= self.high_bytes:
            raise ValueError(
                f"low_bytes={self.low_bytes}, high_bytes={self.high_bytes} must satisfy "
                "0 <= low_bytes <= high_bytes"
            )
        if self.basis not in BASES:
            raise ValueError(f"basis={self.basis!r} must be one of {BASES}")


@dataclass(frozen=True, slots=True)
class Outside:
    """Every term outside PyTorch's allocator for one process on one GPU."""

    terms: tuple[OutsideTerm, ...]

    @property
    def low_bytes(self) -> int:
        return sum(t.low_bytes for t in self.terms)

    @property
    def high_bytes(self) -> int:
        """What the verdict charges: every term at the upper end of its range."""
        return sum(t.high_bytes for t in self.terms)


def driver_term(total_bytes: int, cuda_total_bytes: int | None) -> OutsideTerm:
    """``nvidia-smi``'s total less ``cudaMemGetInfo``'s (the catalog's readings); with no CUDA
    reading, 0 to `DRIVER_RESERVE_HIGH_BYTES`."""
    if cuda_total_bytes is None:
        return OutsideTerm(
            "driver_reserved", 0, DRIVER_RESERVE_HIGH_BYTES, "no source",
            "no CUDA total reading for this GPU: 0 to the largest difference of the catalog's "
            "readings (768 MiB, A100 80GB)",
        )  # fmt: skip
    diff = max(total_bytes - cuda_total_bytes, 0)
    return OutsideTerm(
        "driver_reserved", diff, diff, "published reading",
        "nvidia-smi total less the CUDA total (the GPU catalog's readings, to 0.01 GiB)",
    )  # fmt: skip


def context_term(loading: ModuleLoading = "lazy") -> OutsideTerm:
    """The CUDA context with its kernel images and library handles (module docstring)."""
    if loading not in MODULE_LOADINGS:
        raise ValueError(f"loading={loading!r} must be one of {MODULE_LOADINGS}")
    low = CONTEXT_LAZY_INIT_BYTES if loading == "lazy" else CONTEXT_EAGER_INIT_BYTES
    return OutsideTerm(
        "cuda_context", low, CONTEXT_EAGER_BYTES, "published measurement",
        f"CUDA context, {loading} module loading: {low:,} B after initialisation "
        "(pytorch/pytorch PR #86509) to >1000 MB with every kernel loaded (issue #107667); "
        "no figure by GPU generation is published",
    )  # fmt: skip


def nccl_buffer_bytes(channels: int, connections_per_channel: int = 2) -> int:
    """NCCL's default buffers of one communicator: ``channels x connections x (Simple + LL +
    LL128)`` (NCCL ``src/init.cc``); the ring's 2 connections per channel by default."""
    if channels < 1 or connections_per_channel < 1:
        raise ValueError(
            f"channels={channels}, connections_per_channel={connections_per_channel} must be >= 1"
        )
    per = NCCL_BUFFSIZE_BYTES + NCCL_LL_BUFFSIZE_BYTES + NCCL_LL128_BUFFSIZE_BYTES
    return channels * connections_per_channel * per


def communicators(parallel: Parallelism | None) -> int:
    """NCCL communicators one rank of ``parallel`` holds: one per parallel dimension of size
    > 1 (data, tensor, context), the data-parallel one shared by DDP, ZeRO and FSDP2, plus one
    per pipeline neighbour for send/recv (``ProcessGroupNCCL`` makes a 2-rank communicator per
    pair: two for a middle stage, the most-loaded case)."""
    if parallel is None:
        return 0
    data = (parallel.shard_world, parallel.dp_replicate)  # HSDP: one per mesh dimension
    dims = sum(1 for n in (*data, parallel.tp, parallel.cp) if n > 1)
    return dims + min(parallel.pp - 1, 2)


def nccl_term(count: int) -> OutsideTerm:
    """``count`` NCCL communicators, each in [544 MiB, 1.6 GiB] (module docstring)."""
    return OutsideTerm(
        "nccl", count * NCCL_COMMUNICATOR_LOW_BYTES, count * NCCL_COMMUNICATOR_HIGH_BYTES,
        "published measurement",
        f"{count} NCCL communicator(s), 544 MB (NVIDIA/nccl issue #964, 2 x A100) to 1.6 GB "
        "(issue #864) each; buffers per channel from NCCL's src/init.cc",
    )  # fmt: skip


def outside_pytorch(
    total_bytes: int,
    cuda_total_bytes: int | None,
    parallel: Parallelism | None = None,
    loading: ModuleLoading = "lazy",
) -> Outside:
    """The memory outside PyTorch's allocator of one rank (module docstring); NCCL only when
    ``parallel`` spans several GPUs."""
    terms = [driver_term(total_bytes, cuda_total_bytes), context_term(loading)]
    count = communicators(parallel)
    if count:
        terms.append(nccl_term(count))
    return Outside(tuple(terms))
