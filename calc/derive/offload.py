"""transformers' activation offloading, recorded: ``activation_checkpointing_enable(offload=
True)`` (transformers 5.24, ``modeling_utils.py`` ``_activation_checkpointing_enable``) wraps
each checkpointed layer's call in ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: the
checkpoint's inputs (``_CheckpointFrame.save_inputs``) are copied to pinned host memory in the
forward and copied back (``packed.to(device)``, a new tensor of the input's size) when the
recomputation reads them. Everything the layer itself saves goes through the checkpoint's own
hooks, inside.

The recording swaps the ``save_on_cpu`` transformers calls for `_SaveOnHost`: the same pack and
unpack, the host copy made under `calc.derive.book.Book.host` (not counted, as host memory is not
the GPU's) and the copy back a ``clone`` (the device copy; on the fake CPU tensors the
recording runs, ``.to`` the same device would hand the host tensor back). torch is imported
inside: ``calc`` imports without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from calc.derive.book import Book


@contextlib.contextmanager
def save_on_host(book: Book) -> Iterator[None]:
    """While inside, transformers' ``save_on_cpu`` is `_SaveOnHost` over ``book``."""
    import torch
    import transformers.modeling_utils as modeling

    class _SaveOnHost(torch.autograd.graph.saved_tensors_hooks):
        """``save_on_cpu(pin_memory, device_type)`` with the host side not counted."""

        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            def pack(t: Any) -> tuple[Any, Any]:
                with book.host():  # torch.empty(t.size(), ..., pin_memory=True).copy_(t)
                    packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
                    packed.copy_(t)
                return (t.device, packed)

            def unpack(packed: tuple[Any, Any]) -> Any:
                return packed[1].clone()  # packed.to(device): the device copy

            super().__init__(pack, unpack)

    original = modeling.save_on_cpu
    setattr(modeling, "save_on_cpu", _SaveOnHost)  # noqa: B010 (a module's global, swapped)
    try:
        yield
    finally:
        setattr(modeling, "save_on_cpu", original)  # noqa: B010
