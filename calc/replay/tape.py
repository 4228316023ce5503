"""A symbolic replay of what PyTorch allocates and frees during one training step.

The model code is described op by op (``calc.models``): each op allocates its outputs, tells
autograd which tensors it saves, and names the tensors its backward formula allocates. This
module plays that description out the way eager PyTorch does:

* a storage is live while a Python reference or an autograd saved-variable holds it
  (``torch/csrc/autograd/saved_variable.cpp``); views share their base's storage;
* every storage is charged ``round_block(nbytes)``: ``max(512, ceil(n/512)*512)``, the CUDA
  caching allocator's ``round_size`` (``c10/cuda/CUDACachingAllocator.cpp``, ``kMinBlockSize``);
* backward runs nodes in the autograd engine's order: among ready nodes, the highest sequence
  number first (``torch/csrc/autograd/engine.cpp``, ``ReadyQueue``); a node allocates its input
  gradients, then drops the incoming gradient, then releases its saved variables
  (``Engine::evaluate_function`` -> ``fn.release_variables()``); gradients reaching one input
  from several consumers are summed in place when one of them is unshared, else out of place
  (``torch/csrc/autograd/input_buffer.cpp``, ``accumulate``); ``AccumulateGrad`` steals the
  first gradient of a leaf (``accumulate_grad.h``) and adds later ones in place.

Sizes are ints or sympy expressions; the same replay gives exact numbers or formulas.
The result is the ordered list of events with the multiset of live sizes after each, from which
`calc.replay.timeline` takes phase peaks.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Generic, Protocol, TypeVar, overload

import sympy as sp

from calc.replay.kinds import StorageKind

BLOCK_BYTES = 512
"""The CUDA caching allocator's ``kMinBlockSize``: every allocation is a multiple of it."""

Size = int | sp.Expr


def round_block(nbytes: Size) -> Size:
    """Bytes charged for a request of ``nbytes`` (``round_size`` in CUDACachingAllocator.cpp)."""
    if isinstance(nbytes, int):
        return 0 if nbytes == 0 else max(BLOCK_BYTES, -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES)
    return _round_symbolic(nbytes)


@lru_cache(maxsize=8192)
def _round_symbolic(nbytes: sp.Expr) -> sp.Expr:
    """``round_block`` of a size expression (memoised: a replay asks for the same few sizes in
    every layer, and building ``ceiling`` makes sympy simplify each time)."""
    return BLOCK_BYTES * sp.ceiling(nbytes / BLOCK_BYTES)


def divide(n: Size, k: int) -> Size:
    """``n / k`` as a size: an int when ``k`` divides an int ``n`` (never a float), else the
    exact quotient (sympy)."""
    if isinstance(n, int):
        return n // k if n % k == 0 else sp.Rational(n, k)
    return n / k


T = TypeVar("T")


class _Refiled(Generic[T]):
    """A field of `Storage` that is part of its ``key`` (kept in the slot ``_<field>``):
    setting it re-files a live storage in its tape's counts (`Storage._refile`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    @overload
    def __get__(self, st: None, owner: type | None = None) -> _Refiled[T]: ...
    @overload
    def __get__(self, st: Storage, owner: type | None = None) -> T: ...
    def __get__(self, st: Storage | None, owner: type | None = None) -> T | _Refiled[T]:
        return self if st is None else getattr(st, self.slot)

    def __set__(self, st: Storage, value: T) -> None:
        st._refile(self.slot, value)


class Storage:
    """One allocation: its charged bytes, name, category, and who holds it.

    While it is live its tape counts it under ``key`` (``_LiveSet.counts``); changing its name,
    category, layer tag or saved count re-files it there, so the tape never has to walk its
    live set to know it."""

    __slots__ = ("size", "_name", "_kind", "_tag", "refs", "_saved", "alive", "_owner")

    def __init__(self, size: Size, name: str, kind: StorageKind | str, tag: object) -> None:
        self.size = size  # rounded bytes
        self._name = name
        self._kind = StorageKind(kind)  # a value outside the closed set raises ValueError
        self._tag = tag
        self.refs = 0  # tensors (Python references, views, gradient buffers) on it
        self._saved = 0  # autograd saved-variable references
        self.alive = True
        self._owner: _LiveSet | None = None  # the live set counting it

    @property
    def key(self) -> tuple:
        """How the live set counts it: (category, name, tag, size); an activation an autograd
        node saves counts as ``saved``."""
        saved = self._saved > 0 and self._kind == StorageKind.ACT
        kind = StorageKind.SAVED if saved else self._kind
        return (kind, self._name, self._tag, self.size)

    def _refile(self, field_name: str, value: object) -> None:
        owner = self._owner
        if owner is None:
            setattr(self, field_name, value)
            return
        owner._uncount(self)
        setattr(self, field_name, value)
        owner._count(self)

    name: _Refiled[str] = _Refiled()
    kind: _Refiled[StorageKind | str] = _Refiled()  # filed as a StorageKind
    tag: _Refiled[object] = _Refiled()  # the segment (layer) that allocated it, or "base"

    @property
    def saved(self) -> int:
        return self._saved

    @saved.setter
    def saved(self, value: int) -> None:
        if self._owner is None or self._kind != StorageKind.ACT or (value > 0) == (self._saved > 0):
            self._saved = value  # the key does not change
            return
        self._refile("_saved", value)


class _LiveSet(dict):
    """The live storages by ``id``, with the count of each ``Storage.key`` kept up to date
    (``counts``, by key number: no zero entries), so an event's snapshot is one copy of it."""

    def __init__(self) -> None:
        super().__init__()
        self.key_table: list[tuple] = []
        """Every key counted so far, numbered in order of first appearance."""
        self._numbers: dict[tuple, int] = {}
        self.counts: dict[int, int] = {}
        """Key number -> live storages under it."""

    def _number(self, key: tuple) -> int:
        n = self._numbers.get(key)
        if n is None:
            n = self._numbers[key] = len(self.key_table)
            self.key_table.append(key)
        return n

    def _count(self, st: Storage) -> None:
        key = self._number(st.key)
        self.counts[key] = self.counts.get(key, 0) + 1

    def _uncount(self, st: Storage) -> None:
        key = self._number(st.key)
        left = self.counts[key] - 1
        if left:
            self.counts[key] = left
        else:
            del self.counts[key]

    def __setitem__(self, k: int, st: Storage) -> None:
        old = dict.get(self, k)
        if old is not None:
            self._uncount(old)
            old._owner = None
        dict.__setitem__(self, k, st)
        st._owner = self
        self._count(st)

    def __delitem__(self, k: int) -> None:
        self.pop(k)

    _MISSING = object()

    def pop(self, k: int, default: object = _MISSING) -> object:
        st = dict.pop(self, k, None)
        if st is None:
            if default is _LiveSet._MISSING:
                raise KeyError(k)
            return default
        self._uncount(st)
        st._owner = None
        return st

    def setdefault(self, *_: object) -> object:
        raise TypeError("_LiveSet: assign or pop storages one at a time")

    update = setdefault  # type: ignore[assignment]
    popitem = setdefault  # type: ignore[assignment]
    clear = setdefault  # type: ignore[assignment]


class Tensor:
    """A tensor in the replay: a storage plus its autograd identity (grad_fn or leaf)."""

    __slots__ = ("storage", "numel", "itemsize", "grad_fn", "out_index", "leaf", "dropped")

    def __init__(self, storage: Storage, numel: Size, itemsize: int, leaf: bool = False) -> None:
        self.storage = storage
        self.numel = numel
        self.itemsize = itemsize
        storage.refs += 1
        self.grad_fn: Node | None = None
        self.out_index = 0
        self.leaf = leaf
        self.dropped = False

    @property
    def size(self) -> Size:
        return self.storage.size

    @property
    def name(self) -> str:
        return self.storage.name

    def __repr__(self) -> str:
        return f"Tensor({self.storage.name}, {self.storage.size})"


CHECK_COUNTS = bool(os.environ.get("VRAMPLAN_CHECK_TAPE"))
"""With ``VRAMPLAN_CHECK_TAPE`` set, every event recounts the live set from scratch and checks
the incremental counts against it (tests/calc/replay/test_tape.py runs replays this way)."""

ACCUMULATE_SEQ = 1 << 62
"""AccumulateGrad's sequence number: the engine runs it as soon as it is ready."""

BackwardRule = Callable[["Tape", "Node", list], list]
"""``rule(tape, node, grads_out) -> grads_in``: allocates through ``tape``; returns one entry per
input edge, a Tensor it hands over (one reference each) or None."""


@dataclass(eq=False)
class Node:
    """An autograd node: its saved storages, its input edges and its backward rule."""

    seq: int
    name: str
    rule: BackwardRule
    edges: list  # per input: (Node, output index) | Tensor (a leaf needing grad) | None
    saved: list[Storage] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    n_outputs: int = 1


@dataclass(frozen=True, slots=True)
class Event:
    """The live set after one allocation or free."""

    label: str
    segment: object
    phase: str
    counts: tuple
    """((key number, count), ...): the live storages by ``keys[key number]``."""
    keys: list
    """The tape's table of keys (kind, name, tag, size), shared by its events."""

    @property
    def live(self) -> tuple:
        """((kind, name, tag, size), count) pairs."""
        return tuple((self.keys[k], c) for k, c in self.counts)


def _accumulate_grad_rule(tape: Tape, node: Node, grads: list) -> list:
    g = grads[0]
    if g is not None:
        tape.accumulate_into_grad(node.info["leaf"], g)
    return []


class SavedTensorHooks(Protocol):
    """Saved-tensor hooks around the forward that move saved tensors off the device
    (`calc.replay.offload.Offload`), as the tape's ``node``, ``checkpoint`` and engine call them."""

    active: bool
    pending: list

    def pack(self, tape: Tape, t: Tensor) -> object | None: ...
    def unpack(self, tape: Tape, node: Node, packed: list) -> list[Tensor]: ...
    def after_node(self, tape: Tape) -> None: ...
    def end_backward(self, tape: Tape) -> None: ...


class StopRecomputation(Exception):
    """Raised inside a recomputation once every saved tensor is back (early stop)."""


@dataclass(eq=False)
class Region:
    """One checkpointed call: its function, inputs held by the frame, and saved placeholders."""

    fn: Callable[[], Tensor]
    inputs: list
    autocast_itemsize: int
    placeholders: list = field(default_factory=list)  # (node, number of tensors it saves)
    recomputed: list = field(default_factory=list)  # storages, in save order
    n_saved: int = 0
    pending: set = field(default_factory=set)
    done: bool = False
    offloaded: list = field(default_factory=list)
    """Inputs the frame saved through activation offloading (`calc.replay.offload.Packed`)."""
    early_stop: bool = True
    """The recomputation stops once every saved tensor is back; False: it runs ``fn`` to the
    end (``checkpoint(early_stop=False)``, torchtitan's wrapper)."""
    policy: SavePolicy | None = None
    """Op-level selective checkpointing (``context_fn=create_selective_checkpoint_contexts``):
    which op outputs the forward keeps for the recomputation (`Tape.op_outputs`)."""
    calls: Counter = field(default_factory=Counter)
    cache: dict = field(default_factory=dict)  # op -> [outputs of one call], first call first


SavePolicy = Callable[[str, int], bool]
"""``policy(op, n)``: whether the n-th call (from 1, counted per op, apart in the forward and the
recomputation) of aten ``op`` (``"mm"``, ``"sdpa"``, ...) is ``MUST_SAVE``."""


def _dependencies(fn: Node) -> Counter:
    """For every node reachable from ``fn``: how many edges lead to it (the engine's
    ``dependencies_``, ``compute_dependencies`` in engine.cpp)."""
    deps: Counter = Counter()
    seen = {id(fn)}
    stack = [fn]
    while stack:
        n = stack.pop()
        for e in n.edges:
            if isinstance(e, tuple):
                deps[id(e[0])] += 1
                if id(e[0]) not in seen:
                    seen.add(id(e[0]))
                    stack.append(e[0])
    return deps


class Tape:
    """Records allocations and frees; runs a backward pass over the recorded graph."""

    def __init__(self, inplace_accumulate: bool = True) -> None:
        """``inplace_accumulate=False`` replays a step run under a Python dispatch mode (the
        CPU tracker): every tensor then has a PyObject, so ``can_accumulate_inplace`` sees a
        use count of 2 and InputBuffer sums out of place (measured on torch 2.13; the profiler
        shows ``aten::add_`` without the mode and ``aten::add`` under any mode)."""
        self.inplace_accumulate = inplace_accumulate
        self.live: _LiveSet = _LiveSet()
        self.events: list[Event] = []
        self.segment_hook: Callable[[Tape, object, object], None] | None = None
        """Called with (old, new) when ``segment`` changes: FSDP's per-layer hooks
        (`calc.parallel.fsdp`)."""
        self._segment: object = None
        self.phase = "forward"
        self.grad_enabled = True
        self._seq = 0
        self.grads: dict[int, Tensor] = {}  # id(leaf storage) -> its .grad
        self.unstepped: set[int] = set()
        """Leaves (``id`` of their storage) no optimizer holds: their ``.grad`` stays through
        `zero_grad` and sums over the steps (litgpt's QLoRA ``StableEmbedding``)."""
        self.grad_any_size: set[int] = set()
        """Leaves (``id`` of their storage) whose ``.grad`` is the first gradient as it comes, even
        when its size differs from the leaf's (`calc.parallel.sequence.vocab_embedding`)."""
        self.autocast_itemsize = 0  # > 0 inside torch.autocast (2 for bf16/fp16)
        self.autocast_cache: dict[int, Tensor] = {}  # id(leaf storage) -> its cached cast
        self.region: Region | None = None  # the checkpointed forward being recorded
        self.recomputing: Region | None = None
        self._made: list[Tensor] = []
        self._accumulators: dict[int, Node] = {}
        self.leaves: dict[int, Tensor] = {}
        # Linears that do not run as a dense ``F.linear`` (calc.compress.lora, calc.compress.quant): weight
        # storage id -> hook(tape, x, bias, rows, out_features, name), and quantized weights.
        self.linear_hooks: dict[int, Callable] = {}
        self.quantized: dict[int, object] = {}
        self.kv_hook: Callable | None = (
            None  # quantized KV cache write/read (calc.compress.kv_quant)
        )
        self.grad_hook: Callable[[Tape, Tensor], None] | None = None
        """Called with the leaf once its ``.grad`` is set (a post-accumulate-grad hook: DDP's
        reducer, FSDP's reduce-scatter); see `calc.parallel.data`."""
        self.offload: SavedTensorHooks | None = None
        """Activation offloading's saved-tensor hooks (`calc.replay.offload`), when on."""

    @property
    def segment(self) -> object:
        """The layer (int) or part (``embed``, ``head``, ...) the replay is in."""
        return self._segment

    @segment.setter
    def segment(self, value: object) -> None:
        old, self._segment = self._segment, value
        if self.segment_hook is not None and old != value:
            self.segment_hook(self, old, value)

    def hide(self, st: Storage, label: str) -> None:
        """``st.untyped_storage().resize_(0)``: its bytes are freed while tensors still refer
        to it (FSDP's resharded parameters)."""
        if self.live.pop(id(st), None) is not None:
            self._record(f"-{label}")

    def unhide(self, st: Storage, label: str) -> None:
        """``resize_`` back to full size (FSDP's all-gathered parameters)."""
        if id(st) not in self.live:
            self.live[id(st)] = st
            self._record(f"+{label}")

    # -- allocation -------------------------------------------------------------------------
    def _record(self, label: str) -> None:
        event = Event(
            label, self.segment, self.phase, tuple(self.live.counts.items()), self.live.key_table
        )
        if CHECK_COUNTS:
            counts: Counter = Counter(st.key for st in self.live.values())
            assert Counter(dict(event.live)) == counts, f"live-set counts out of date at {label}"
        self.events.append(event)

    def new(
        self,
        numel: Size,
        itemsize: int,
        name: str,
        kind: StorageKind | str = StorageKind.ACT,
        tag: object = None,
    ) -> Tensor:
        """Allocate ``numel`` elements of ``itemsize`` bytes (rounded) and return its tensor.

        ``tag`` (default: the current segment) says which layer the storage belongs to."""
        st = Storage(
            round_block(numel * itemsize), name, kind, self.segment if tag is None else tag
        )
        t = Tensor(st, numel, itemsize)
        if self.recomputing is not None:
            self._made.append(t)
        if st.size == 0:
            st.alive = False
            return t
        self.live[id(st)] = st
        self._record(f"+{name}")
        return t

    def existing(
        self,
        numel: Size,
        itemsize: int,
        name: str,
        kind: StorageKind | str,
        leaf: bool = False,
        tag: object = "base",
    ) -> Tensor:
        """A storage alive before the replay starts (weights, inputs): no event."""
        st = Storage(round_block(numel * itemsize), name, kind, tag)
        self.live[id(st)] = st
        t = Tensor(st, numel, itemsize, leaf)
        if leaf:
            self.leaves[id(st)] = t
        return t

    def revive(self, st: Storage, numel: Size, itemsize: int) -> Tensor:
        """A freed storage allocated again with the same bytes, name and category (a tensor
        brought back from the host into the object the replay's code still refers to)."""
        assert not st.alive and st.refs == 0 and st.saved == 0, st.name
        st.alive = True
        self.live[id(st)] = st
        self._record(f"+{st.name}")
        return Tensor(st, numel, itemsize)

    def forget_existing(self, t: Tensor) -> None:
        """A storage declared with `existing` that the model does not hold after all (a dense
        weight replaced by its quantized form before the run): gone, without an event."""
        st = t.storage
        st.alive = False
        self.live.pop(id(st), None)
        self.leaves.pop(id(st), None)

    def alias(
        self, t: Tensor, node: Node | None = None, out_index: int = 0, numel: Size | None = None
    ) -> Tensor:
        """A view of ``t`` (same storage), with ``node`` as its grad_fn."""
        v = Tensor(t.storage, t.numel if numel is None else numel, t.itemsize)
        if self.recomputing is not None:
            self._made.append(v)
        v.grad_fn = node
        v.out_index = out_index
        return v

    def drop(self, *tensors: Tensor | None) -> None:
        """Tensors going away (a Python local dying, a buffer consumed)."""
        for t in tensors:
            if t is None:
                continue
            assert not t.dropped, f"{t} dropped twice"
            t.dropped = True
            t.storage.refs -= 1
            self._maybe_free(t.storage)

    def release_grad(self, grads: list, index: int) -> None:
        """Inside a backward rule: release the incoming gradient ``grads[index]`` now rather
        than after the rule. For a piece of several equal ops replayed as one, each of which
        trades its incoming gradient for a smaller or equal one: their transients stay below
        the first op's, which the caller replays on its own (`calc.compress.litgpt_lora`)."""
        g = grads[index]
        if g is not None:
            self.drop(g)
            grads[index] = None

    def _maybe_free(self, st: Storage) -> None:
        if st.alive and st.refs <= 0 and st.saved <= 0:
            st.alive = False
            if self.live.pop(id(st), None) is not None:
                self._record(f"-{st.name}")

    # -- autograd graph ---------------------------------------------------------------------
    def node(
        self,
        name: str,
        rule: BackwardRule,
        inputs: Sequence[Tensor | None],
        saved: Sequence[Tensor | None] = (),
        n_outputs: int = 1,
        **info: object,
    ) -> Node | None:
        """Create the grad_fn of an op whose differentiable inputs are ``inputs``.

        Returns None (and saves nothing) when no input needs a gradient or grad mode is off.
        ``saved`` entries that are None are skipped (a guarded save that did not happen).
        """
        edges = [self._edge(t) for t in inputs]
        if not self.grad_enabled or all(e is None for e in edges):
            return None
        self._seq += 1
        n = Node(self._seq, name, rule, edges, [], dict(info), n_outputs)
        n.info["segment"] = self.segment  # backward runs the node in its layer's segment
        n.info["in_meta"] = [None if x is None else (x.numel, x.itemsize) for x in inputs]
        saves = [t for t in saved if t is not None]
        if self.region is not None:  # checkpointed forward: saved tensors are not kept
            if saves:
                n.info["region"] = self.region
                self.region.placeholders.append((n, len(saves)))
            return n
        if self.recomputing is not None:  # recomputation: saves go to the checkpoint frame
            reg = self.recomputing
            for t in saves:
                t.storage.saved += 1
                reg.recomputed.append(t.storage)
            if reg.early_stop and len(reg.recomputed) >= reg.n_saved:
                # Inputs are packed before the op runs, outputs after: the ops call node()
                # before allocating outputs they do not save and after those they save, so
                # stopping here leaves exactly what PyTorch has made.
                raise StopRecomputation
            return n
        off = self.offload
        for t in saves:
            packed = off.pack(self, t) if off is not None and off.active else None
            if packed is not None:  # on the host: the graph keeps no device reference
                n.info.setdefault("offloaded", []).append(packed)
                continue
            t.storage.saved += 1
            n.saved.append(t.storage)
        return n

    def output(self, t: Tensor, node: Node | None, out_index: int = 0) -> Tensor:
        t.grad_fn = node
        t.out_index = out_index
        return t

    # -- activation checkpointing -----------------------------------------------------------
    def checkpoint(
        self,
        fn: Callable[[], Tensor],
        inputs: Sequence[Tensor],
        early_stop: bool = True,
        policy: SavePolicy | None = None,
    ) -> Tensor:
        """``torch.utils.checkpoint(fn, *inputs, use_reentrant=False, early_stop=...)``.

        Forward: ``fn`` runs with saved tensors replaced by placeholders (nothing kept); the
        checkpoint frame holds ``inputs``. Backward: the first node of the region to run
        triggers the recomputation of ``fn``, which keeps every tensor it saves and, with
        ``early_stop`` (torch's default), stops as soon as the last one is made
        (``_StopRecomputationError``); each recomputed tensor is then released by the node that
        saved it, as usual (``torch/utils/checkpoint.py``, ``_checkpoint_hook``,
        ``unpack_hook``). ``policy``: op-level selective checkpointing (`op_outputs`).
        """
        if policy is not None and early_stop:
            raise NotImplementedError("op-level checkpointing is replayed without early stop")
        reg = Region(
            fn, [self.alias(t) for t in inputs], self.autocast_itemsize,
            early_stop=early_stop, policy=policy,
        )  # fmt: skip
        off = self.offload
        if off is not None and off.active and self.region is None:
            kept = []
            for t in reg.inputs:  # ``_CheckpointFrame.save_inputs``: a saved tensor each
                packed = off.pack(self, t)
                if packed is None:
                    kept.append(t)
                else:
                    reg.offloaded.append(packed)
                    self.drop(t)
            reg.inputs = kept
        outer, self.region = self.region, reg
        try:
            out = fn()
        finally:
            self.region = outer
        reg.n_saved = sum(count for _, count in reg.placeholders)
        reg.pending = {id(n) for n, _ in reg.placeholders}
        if not reg.pending:
            self.drop(*reg.inputs)
            for outputs in reg.cache.values():  # the frame and its policy's storage go
                for kept in outputs:
                    self.drop(*kept)
            reg.cache.clear()
        return out

    def op_outputs(self, op: str, make: Callable[[], list[Tensor | None]]) -> list[Tensor | None]:
        """The outputs of one call of aten ``op``, which ``make`` allocates.

        Under op-level selective checkpointing (``Region.policy``) a ``MUST_SAVE`` call's
        outputs are also kept by the policy's storage through the forward (a detached alias
        each, ``_CachingTorchDispatchMode``); the recomputation pops them instead of running the
        op, so ``make`` allocates nothing then (``_CachedTorchDispatchMode``,
        ``torch/utils/checkpoint.py``). Every other call runs ``make``."""
        reg = self.region if self.region is not None else self.recomputing
        if reg is None or reg.policy is None:
            return make()
        recomputing = self.region is None
        reg.calls[recomputing, op] += 1
        if not reg.policy(op, reg.calls[recomputing, op]):
            return make()
        if recomputing:
            outs = reg.cache[op].pop(0)
            self._made.extend(t for t in outs if t is not None)
            return outs
        outs = make()
        kept = [None if t is None else Tensor(t.storage, t.numel, t.itemsize) for t in outs]
        reg.cache.setdefault(op, []).append(kept)
        return outs

    def keep_after_recompute(self, t: Tensor) -> None:
        """``t``, made during a recomputation, is held beyond it (a module attribute a forward
        pre-hook set): not one of the recomputation's locals."""
        self._made = [m for m in self._made if m is not t]

    def _recompute(self, reg: Region, n: Node) -> None:
        reg.done = True
        held = []  # ``frame.get_inputs()``: the unpack hook's local ``args``
        if reg.offloaded:
            assert self.offload is not None
            held = [self.alias(t) for t in self.offload.unpack(self, n, reg.offloaded)]
        self.recomputing = reg
        made_before = self._made
        self._made = []
        grad_before, self.grad_enabled = self.grad_enabled, True
        ac_before, cache_before = self.autocast_itemsize, self.autocast_cache
        self.autocast_itemsize, self.autocast_cache = reg.autocast_itemsize, {}
        try:
            reg.fn()
        except StopRecomputation:
            pass
        finally:
            self.recomputing = None
            self.grad_enabled = grad_before
        self.autocast_exit()
        self.autocast_itemsize, self.autocast_cache = ac_before, cache_before
        leftovers, self._made = self._made, made_before
        self.drop(*[t for t in leftovers if not t.dropped])  # the recomputation's locals
        self.drop(*held)
        it = iter(reg.recomputed)
        for n, count in reg.placeholders:
            n.saved.extend(next(it) for _ in range(count))

    def _region_node_done(self, n: Node) -> None:
        reg = n.info["region"]
        reg.pending.discard(id(n))
        if not reg.pending:
            self.drop(*reg.inputs)

    def _edge(self, t: Tensor | None) -> tuple | None:
        if t is None:
            return None
        if t.grad_fn is not None:
            return (t.grad_fn, t.out_index)
        if not t.leaf:
            return None
        acc = self._accumulators.get(id(t.storage))
        if acc is None:
            # One AccumulateGrad node per leaf, highest priority (sequence_nr UINT64_MAX):
            # a leaf used twice (a tied head) has its two gradients summed in its InputBuffer
            # before AccumulateGrad runs.
            info = {"leaf": t, "segment": t.storage.tag}
            acc = Node(ACCUMULATE_SEQ, "AccumulateGrad", _accumulate_grad_rule, [], [], info)
            self._accumulators[id(t.storage)] = acc
        return (acc, 0)

    @staticmethod
    def needs_grad(t: Tensor | None) -> bool:
        return t is not None and (t.grad_fn is not None or t.leaf)

    # -- backward ---------------------------------------------------------------------------
    def backward(
        self, root: Tensor, seed: Tensor | None = None,
        final: Callable[[Tape], None] | None = None,
    ) -> None:  # fmt: skip
        """``root.backward()``: seed with ``ones_like(root)``, held by Python throughout
        (``torch.autograd.backward`` keeps ``grad_tensors``), and run the engine.
        ``seed``: ``root.backward(seed)`` with a gradient the caller holds (a pipeline stage's
        received gradient); it is not freed here. ``final``: what runs as the engine finishes,
        the seed still held (hooks and callbacks queued on the graph task: FSDP1's root
        post-backward and final callback)."""
        fn = root.grad_fn
        assert fn is not None
        deps = _dependencies(fn)
        own_seed = seed is None
        if seed is None:
            seed = self.new(root.numel, root.itemsize, "grad_seed")
        buffers: dict[int, list] = {id(fn): [self.alias(seed)]}
        ready = [fn]
        self.grad_enabled = False
        while ready:
            ready.sort(key=lambda n: n.seq)
            n = ready.pop()
            grads_in = self._run_node(n, buffers.pop(id(n), None))
            self._deliver(n, grads_in, buffers)
            for e in n.edges:
                if isinstance(e, tuple):
                    deps[id(e[0])] -= 1
                    if deps[id(e[0])] == 0:
                        ready.append(e[0])
        self.grad_enabled = True
        if self.offload is not None:
            self.offload.end_backward(self)
        if final is not None:
            final(self)
        if own_seed:
            self.drop(seed)

    def _run_node(self, n: Node, grads_out: list | None) -> list:
        """Run one node in its layer's segment (recomputing its checkpointed region first):
        its rule, then ``validate_outputs``, then the incoming gradients and its saved
        variables are released. Returns the gradients for its input edges."""
        self.segment = n.info.get("segment", self.segment)
        reg = n.info.get("region")
        if reg is not None and not reg.done:
            self._recompute(reg, n)
        packed = n.info.get("offloaded")
        if packed:  # the unpack hooks, as the formula reads its saved variables
            assert self.offload is not None
            self.offload.unpack(self, n, packed)
        grads_out = grads_out or [None] * n.n_outputs
        grads_in = n.rule(self, n, grads_out)
        assert len(grads_in) == len(n.edges), n.name
        if reg is not None:
            # Recomputed tensors are handed out by the unpack hook and live only in the
            # formula's locals: freed when it ends, before validate_outputs.
            self.formula_done(n)
        grads_in = self._validate_outputs(n, grads_in)
        if self.offload is not None and self.offload.pending:
            self.offload.after_node(self)  # the node's post-hooks
        self.drop(*grads_out)
        self._release(n)
        n.info["ran"] = True
        if reg is not None:
            self._region_node_done(n)
        return grads_in

    def _deliver(self, n: Node, grads_in: list, buffers: dict[int, list]) -> None:
        """Hand each input gradient to the node its edge leads to (summed into that node's
        InputBuffer); a gradient for an edge that needs none is dropped."""
        for e, g in zip(n.edges, grads_in, strict=True):
            if g is None:
                continue
            if e is None:
                self.drop(g)
            else:
                target, index = e
                buf = buffers.setdefault(id(target), [None] * target.n_outputs)
                buf[index] = self._accumulate(buf[index], g)

    def formula_done(self, n: Node) -> None:
        """The backward formula's locals holding saved tensors go out of scope. For recomputed
        (checkpointed) tensors those locals were the last references (the unpack hook handed
        them over); ordinary saved variables stay until ``release_variables``."""
        if "region" in n.info:
            self._release(n)

    def free_graph(self, t: Tensor) -> None:
        """The last reference to the graph behind ``t`` dies without a backward through it (an
        output left out of the loss, dropped the next iteration): every node reachable from
        its ``grad_fn`` and not run by a backward releases what it saves; the walk stops at
        the nodes a backward ran (the graph the loss reached, already released)."""
        stack, seen = [t.grad_fn], set()
        while stack:
            n = stack.pop()
            if n is None or id(n) in seen or n.info.get("ran"):
                continue
            seen.add(id(n))
            self._release(n)
            stack.extend(e[0] for e in n.edges if isinstance(e, tuple))

    def _release(self, n: Node) -> None:
        """``release_variables()``: drop the node's saved-variable references."""
        for st in n.saved:
            st.saved -= 1
            self._maybe_free(st)
        n.saved = []

    def _validate_outputs(self, n: Node, grads: list) -> list:
        """``validate_outputs`` (engine.cpp): a gradient whose shape or dtype differs from its
        input's is reduced with ``sum_to`` or cast with ``.to(dtype)``: a new tensor each."""
        meta = n.info.get("in_meta")
        if meta is None:
            return grads
        out = []
        for g, m in zip(grads, meta, strict=True):
            if g is None or m is None or (g.itemsize == m[1] and bool(g.numel == m[0])):
                out.append(g)
                continue
            fixed = self.new(m[0], m[1], f"{g.name}.to_input")
            self.drop(g)
            out.append(fixed)
        return out

    def _accumulate(self, old: Tensor | None, new: Tensor) -> Tensor:
        """InputBuffer::accumulate with grad mode off: ``old.add_(new)`` when the buffered
        gradient is unshared, else ``old + new``."""
        if old is None:
            return new
        if self.inplace_accumulate and old.storage.refs == 1 and old.storage.saved == 0:
            self.drop(new)
            return old
        out = self.new(old.numel, old.itemsize, "grad_sum")
        self.drop(old, new)
        return out

    def accumulate_into_grad(self, leaf: Tensor, g: Tensor) -> None:
        """AccumulateGrad::accumulateGrad: steal an unshared first gradient (else copy it);
        add later ones in place (``variable_grad += new_grad``; in place even under a dispatch
        mode, measured). ``g`` is borrowed: the engine drops it after the node."""
        key = id(leaf.storage)
        if key in self.grads:
            return
        st = g.storage
        same = st.size == leaf.size or key in self.grad_any_size
        if st.refs == 1 and st.saved == 0 and same:
            st.kind, st.name, st.tag = StorageKind.GRAD, f"grad:{leaf.name}", leaf.storage.tag
            self.grads[key] = self.alias(g)
        else:
            self.grads[key] = self.new(
                leaf.numel, leaf.itemsize, f"grad:{leaf.name}", StorageKind.GRAD, leaf.storage.tag
            )
        if self.grad_hook is not None:
            self.grad_hook(self, leaf)

    def autocast_enter(self, itemsize: int) -> None:
        """``torch.autocast(dtype=...)`` entered: linears cast to ``itemsize`` bytes."""
        self.autocast_itemsize = itemsize

    @contextmanager
    def autocast_paused(self) -> Iterator[None]:
        """An op on inputs autocast has already cast: it runs in their dtype, so nothing in it
        casts again (the kernel autocast dispatches to)."""
        saved, self.autocast_itemsize = self.autocast_itemsize, 0
        try:
            yield
        finally:
            self.autocast_itemsize = saved

    def autocast_exit(self) -> None:
        """Leaving the outermost autocast clears the weight-cast cache
        (``torch/amp/autocast_mode.py``, ``clear_autocast_cache``)."""
        self.autocast_itemsize = 0
        cached = list(self.autocast_cache.values())
        self.autocast_cache = {}
        self.drop(*cached)

    def zero_grad(self) -> None:
        """``optimizer.zero_grad(set_to_none=True)``: every ``.grad`` goes but those of the
        leaves in `unstepped` (no optimizer holds them)."""
        grads = [g for key, g in self.grads.items() if key not in self.unstepped]
        self.grads = {key: g for key, g in self.grads.items() if key in self.unstepped}
        self.drop(*grads)
