"""Activation offloading on the CPU tracker: torchtune's saved-tensor hooks and transformers'
``save_on_cpu``, with the host side made invisible.

torchtune 0.6.1's ``OffloadActivations`` (``torchtune/training/_activation_offloading.py``)
needs CUDA: it makes a side stream at construction and copies with ``.to("cuda")``. This is its
logic, written again for a CPU run, with the defaults the recipes use (``use_streams=True``,
``max_fwd_stash_size=5``, ``min_offload_size=1024``):

* pack: every saved tensor takes the next id; one of at least 1,024 bytes that is not an
  ``nn.Parameter`` (or ``nn.Buffer``) is copied to the host, and kept in the forward stash
  until one with an id five higher is offloaded; others are kept as they are;
* unpack, in the backward node reading it: from the forward stash as it is, else copied back (a
  new tensor) into the backward stash; the first unpack in a new node notes the backward
  stash's ids, and a post-hook registered on the node (``node.register_hook``) drops them
  after it runs, drops the whole forward stash, and drops the node's own tensor at once when
  its storage gained users (``torch._C._storage_Use_Count``: torchtune's ``record_stream``
  path); a callback queued on the engine drops the rest at the end of the backward;
* `NoOp` restores plain saving (torchtune's ``NoOpManager``, put around the output projection by
  ``get_act_offloading_ctx_manager``).

What differs: the host copy is made with the tracker's dispatch mode switched off
(``_disable_current_modes``), so it is not counted, as pinned host memory is not on a GPU; the
copy back is a ``clone`` of the host tensor, counted as the device copy ``.to("cuda")`` makes.
CUDA streams and events have nothing to order on the CPU and are left out.

transformers 5.24's ``activation_checkpointing_enable(offload=True)`` wraps each checkpointed
layer in ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (``modeling_utils.py``,
``_activation_checkpointing_enable``); `save_on_host_around` swaps that name for `SaveOnHost`:
``save_on_cpu``'s pack (an empty host tensor of the input's size, copied into) made outside the
tracker, its unpack (``packed.to(device)``) a counted ``clone``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import _disable_current_modes

MIN_OFFLOAD_BYTES = 1024
MAX_FWD_STASH = 5


class OffloadActivations(saved_tensors_hooks):
    """The context the recipe enters around the model's forward (``activations_handling_ctx``)."""

    def __init__(self) -> None:
        self.host: dict[int, tuple[torch.Tensor, bool]] = {}
        self.last_id = 0
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_stash: dict[int, torch.Tensor] = {}
        self.graph_id: int | None = None
        self.node: Any = None
        self.in_forward = True
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> int:
        self.in_forward = True
        self.last_id += 1
        tid = self.last_id
        small = t.element_size() * t.nelement() < MIN_OFFLOAD_BYTES
        if small or isinstance(t, nn.Parameter | nn.Buffer):
            self.host[tid] = (t, False)
            return tid
        for old in list(self.fwd_stash):
            if old > tid - MAX_FWD_STASH:
                break
            del self.fwd_stash[old]
        with _disable_current_modes():  # pinned host memory: not the device's
            copy = torch.empty_like(t, device="cpu")
            copy.copy_(t)
        self.host[tid] = (copy, True)
        self.fwd_stash[tid] = t
        return tid

    def _unpack(self, tid: int) -> torch.Tensor:
        if self.in_forward:  # the first unpack of this backward
            self.in_forward = False
            self.graph_id = torch._C._current_graph_task_id()
            engine = torch.autograd.variable.Variable._execution_engine
            engine.queue_callback(self.bwd_stash.clear)
        t, offloaded = self.host.pop(tid)
        if not offloaded:
            return t
        node = torch._C._current_autograd_node()
        prev: list[int] = []
        if torch._C._current_graph_task_id() == self.graph_id and self.node != node:
            self.node = node
            prev = list(self.bwd_stash)
        from_host = tid not in self.fwd_stash
        if from_host:
            t = t.clone()  # ``.to("cuda")``: a device copy
            self.bwd_stash[tid] = t
            users = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
        else:
            t = self.fwd_stash[tid]

        def hook(outputs: Any, inputs: Any) -> Any:
            if from_host:
                back = self.bwd_stash[tid]
                if torch._C._storage_Use_Count(back.untyped_storage()._cdata) > users:
                    del self.bwd_stash[tid]  # record_stream: lives as long as its users
                del back
            self.fwd_stash.clear()
            for old in prev:
                del self.bwd_stash[old]
            return outputs

        node.register_hook(hook)
        return t


class SaveOnHost(saved_tensors_hooks):
    """``save_on_cpu(pin_memory, device_type)`` with the host copy not counted."""

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        super().__init__(_to_host, _to_device)


def _to_host(t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    with _disable_current_modes():  # pinned host memory: not the device's
        packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
        packed.copy_(t)
    return (t.device, packed)


def _to_device(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    return packed[1].clone()  # ``packed.to(device)``: a device copy


def save_on_host_around(model: nn.Module) -> None:
    """While ``model``'s forward runs, transformers' checkpoint offloading makes `SaveOnHost`
    hooks (those made in the forward also unpack in the backward)."""
    import transformers.modeling_utils as modeling

    originals: list[Any] = []

    def enter(*_: Any) -> None:
        originals.append(modeling.save_on_cpu)
        modeling.save_on_cpu = SaveOnHost

    def leave(*_: Any) -> None:
        modeling.save_on_cpu = originals.pop()

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


class NoOp(saved_tensors_hooks):
    """torchtune's ``NoOpManager``: saved tensors kept as autograd keeps them."""

    def __init__(self) -> None:
        super().__init__(_same, _same)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
