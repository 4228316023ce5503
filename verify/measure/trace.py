"""An allocation trace: every storage a step allocates and frees, in order, with the op behind it.

A debugging aid beside the tracker: when a prediction misses, the trace shows the event where
the measured and predicted timelines part. ``python -m verify.measure.trace CASE`` prints it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BLOCK_BYTES = 512


def round_block(nbytes: int) -> int:
    """Bytes the CUDA caching allocator charges for a request (c10 kMinBlockSize = 512)."""
    return 0 if nbytes == 0 else -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One allocation (positive bytes) or free (negative bytes) and the live total after it."""

    op: str
    delta_bytes: int
    live_bytes: int
    shape: tuple[int, ...]
    dtype: str
    phase: str


class AllocationTrace(TorchDispatchMode):
    """Records every new storage an op returns and the moment each one is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[TraceEvent] = []
        self.live_bytes = 0
        self.phase = ""
        self._known: dict[int, tuple[int, tuple[int, ...], str]] = {}

    def ignore(self, *tensors: torch.Tensor) -> None:
        """Storages alive before the step (parameters, inputs): never reported."""
        for x in tensors:
            self._known[x.untyped_storage()._cdata] = (0, (), "base")

    def mark(self, phase: str) -> None:
        self.phase = phase

    def _free(self, key: int, op: str) -> None:
        size, shape, made_by = self._known.pop(key, (0, (), ""))
        if size:
            self.live_bytes -= size
            self.events.append(
                TraceEvent(f"free<{made_by}>", -size, self.live_bytes, shape, "", self.phase)
            )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        if name == "lift_fresh":  # torch.tensor(data): its storage was made outside dispatch,
            return out  # which the CPU tracker does not count either (a "late" storage)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self._known:
                continue
            size = round_block(st.nbytes())
            self._known[key] = (size, tuple(t.shape), name)
            weakref.finalize(st, self._free, key, "free")
            if size:
                self.live_bytes += size
                self.events.append(
                    TraceEvent(
                        name, size, self.live_bytes, tuple(t.shape), str(t.dtype), self.phase
                    )
                )
        return out

    def print(self, limit: int | None = None) -> None:
        for e in self.events[:limit]:
            print(
                f"{e.phase:9s} {e.op:40s} {e.delta_bytes:+12d} {e.live_bytes:12d} {e.shape} {e.dtype}"
            )
