"""FSDP1 (``FullyShardedDataParallel``) on one rank, written by hand: Lightning's FSDPStrategy.

What LitGPT's ``finetune/full.py`` runs on several devices (lightning 2.5 ``FSDPStrategy``):
``FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
use_orig_params=True, limit_all_gathers=True)``, ``FULL_SHARD``, the ``MixedPrecision`` of
``FSDPPrecision`` with every dtype the model's own (``bf16-true``, ``32-true``: no cast), so
each block is one flat parameter and the rest (embedding, final norm, head) the root's.
PyTorch 2.13, ``torch/distributed/fsdp/_flat_param.py`` and ``_runtime_utils.py``, N ranks:

* **layout** (``FlatParamHandle._init_flat_param_and_metadata``): a unit's parameters in
  registration order, each start aligned to 16 bytes (``use_orig_params`` aligns addresses:
  ``_get_aligned_numel``), the total padded to a multiple of N; each rank keeps one
  contiguous ``total / N`` piece (the sharded flat parameter), and each original parameter is
  a view of whatever part of it falls in that piece (none where it falls outside);
* **unshard** (``_alloc_padded_unsharded_flat_param``): the whole flat parameter, one storage
  ``resize_``d to ``total`` elements; a block's at its pre-forward, freed at its post-forward;
  the root's at its pre-forward, kept through the backward (the root is never resharded after
  forward, ``_post_forward_reshard``);
* **backward**: the root's pre-backward (the gradient reaching the model's output) prefetches
  the last block (``BACKWARD_PRE``); each block's pre-backward prefetches the one before. The
  parameters' gradients (views' gradients, one tensor each) wait in the flat parameter's split
  node until the unit's last one arrives, then ``cat`` makes the flat gradient (``total``
  elements) and they go. The post-backward hook then frees the unsharded parameter and,
  syncing, reduce-scatters: a new ``total / N`` sharded gradient (``_get_reduce_scatter_tensors``:
  ``empty_like(chunk)``; no padding copy: the total is already a multiple of N), and the flat
  gradient goes. The root's runs last, after the embedding's backward;
* **no_sync** (Lightning's ``no_backward_sync`` while accumulating): the post-backward frees the
  unsharded parameter and keeps the flat gradient (``_use_unsharded_grad_views``: the original
  parameters' ``.grad`` become views of it); a later micro-batch adds its flat gradient in
  place (``AccumulateGrad``). In the syncing micro-batch the reduce-scatter's input is that
  accumulated gradient, freed as the post-backward returns (measured: the views do not keep
  it, ``dist-lit-fsdp1-accum2-4layers-2``);
* **optimizer**: each original parameter with elements on this rank steps its view of the
  sharded flat parameter, its gradient a view of the sharded gradient; the pieces cut the
  parameters differently on each rank, so `calc.estimate.ranks` replays every rank.

The root's post-backward and the final callback run inside the autograd engine, while
``torch.autograd.backward`` still holds the seed (`end_backward` is ``Tape.backward``'s
``final``: measured, 512 B with a one-sequence step). The model the units wrap is verified
by the ``dist-lit-fsdp1-*`` cases (torch's own FSDP1 on 2 gloo ranks, exact in every phase).

Not modelled: a unit whose alignment or rank padding is not zero gets its padding gradient as a
``zeros`` tensor before the ``cat`` (the split node's undefined outputs); the sharded gradients
outlive ``zero_grad`` until the next forward's root pre-forward (``_reset_flat_param_grad_info_
if_needed``), where nothing is allocated in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import sympy as sp

from calc.replay.tape import Size, Tape, Tensor

ALIGNMENT_BYTES = 16
"""``_get_aligned_numel``'s ``ALIGNMENT``: each original parameter starts 16-byte aligned."""


def _ceil_to(n: Size, m: int) -> Size:
    if isinstance(n, int):
        return -(-n // m) * m
    return sp.ceiling(n / m) * m


def flat_layout(numels: Sequence[Size], itemsize: int, n: int) -> tuple[list[Size], Size]:
    """Each parameter's start in the flat parameter and the padded total (module docstring):
    starts aligned to `ALIGNMENT_BYTES`, the total a multiple of ``n``."""
    align = max(1, ALIGNMENT_BYTES // itemsize)
    starts: list[Size] = []
    end: Size = 0
    for numel in numels:
        start = _ceil_to(end, align) if starts else 0
        starts.append(start)
        end = start + numel
    return starts, _ceil_to(end, n)


def local_numel(start: Size, numel: Size, piece: Size, rank: int) -> Size:
    """Elements of a parameter at ``[start, start + numel)`` in rank ``rank``'s piece
    ``[rank * piece, (rank + 1) * piece)`` (0 where they do not meet)."""
    lo, hi = rank * piece, (rank + 1) * piece
    if all(isinstance(x, int) for x in (start, numel, piece)):
        return max(0, min(start + numel, hi) - max(start, lo))
    return sp.Max(0, sp.Min(start + numel, hi) - sp.Max(start, lo))


@dataclass(eq=False)
class Unit:
    """One flat parameter: its original parameters (leaves, hidden: only the flat storages
    count) and what exists of it now."""

    tag: object
    leaves: list[Tensor]
    starts: list[Size]
    total: Size
    piece: Size
    """This rank's elements of it: ``total / N``."""
    itemsize: int
    unsharded: Tensor | None = None
    """The unsharded flat parameter while it exists."""
    flat_grad: Tensor | None = None
    """The unsharded flat gradient kept under ``no_sync`` (accumulated in place)."""
    grad_shard: Tensor | None = None
    """``_saved_grad_shard``: the reduce-scattered gradient of this step."""
    local: list[Size] = field(default_factory=list)
    """Each original parameter's elements on this rank."""


@dataclass(eq=False)
class Fsdp1:
    """FSDP1's hooks on the tape (module docstring); the same calls as `calc.parallel.fsdp.Fsdp`."""

    n: int
    rank: int = 0
    units: dict = field(default_factory=dict)  # tag -> Unit ("root" for the root)
    order: list = field(default_factory=list)  # forward order of the blocks' tags
    sync: bool = True
    """Whether this micro-batch's backward reduces (False: under ``no_sync``)."""
    opt_grads: dict = field(default_factory=dict)  # leaf storage id -> sharded gradient view

    def _unit_tag(self, tag: object) -> object:
        return tag if isinstance(tag, int) else "root"

    def install(self, tape: Tape, params: Sequence[Tensor], shapes: Sequence[tuple]) -> None:
        """Flatten and shard: per unit, the rank's piece of the flat parameter exists (kind
        ``weight``) and the original parameters' own storages are hidden for good."""
        del shapes  # flat: only the element counts matter
        grouped: dict[object, list[Tensor]] = {}
        for p in params:
            grouped.setdefault(self._unit_tag(p.storage.tag), []).append(p)
        for tag, leaves in grouped.items():
            itemsize = leaves[0].itemsize
            starts, total = flat_layout([p.numel for p in leaves], itemsize, self.n)
            piece = total // self.n if isinstance(total, int) else total / self.n
            local = [
                local_numel(a, p.numel, piece, self.rank)
                for a, p in zip(starts, leaves, strict=True)
            ]
            self.units[tag] = Unit(tag, leaves, starts, total, piece, itemsize, local=local)
            tape.existing(piece, itemsize, f"fsdp1.flat_param[{tag}]", "weight", tag=tag)
            for p in leaves:
                tape.hide(p.storage, p.name)
        tape.segment_hook = self.on_segment

    def optimizer_params(self, tape: Tape, params: Sequence[Tensor]) -> list[Tensor]:
        """Each original parameter as the view of this rank's piece it is (its local elements)."""
        out = []
        for p in params:
            u = self.units[self._unit_tag(p.storage.tag)]
            out.append(tape.alias(p, numel=u.local[u.leaves.index(p)]))
        return out

    # ------------------------------------------------------------------ parameters

    def _unshard(self, tape: Tape, u: Unit | None) -> None:
        if u is None or u.unsharded is not None:
            return
        u.unsharded = tape.new(u.total, u.itemsize, f"fsdp1.unsharded[{u.tag}]", "weight", u.tag)

    def _reshard(self, tape: Tape, u: Unit) -> None:
        if u.unsharded is not None:
            tape.drop(u.unsharded)
            u.unsharded = None

    # ------------------------------------------------------------------ gradients

    def _post_backward(self, tape: Tape, u: Unit | None) -> None:
        """The split node's ``cat``, then the post-backward hook (module docstring)."""
        if u is None:
            return
        grads = [tape.grads.pop(id(p.storage), None) for p in u.leaves]
        if all(g is None for g in grads):
            self._reshard(tape, u)
            return
        flat = tape.new(u.total, u.itemsize, f"fsdp1.flat_grad[{u.tag}]", "grad", u.tag)
        tape.drop(*grads)
        if u.flat_grad is not None:  # AccumulateGrad: grad += new, in place
            tape.drop(flat)
            flat = u.flat_grad
        self._reshard(tape, u)
        if not self.sync:
            u.flat_grad = flat
            return
        shard = tape.new(u.piece, u.itemsize, f"fsdp1.grad_shard[{u.tag}]", "grad", u.tag)
        u.grad_shard = shard  # one syncing backward per step: none to add to
        u.flat_grad = None
        tape.drop(flat)

    def before_optimizer(self, tape: Tape) -> None:
        """The original parameters' ``.grad``: views of the sharded gradients."""
        tape.grads.update(self.opt_grads)
        self.opt_grads = {}

    # ------------------------------------------------------------------ hooks

    def on_segment(self, tape: Tape, old: object, new: object) -> None:
        """Pre/post-forward of the blocks in the forward; post-backward of the block left and
        pre-backward (with its prefetch) of the block entered in the backward."""
        if tape.phase.endswith("/forward") and tape.grad_enabled:
            if isinstance(old, int):
                self._reshard(tape, self.units[old])
            if isinstance(new, int):
                if new not in self.order:
                    self.order.append(new)
                self._unshard(tape, self.units[new])
            return
        if not tape.phase.endswith("/backward") or tape.grad_enabled:
            return
        if isinstance(old, int):
            self._post_backward(tape, self.units[old])
        if isinstance(new, int):
            self._unshard(tape, self.units[new])
            i = self.order.index(new)
            if i > 0:
                self._unshard(tape, self.units[self.order[i - 1]])

    def start_forward(self, tape: Tape) -> None:
        """The root's pre-forward (the model called): unshard the root."""
        self._unshard(tape, self.units.get("root"))

    def end_forward(self, tape: Tape) -> None:
        """The root's post-forward: nothing (the root stays unsharded)."""
        del tape

    def start_backward(self, tape: Tape) -> None:
        """The root's pre-backward: prefetch the last block."""
        self._unshard(tape, self.units.get("root"))
        if self.order:
            self._unshard(tape, self.units[self.order[-1]])

    def end_backward(self, tape: Tape) -> None:
        """The root's post-backward, then the final callback: syncing, the original
        parameters' gradients become views of the sharded gradients."""
        self._post_backward(tape, self.units.get("root"))
        if not self.sync:
            return
        for u in self.units.values():
            if u.grad_shard is None:
                continue
            for p, numel in zip(u.leaves, u.local, strict=True):
                self.opt_grads[id(p.storage)] = tape.alias(u.grad_shard, numel=numel)
            tape.drop(u.grad_shard)
            u.grad_shard = None
