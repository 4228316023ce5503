"""A CPU stand-in for ``torch.cuda.max_memory_allocated``: a dispatch mode that tracks storages.

`StorageTracker` follows every live tensor *storage* (never a tensor: views share one storage) and
counts each one rounded up to 512 bytes, the CUDA caching allocator's ``kMinBlockSize``
(``round_size`` in ``c10/cuda/CUDACachingAllocator.cpp``; an empty storage counts 0). The sum over
live storages is what ``torch.cuda.memory_allocated`` reports with ``expandable_segments:True``;
its running maximum stands in for ``max_memory_allocated``.

How storages are seen:

* allocations: every op output that reaches the mode (``__torch_dispatch__``); traceable wrapper
  subclasses such as DTensor are flattened to their inner local tensors;
* frees: a weakref on the Python ``UntypedStorage`` object, which PyTorch 2.13 keeps alive exactly
  as long as the ``StorageImpl``; the callback only queues the free, and the queue is drained
  before the next bookkeeping step, so a callback may arrive at any time, on any thread;
* size changes: mutating ops re-check their inputs' storages, and ``UntypedStorage.resize_`` (used
  by FSDP2 outside dispatch) is patched while the mode is active;
* storages that existed before: a ``gc`` scan on entry (including ``.grad`` of leaf tensors, which
  backward creates without a Python object) and explicit `StorageTracker.track`;
* "late" storages, first seen as an op *input*: made by ``torch.tensor()`` (which bypasses Python
  dispatch) or on threads the mode cannot see. Ignored unless ``count_late=True``.

Protocol that mirrors GPU measurement: enter the tracker before building the model, optimizer and
DDP/FSDP wrapper, run a warm-up step, then ``reset_peak()`` and measure the next step, calling
``mark(phase)`` at each phase boundary.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

BLOCK_BYTES = 512
"""CUDA caching allocator ``kMinBlockSize``: every allocation is rounded up to a multiple of it."""

CATEGORIES: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer",
    "inputs",
    "activations",
    "temporaries",
)
"""Peak categories, in priority order: a storage in two categories goes to the earlier one."""

BASELINE_PHASE = "baseline"
"""Phase name given to storages found by the entry scan or added by `StorageTracker.track`."""

_COMPACT_LOG_EVENTS = 200_000
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def round_block(nbytes: int) -> int:
    """Bytes the CUDA caching allocator charges for a request: ``ceil(nbytes / 512) * 512``.

    Zero stays zero (an empty storage allocates nothing).
    """
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class LiveStorage:
    """One storage alive at the overall peak."""

    nbytes: int
    """Bytes counted: the storage size rounded up to 512."""
    raw_nbytes: int
    """The storage's own size in bytes."""
    op: str
    """Op that created (or last resized) the storage; ``<baseline>``/``<tracked>`` if pre-existing,
    ``late:<op>`` when first seen as the input of ``<op>``."""
    phase: str
    """Phase (see `StorageTracker.mark`) in which the storage was created or last resized."""
    category: str
    """One of `CATEGORIES`."""


# (seq, rounded bytes, raw bytes, op, phase): an immutable record of one storage's state.
_Record = tuple[int, int, int, str, str]


def _op_name(func: Any) -> str:
    return getattr(func, "__name__", str(func)).removesuffix(".default")


def _tensors_in(obj: Any, out: list[torch.Tensor]) -> None:
    """Append the tensors in an op argument or result (tensors, and lists/tuples/dicts of them)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors_in(o, out)


def _storages_of(t: torch.Tensor, out: list[torch.UntypedStorage]) -> None:
    """Append the storages that really hold ``t``'s data: inner tensors for wrapper subclasses."""
    if type(t) not in _PLAIN_TYPES and is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(t, attr)
            # DTensor (2.13) also lists its DeviceMesh among the "inner tensors"
            if isinstance(inner, torch.Tensor):
                _storages_of(inner, out)
        return
    try:
        out.append(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        pass  # sparse, nested or functional tensors: no plain storage to count


def _params_and_grads(params: Iterable[torch.Tensor], out: list[torch.Tensor]) -> None:
    """Append each parameter, then its ``.grad`` when it has one."""
    for p in params:
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)


def _tensors_of_objects(objs: Iterable[Any]) -> list[torch.Tensor]:
    """Tensors held by modules (params, buffers, grads), optimizers (params, grads, state) or given
    directly (plus their ``.grad`` when they are leaves)."""
    found: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            _params_and_grads(obj.parameters(), found)
            found.extend(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                _params_and_grads(group["params"], found)
            _tensors_in(list(obj.state.values()), found)
        elif isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.is_leaf and obj.grad is not None:
                found.append(obj.grad)
        elif isinstance(obj, dict):
            found.extend(_tensors_of_objects(obj.values()))
        elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
            found.extend(_tensors_of_objects(obj))
    return found


def _dead_callback(append: Callable[[Any], None], key: int) -> Callable[[weakref.ref], None]:
    # Holds neither the tracker nor the storage; deque.append is atomic, so this is safe whenever
    # and on whatever thread the storage dies.
    def on_dead(ref: weakref.ref) -> None:
        append((key, ref))

    return on_dead


class StorageTracker(TorchDispatchMode):
    """Track live tensor storages (rounded to 512 B) and their peak, per phase and overall.

    Args:
        scan_baseline: on entry, count every storage reachable from a live Python tensor (found by
            ``gc.get_objects()``), and ``.grad`` of leaf tensors, as the baseline.
        count_late: count storages first seen as an op input (``torch.tensor()`` results such as
            optimizer ``step`` scalars, tensors made on unseen threads) from first sight. ``False``
            ignores them, which matches CUDA where those step scalars stay on the host. Storages
            present at the baseline, or given to `track`, are never late.
        track_saved: install ``torch.autograd.graph.saved_tensors_hooks`` while active to learn which
            storages autograd saves ("activations"). Turn off when an outer saved-tensor hook (CPU
            offload, checkpointing) must stay in charge; `record_saved` does it for a narrower scope.
        count_meta: also count storages on the ``meta`` device (skipped by default).
        phase: name of the phase that starts on entry.

    Attributes (read after or during tracking): ``live_bytes``, ``peak_bytes``, ``baseline_bytes``,
    ``phase_peaks``, ``phase_start_bytes``, ``peak_phase``, ``peak_op``.
    """

    def __init__(
        self,
        *,
        scan_baseline: bool = True,
        count_late: bool = False,
        track_saved: bool = True,
        count_meta: bool = False,
        phase: str = "init",
    ) -> None:
        super().__init__()
        self.scan_baseline = scan_baseline
        self.count_late = count_late
        self.track_saved = track_saved
        self.count_meta = count_meta
        self._lock = threading.RLock()
        self._pending: collections.deque[tuple[int, weakref.ref]] = collections.deque()
        self._seq = itertools.count()
        # key -> [record, weakref to the storage]
        self._live: dict[int, list[Any]] = {}
        # storages deliberately not counted (late, meta): key -> weakref
        self._ignored: dict[int, weakref.ref] = {}
        self._live_bytes = 0
        self.peak_bytes: int = 0
        """Highest ``live_bytes`` since entry or the last `reset_peak`."""
        self.baseline_bytes: int = 0
        """Bytes of storages that existed before tracking (entry scan and `track`)."""
        self.peak_op: str = ""
        """Op whose output (or resize) made the overall peak."""
        self._phase = phase
        self.peak_phase: str = phase
        """Phase in which the overall peak occurred."""
        self.phase_peaks: dict[str, int] = {}
        """Peak live bytes within each phase (all marks of one name together)."""
        self.phase_start_bytes: dict[str, int] = {}
        """Live bytes when each phase was first marked (since entry or the last `reset_peak`)."""
        # Peak snapshot, kept cheaply: the live set at the last reset (_base) plus an event log;
        # the peak is the state after the first _peak_pos events. _peak_frozen after compaction.
        self._base: dict[int, _Record] = {}
        self._log: list[tuple[int, _Record | None]] = []
        self._peak_pos: int = 0
        self._peak_frozen: dict[int, _Record] | None = None
        self._saved_seqs: set[int] = set()
        self._category_seqs: dict[int, int] = {}  # seq -> index into CATEGORIES
        self._sources: dict[str, list[Any]] = {c: [] for c in CATEGORIES[:4]}
        self._op_names: dict[Any, tuple[str, bool]] = {}
        self._exit_stack: contextlib.ExitStack | None = None
        self._orig_resize: Any = None
        self._had_own_resize = False

    # ------------------------------------------------------------------ public state

    @property
    def live_bytes(self) -> int:
        """Bytes of live tracked storages now (each rounded to 512)."""
        with self._lock:
            self._drain()
            return self._live_bytes

    @property
    def phase(self) -> str:
        """The current phase name."""
        return self._phase

    # ------------------------------------------------------------------ mode protocol

    def __enter__(self) -> Self:
        stack = contextlib.ExitStack()
        if self.scan_baseline:
            self._scan_baseline()
        self._patch_resize()
        stack.callback(self._unpatch_resize)
        if self.track_saved:
            stack.enter_context(self.record_saved())
        self._exit_stack = stack
        self.phase_peaks.setdefault(self._phase, self._live_bytes)
        self.phase_start_bytes.setdefault(self._phase, self._live_bytes)
        return super().__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            if self._exit_stack is not None:
                self._exit_stack.close()
                self._exit_stack = None
            with self._lock:
                self._drain()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``func``, then account for its inputs (late, resized) and outputs (new storages)."""
        out = func(*args, **(kwargs or {}))
        info = self._op_names.get(func)
        if info is None:
            schema = getattr(func, "_schema", None)
            info = (_op_name(func), bool(schema is not None and schema.is_mutable))
            self._op_names[func] = info
        name, mutable = info
        tensors: list[torch.Tensor] = []
        _tensors_in(args, tensors)
        if kwargs:
            _tensors_in(kwargs, tensors)
        n_inputs = len(tensors)
        _tensors_in(out, tensors)
        storages: list[torch.UntypedStorage] = []
        with self._lock:
            self._drain()
            for i, t in enumerate(tensors):
                storages.clear()
                _storages_of(t, storages)
                for st in storages:
                    self._see(st, name, is_input=i < n_inputs, recheck=mutable)
        return out

    # ------------------------------------------------------------------ public API

    def mark(self, phase: str) -> None:
        """Start phase ``phase``: later allocations are attributed to it and its peak is tracked.

        Also resolves the categories registered with `classify` (so gradients freed by a later
        ``zero_grad`` keep their category).
        """
        with self._lock:
            self._drain()
            self._resolve_sources(())
            self._phase = phase
            live = self._live_bytes
            self.phase_start_bytes.setdefault(phase, live)
            if live > self.phase_peaks.get(phase, -1):
                self.phase_peaks[phase] = live

    def reset_peak(self) -> None:
        """Set the peak to the current live bytes, like ``torch.cuda.reset_peak_memory_stats``.

        Per-phase peaks and start bytes restart too; the current phase continues.
        """
        with self._lock:
            self._drain()
            self._resolve_sources(())
            live = self._live_bytes
            self.peak_bytes = live
            self.peak_op = "<reset>"
            self.peak_phase = self._phase
            self.phase_peaks = {self._phase: live}
            self.phase_start_bytes = {self._phase: live}
            self._base = {key: entry[0] for key, entry in self._live.items()}
            self._log = []
            self._peak_pos = 0
            self._peak_frozen = None
            self._prune_seqs(rec[0] for rec in self._base.values())

    def track(self, *objs: Any) -> None:
        """Count storages of tensors, modules (params, buffers, grads) or optimizers (params, grads,
        state) that the tracker has not seen, as baseline. Overrides "late"/ignored status."""
        with self._lock:
            self._drain()
            storages: list[torch.UntypedStorage] = []
            for t in _tensors_of_objects(objs):
                _storages_of(t, storages)
            for st in storages:
                self._add_existing(st, "<tracked>", force=True)

    def classify(
        self,
        *,
        model: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        params: Iterable[torch.Tensor] = (),
        grads: Iterable[torch.Tensor] = (),
        optimizer_states: Iterable[Any] = (),
        inputs: Iterable[Any] = (),
    ) -> StorageTracker:
        """Register what is a parameter, gradient, optimizer state or input, for `attribute`.

        Sources are resolved lazily (at `mark`, `reset_peak`, `attribute`), so gradients and states
        created later are found. ``model`` gives parameters and buffers, and its params' ``.grad``;
        ``optimizer`` gives its ``state`` tensors and its params' ``.grad``. Returns ``self``.
        """
        with self._lock:
            for name, value in (("parameters", model), ("optimizer", optimizer)):
                if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
                    self._sources[name].append(value)
                elif value is not None:
                    self._sources[name].extend(value)
            self._sources["parameters"].extend(params)
            self._sources["gradients"].extend(grads)
            self._sources["optimizer"].extend(optimizer_states)
            self._sources["inputs"].extend(inputs)
        return self

    def attribute(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        inputs: Iterable[Any] = (),
    ) -> dict[str, int]:
        """Bytes at the overall peak per category of `CATEGORIES`; the values sum to ``peak_bytes``.

        ``model``/``optimizer``/``inputs`` are resolved now, in addition to `classify` sources.
        Call it before gradients are set to None (or ``mark`` the zero-grad phase first).
        """
        with self._lock:
            self._drain()
            extra: list[tuple[str, Any]] = []
            if model is not None:
                extra.append(("parameters", model))
            if optimizer is not None:
                extra.append(("optimizer", optimizer))
            extra.extend(("inputs", x) for x in inputs)
            self._resolve_sources(extra)
            totals = dict.fromkeys(CATEGORIES, 0)
            for rec in self._peak_records().values():
                totals[self._category(rec[0])] += rec[1]
            return totals

    def peak_live(self) -> list[LiveStorage]:
        """The live set at the overall peak, largest first (categories as in `attribute`)."""
        with self._lock:
            self._drain()
            self._resolve_sources(())
            recs = self._peak_records().values()
            items = [
                LiveStorage(size, raw, op, phase, self._category(seq))
                for seq, size, raw, op, phase in recs
            ]
        items.sort(key=lambda s: -s.nbytes)
        return items

    def peak_by_op(self) -> dict[str, int]:
        """Bytes at the overall peak grouped by creating op, largest first."""
        totals: dict[str, int] = collections.Counter()
        for s in self.peak_live():
            totals[s.op] += s.nbytes
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def tracked_bytes(self, *tensors: torch.Tensor) -> int:
        """Bytes currently counted for the (deduplicated) storages of ``tensors``; 0 if untracked."""
        with self._lock:
            self._drain()
            storages: list[torch.UntypedStorage] = []
            for t in tensors:
                _storages_of(t, storages)
            seen: dict[int, int] = {}
            for st in storages:
                entry = self._live.get(st._cdata)
                if entry is not None and entry[1]() is st:
                    seen[st._cdata] = entry[0][1]
            return sum(seen.values())

    @contextlib.contextmanager
    def record_saved(self) -> Iterator[None]:
        """Record storages that autograd saves for backward ("activations") within this block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    # ------------------------------------------------------------------ bookkeeping

    def _drain(self) -> None:
        """Apply queued frees (caller holds the lock)."""
        pending = self._pending
        while pending:
            key, ref = pending.popleft()
            entry = self._live.get(key)
            if entry is not None and entry[1] is ref:
                del self._live[key]
                self._live_bytes -= entry[0][1]
                self._log.append((key, None))
            elif self._ignored.get(key) is ref:
                del self._ignored[key]
        if len(self._log) > _COMPACT_LOG_EVENTS:
            self._compact()

    def _see(self, st: torch.UntypedStorage, op: str, *, is_input: bool, recheck: bool) -> None:
        key = st._cdata
        entry = self._live.get(key)
        if entry is not None:
            if entry[1]() is st:
                if recheck:
                    self._recheck(key, entry, st, op)
                return
            self._forget(key, entry)  # the key was reused before the free was queued
        ref = self._ignored.get(key)
        if ref is not None:
            if ref() is st:
                return
            del self._ignored[key]
        if is_input:
            if self.count_late:
                self._add(st, key, "late:" + op, self._phase)
            else:
                self._ignore(st, key)
        else:
            self._add(st, key, op, self._phase)

    def _add(self, st: torch.UntypedStorage, key: int, op: str, phase: str) -> int:
        if not self.count_meta and st.device.type == "meta":
            self._ignore(st, key)
            return 0
        raw = st.nbytes()
        size = round_block(raw)
        rec: _Record = (next(self._seq), size, raw, op, phase)
        ref = weakref.ref(st, _dead_callback(self._pending.append, key))
        self._live[key] = [rec, ref]
        self._log.append((key, rec))
        self._live_bytes += size
        if size:
            self._note_growth(op)
        return size

    def _ignore(self, st: torch.UntypedStorage, key: int) -> None:
        self._ignored[key] = weakref.ref(st, _dead_callback(self._pending.append, key))

    def _forget(self, key: int, entry: list[Any]) -> None:
        del self._live[key]
        self._live_bytes -= entry[0][1]
        self._log.append((key, None))

    def _recheck(self, key: int, entry: list[Any], st: torch.UntypedStorage, op: str) -> None:
        raw = st.nbytes()
        old = entry[0]
        if raw == old[2]:
            return
        size = round_block(raw)
        rec: _Record = (old[0], size, raw, op, self._phase)
        entry[0] = rec
        self._log.append((key, rec))
        self._live_bytes += size - old[1]
        if size > old[1]:
            self._note_growth(op)

    def _note_growth(self, op: str) -> None:
        live = self._live_bytes
        phase = self._phase
        if live > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = live
        if live > self.peak_bytes:
            self.peak_bytes = live
            self.peak_op = op
            self.peak_phase = phase
            self._peak_pos = len(self._log)
            self._peak_frozen = None

    def _add_existing(self, st: torch.UntypedStorage, op: str, *, force: bool) -> None:
        key = st._cdata
        entry = self._live.get(key)
        if entry is not None:
            if entry[1]() is st:
                return
            self._forget(key, entry)
        ref = self._ignored.get(key)
        if ref is not None:
            if ref() is st and not force:
                return
            del self._ignored[key]
        self.baseline_bytes += self._add(st, key, op, BASELINE_PHASE)

    def _scan_baseline(self) -> None:
        # type(), not isinstance(): isinstance reads __class__, which deprecated-module proxies
        # (torch.distributed.reduce_op) answer with a FutureWarning
        tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
        storages: list[torch.UntypedStorage] = []
        for t in tensors:
            _storages_of(t, storages)
            # backward makes .grad without a Python object, so gc alone misses it
            with contextlib.suppress(Exception):  # fake/functional tensors in the heap
                grad = t.grad if t.is_leaf else None
                if grad is not None:
                    _storages_of(grad, storages)
        del tensors
        with self._lock:
            self._drain()
            for st in storages:
                self._add_existing(st, "<baseline>", force=False)

    # ------------------------------------------------------------------ UntypedStorage.resize_

    def _patch_resize(self) -> None:
        cls = torch.UntypedStorage
        self._had_own_resize = "resize_" in cls.__dict__
        orig = cls.resize_
        self._orig_resize = orig
        tracker_ref = weakref.ref(self)

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = orig(storage, size)
            tracker = tracker_ref()
            if tracker is not None:
                tracker._on_resize(storage)
            return result

        cls.resize_ = resize_  # type: ignore[method-assign]

    def _unpatch_resize(self) -> None:
        cls = torch.UntypedStorage
        if self._had_own_resize:
            cls.resize_ = self._orig_resize  # type: ignore[method-assign]
        else:
            del cls.resize_
        self._orig_resize = None

    def _on_resize(self, st: torch.UntypedStorage) -> None:
        with self._lock:
            self._drain()
            self._see(st, "UntypedStorage.resize_", is_input=True, recheck=True)

    # ------------------------------------------------------------------ saved tensors

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storages: list[torch.UntypedStorage] = []
        _storages_of(t, storages)
        with self._lock:
            for st in storages:
                entry = self._live.get(st._cdata)
                if entry is not None and entry[1]() is st:
                    self._saved_seqs.add(entry[0][0])
        # Returning ``t`` itself would, for a saved *output*, tie the tensor to its own grad_fn in
        # a C++ cycle that gc cannot break: the storage would never be freed. A detached alias
        # shares the storage and carries no graph.
        return t.detach()

    # ------------------------------------------------------------------ categories

    def _resolve_sources(self, extra: Iterable[tuple[str, Any]]) -> None:
        """Map the storages of registered sources to categories (caller holds the lock)."""
        pairs: list[tuple[int, list[torch.Tensor]]] = []
        for name, objs in self._sources.items():
            if objs:
                pairs.extend(self._split_source(name, objs))
        for name, obj in extra:
            pairs.extend(self._split_source(name, [obj]))
        storages: list[torch.UntypedStorage] = []
        for index, tensors in pairs:
            for t in tensors:
                storages.clear()
                _storages_of(t, storages)
                for st in storages:
                    entry = self._live.get(st._cdata)
                    if entry is not None and entry[1]() is st:
                        seq = entry[0][0]
                        if index < self._category_seqs.get(seq, len(CATEGORIES)):
                            self._category_seqs[seq] = index

    @staticmethod
    def _split_source(name: str, objs: list[Any]) -> list[tuple[int, list[torch.Tensor]]]:
        """(category index, tensors) pairs; modules/optimizers also yield gradients."""
        out: list[tuple[int, list[torch.Tensor]]] = []
        grads = CATEGORIES.index("gradients")
        plain: list[torch.Tensor] = []
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                params = list(obj.parameters())
                out.append((CATEGORIES.index("parameters"), params + list(obj.buffers())))
                out.append((grads, [p.grad for p in params if p.grad is not None]))
            elif isinstance(obj, torch.optim.Optimizer):
                states: list[torch.Tensor] = []
                _tensors_in(list(obj.state.values()), states)
                out.append((CATEGORIES.index("optimizer"), states))
                params = [p for g in obj.param_groups for p in g["params"]]
                out.append((grads, [p.grad for p in params if p.grad is not None]))
            else:
                _tensors_in(obj, plain)
        out.append((CATEGORIES.index(name), plain))
        return out

    def _category(self, seq: int) -> str:
        index = self._category_seqs.get(seq)
        if index is not None:
            return CATEGORIES[index]
        return "activations" if seq in self._saved_seqs else "temporaries"

    # ------------------------------------------------------------------ peak snapshot

    def _peak_records(self) -> dict[int, _Record]:
        if self._peak_frozen is not None:
            return self._peak_frozen
        state = dict(self._base)
        for key, rec in itertools.islice(self._log, self._peak_pos):
            if rec is None:
                state.pop(key, None)
            else:
                state[key] = rec
        self._peak_frozen = state
        return state

    def _compact(self) -> None:
        """Bound the event log: freeze the peak snapshot and restart the log from the live set."""
        peak = self._peak_records()
        self._base = {key: entry[0] for key, entry in self._live.items()}
        self._log = []
        self._peak_pos = -1  # the peak is only in _peak_frozen until it rises again
        self._peak_frozen = peak
        keep = {rec[0] for rec in peak.values()}
        keep.update(rec[0] for rec in self._base.values())
        self._prune_seqs(keep)

    def _prune_seqs(self, keep: Iterable[int]) -> None:
        keep = set(keep)
        self._saved_seqs &= keep
        self._category_seqs = {s: c for s, c in self._category_seqs.items() if s in keep}


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
