"""Does the job fit as ``nvidia-smi`` would see it: reserved memory plus what lives outside
PyTorch, against the GPU's total, for both allocator settings.

``reserved_bytes`` is `Estimate.reserved` (the caching allocator's model). What lives outside
PyTorch's allocator (the driver's reservation, the CUDA context with its kernel images and
library handles: "does not include memory allocated outside of the caching allocator ... or
memory held by the driver", the allocator's out-of-memory message) is `calc.data.outside`'s
model, at the upper end of what its sources support (``GPU.reserved_bytes``). NCCL
communicator buffers are not included (the allocator is replayed for one GPU only).
"""

from __future__ import annotations

from dataclasses import dataclass

from calc.data.gpus import GPU
from calc.estimate.result import Estimate
from calc.replay.caching_allocator import AllocatorConfig

SETTINGS = {
    "default": AllocatorConfig(),
    "expandable_segments": AllocatorConfig(expandable_segments=True),
}
"""The two allocator settings the verdict shows (``PYTORCH_CUDA_ALLOC_CONF``)."""


@dataclass(frozen=True, slots=True)
class DeviceFit:
    """One allocator setting's verdict on one GPU."""

    setting: str
    """A key of ``SETTINGS``."""
    allocated_bytes: int
    """Predicted ``max_memory_allocated`` under this setting (unsplit blocks included)."""
    reserved_bytes: int
    """Predicted ``max_memory_reserved``."""
    segments: int
    """Segments the allocator made."""
    outside_bytes: int
    """Memory outside PyTorch's allocator (``GPU.reserved_bytes``: `calc.data.outside`'s
    upper end)."""
    total_bytes: int
    """The GPU's total as the driver reports it."""

    @property
    def shown_bytes(self) -> int:
        """What ``nvidia-smi`` would show in use: reserved plus outside."""
        return self.reserved_bytes + self.outside_bytes

    @property
    def fits(self) -> bool:
        return self.shown_bytes <= self.total_bytes


def device_fits(est: Estimate, gpu: GPU) -> list[DeviceFit]:
    """`DeviceFit` for each of ``SETTINGS`` (replays the allocator: seconds, not microseconds)."""
    out = []
    for name, config in SETTINGS.items():
        st = est.reserved(config)
        out.append(
            DeviceFit(
                setting=name,
                allocated_bytes=st.allocated_bytes,
                reserved_bytes=st.reserved_bytes,
                segments=st.segments,
                outside_bytes=gpu.reserved_bytes,
                total_bytes=gpu.total_bytes,
            )
        )
    return out
