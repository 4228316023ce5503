"""Activation offloading to the host, as torchtune's ``OffloadActivations`` does it.

torchtune 0.6.1, ``torchtune/training/_activation_offloading.py`` (the recipes'
``enable_activation_offloading``, ``get_act_offloading_ctx_manager``), with its defaults
(``use_streams=True``, ``max_fwd_stash_size=5``, ``min_offload_size=1024``):

* **pack** (a ``saved_tensors_hooks`` pack, lines 143-216): every tensor autograd saves under the
  context takes the next id. One of at least ``min_offload_size`` bytes (``element_size() *
  nelement()``) that is not an ``nn.Parameter`` is copied to the host and its id tracked; the
  graph keeps no device reference. With streams the device tensor is also put in a *forward
  stash* that keeps it alive until a tensor with an id ``max_fwd_stash_size`` higher is
  offloaded (lines 164-174, 199-203). A smaller tensor, or a parameter, is kept as autograd
  keeps it.
* **unpack** (``unpack_tensor_with_streams``, lines 233-353), in the backward node that reads
  it: a tensor still in the forward stash is handed back as it is; any other offloaded tensor
  is copied back to the device (a new allocation of its elements) and put in a *backward stash*.
  The first unpack in a new node notes the backward stash's ids; a post-hook on the node
  deletes them once the node has run, so a tensor brought back lives until the next node that
  brings one back has run. The hook also drops the whole forward stash, and drops the node's own
  tensor from the backward stash at once when its storage gained users meanwhile (a view, a
  recomputed saved tensor: ``record_stream``; it then lives as long as those). The end of the
  backward drops what is left (``queue_callback``, lines 241-252).
* ``NoOpManager`` (lines 356-371) around the output projection: the head's saved tensors stay
  on the device.

With checkpointing (the recipes require it, ``full_finetune_single_device.py`` lines 166-175),
the only tensors saved inside a checkpointed layer are the checkpoint's inputs
(``_CheckpointFrame.save_inputs``); what the layer saves goes through the checkpoint's own
hooks. `calc.replay.tape.Tape` calls this module from ``node``, ``checkpoint`` and its engine.

A size written with the replay's symbols is taken to be at least ``min_offload_size``: the
estimate refuses micro-batches too small for that (`MIN_TOKENS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sympy as sp

from calc.replay.kinds import StorageKind
from calc.replay.tape import Size, round_block

if TYPE_CHECKING:
    from calc.replay.tape import Node, Storage, Tape, Tensor

MIN_OFFLOAD_BYTES = 1024
"""``min_offload_size``'s default: smaller tensors stay on the device."""
MAX_FWD_STASH = 5
"""``max_fwd_stash_size``'s default."""
MIN_TOKENS = 256
"""Tokens per micro-batch from which every per-token tensor the offloaded region saves (the
4-byte per-row ``rstd`` of an RMSNorm being the smallest) reaches ``MIN_OFFLOAD_BYTES``."""


@dataclass(eq=False)
class Packed:
    """One offloaded saved tensor: its id and what its device copy allocates."""

    pid: int
    numel: Size
    itemsize: int
    name: str
    storage: Storage
    """The original's storage (reused for a checkpoint input brought back, so that the layer's
    recomputation works on it)."""


@dataclass(eq=False)
class Offload:
    """The state of one ``OffloadActivations`` context: ``active`` while the model's forward
    runs under it (off inside the ``NoOpManager`` of the output projection)."""

    active: bool = False
    next_id: int = 0
    fwd: dict[int, Tensor] = field(default_factory=dict)
    """The forward stash: id -> a reference to the device tensor."""
    bwd: dict[int, Tensor] = field(default_factory=dict)
    """The backward stash: id -> the tensor brought back."""
    node: object = None
    """The node of the last unpack that started a new node (``curr_autograd_node``)."""
    pending: list = field(default_factory=list)
    """Post-hooks of the running node: (own ids brought back, ids to delete after it)."""

    # -- forward ---------------------------------------------------------------------------
    def pack(self, tape: Tape, t: Tensor) -> Packed | None:
        """The pack hook on ``t``: a `Packed` when it goes to the host, else None (autograd
        keeps it)."""
        self.next_id += 1
        pid = self.next_id
        if not _qualifies(t):
            return None
        for old in list(self.fwd):
            if old > pid - MAX_FWD_STASH:
                break
            tape.drop(self.fwd.pop(old))
        self.fwd[pid] = tape.alias(t)
        return Packed(pid, t.numel, t.itemsize, t.storage.name, t.storage)

    # -- backward --------------------------------------------------------------------------
    def unpack(self, tape: Tape, node: Node, packed: list[Packed]) -> list[Tensor]:
        """The unpack hook for each of ``node``'s offloaded tensors, in order; returns the
        tensors handed back (held by the forward or the backward stash)."""
        own: list[int] = []
        prev: list[int] = []
        for p in packed:
            if node is not self.node:
                self.node = node
                prev = list(self.bwd)
            if p.pid in self.fwd:
                continue  # still on the device: handed back as it is
            st = p.storage
            if not st.alive and st.size == round_block(p.numel * p.itemsize):
                t = tape.revive(st, p.numel, p.itemsize)  # the original's bytes, made anew
            else:
                t = tape.new(p.numel, p.itemsize, f"{p.name}.unpacked", StorageKind.ACT)
            self.bwd[p.pid] = t
            own.append(p.pid)
        self.pending.append((own, prev))
        return [self.fwd.get(p.pid) or self.bwd[p.pid] for p in packed]

    def after_node(self, tape: Tape) -> None:
        """The post-hooks of the node that has just run."""
        hooks, self.pending = self.pending, []
        for own, prev in hooks:
            for pid in own:
                t = self.bwd.get(pid)
                if t is not None and (t.storage.refs > 1 or t.storage.saved > 0):
                    tape.drop(self.bwd.pop(pid))  # record_stream: lives as long as its users
            fwd = list(self.fwd.values())
            self.fwd.clear()
            tape.drop(*fwd)
            for pid in prev:
                if pid in self.bwd:
                    tape.drop(self.bwd.pop(pid))

    def end_backward(self, tape: Tape) -> None:
        """The callback queued at the first unpack: the backward stash is dropped."""
        left = list(self.bwd.values())
        self.bwd.clear()
        self.node = None
        tape.drop(*left)


def _qualifies(t: Tensor) -> bool:
    """At least ``MIN_OFFLOAD_BYTES`` (a symbolic size: yes, see `MIN_TOKENS`) and not a
    parameter, trained or frozen. The replay does not tell a parameter from a view of it (a
    transposed weight ``mm`` saves is not an ``nn.Parameter`` and would be offloaded); no linear
    saves under the recipe's context, whose head runs under ``NoOpManager`` and whose layers are
    checkpointed."""
    if t.storage.kind == StorageKind.WEIGHT:
        return False
    nbytes = sp.sympify(t.numel * t.itemsize)
    if nbytes.is_number:
        return bool(nbytes >= MIN_OFFLOAD_BYTES)
    return True
