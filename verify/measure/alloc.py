"""A CPU meter for compiled steps: the profiler's allocation events, read with the tracker's rules.

`verify.measure.tracker.StorageTracker` is a ``TorchDispatchMode``; while one is active,
``torch.compile`` does not run the compiled code at all (Dynamo falls back to eager: measured,
0 calls of the generated code's allocator under the mode), and the buffers Inductor's generated
code allocates (``empty_strided_cpu``, ``torch/_inductor/codegen/wrapper.py``) never reach a
dispatch mode anyway. `AllocationMeter` sees every CPU allocation instead: it runs
``torch.profiler.profile(profile_memory=True)`` (the CPU allocator reports each allocation and
free, with its pointer and size, to the profiler) and replays the events with the tracker's
rules, so that an eager step measures the same bytes under both (checked by
``tests/verify/measure/test_alloc.py``):

* every allocation counts ``ceil(bytes / 512) * 512`` (`verify.measure.tracker.round_block`);
* **kernel-internal** allocations, freed before the outermost ``aten::`` op around them ends
  (scalar conversions inside ``mul``, a kernel's scratch), do not count: the tracker sees the
  outputs of the ops called from Python (a composite op's intermediates freed inside it would
  be missed too: the eager check shows none on the cases run);
* allocations outside every ``aten::`` op count only inside the generated code
  (``## Call CompiledFxGraph`` ranges: Inductor's buffers) and inside FSDP2's hooks
  (``FSDP::`` ranges: ``alloc_storage``'s ``storage.resize_`` of the unsharded parameters and
  all-gather outputs, ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, which the
  tracker sees as a storage growing); elsewhere they are Python scalars wrapped for an op's
  call, which the tracker does not see either;
* allocations inside a collective (``c10d::`` ops: gloo's staging buffers) do not count;
* ``torch.tensor()`` results do not count: an ``aten::empty`` followed, within two events, by
  the ``aten::lift_fresh`` of the literal (as the profiler shows it: `LITERAL_MARK`), or any
  ``aten::empty`` called by ``Optimizer.step`` itself (Adam's ``step`` scalars,
  ``torch/optim/adam.py`` lines 130-175, 683). They are the tracker's "late" storages
  (``count_late=False``), host-side on CUDA: Gemma's forward's ``normalizer`` is such a
  literal. Its ``embed_scale`` buffer is one too, but ``model.to(device)`` moves it to the GPU:
  the tracker counts it as the model's (``StorageTracker.track(model)``), and so does this
  meter for the storages the caller names (`AllocationMeter.keep`: the built model's buffers).

Phases are ``record_function`` markers (`AllocationMeter.mark`); live bytes at the start
(``baseline_bytes``) are given by the caller, who knows what was allocated before profiling.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from verify.measure.tracker import round_block

if TYPE_CHECKING:
    from collections.abc import Iterator

MARK_PREFIX = "vramplan.mark:"
"""Name prefix of the ``record_function`` ranges that mark phase boundaries."""
GENERATED_CODE_PREFIX = "## Call CompiledFxGraph"
"""Name prefix of the range Inductor opens around a call of its generated code
(``torch/_inductor/output_code.py``, ``CompiledFxGraph.__call__``)."""
FSDP_PREFIX = "FSDP::"
"""Name prefix of the ranges FSDP2 opens around its hooks and collectives
(``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``, ``record_function``)."""
COLLECTIVE_PREFIX = "c10d::"
"""Name prefix of torch.distributed's collectives as dispatcher ops (``c10d::allgather_``...):
what they allocate inside (gloo's staging copies, freed on its worker thread) is not theirs to
return, and the tracker never sees it."""
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
"""Name prefix of the range ``torch.optim.Optimizer`` opens around ``step``."""


@dataclass(slots=True)
class AllocationPeaks:
    """Peaks replayed from the allocation events (bytes, each allocation rounded to 512)."""

    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Highest live bytes within each phase (all marks of one name together)."""
    phase_start_bytes: dict[str, int] = field(default_factory=dict)
    """Live bytes when each phase was first marked."""
    peak_bytes: int = 0
    peak_phase: str = ""
    counted: int = 0
    """Allocations counted."""
    skipped: int = 0
    """Allocations not counted (kernel-internal, wrapped scalars, ``torch.tensor()``)."""
    alive_at_end: list[tuple[int, str, str]] = field(default_factory=list)
    """(bytes, op, phase) of each counted allocation with no free recorded by the end."""


def _is_op(ev: Any) -> bool:
    return ev.name.startswith("aten::")


def _enclosing_ops(ev: Any) -> list[Any]:
    """The ``aten::`` ops around ``ev``, innermost first."""
    ops = []
    p = ev.parent
    while p is not None:
        if _is_op(p):
            ops.append(p)
        p = p.parent
    return ops


def _has_ancestor(ev: Any, prefix: str) -> bool:
    p = ev.parent
    while p is not None:
        if p.name.startswith(prefix):
            return True
        p = p.parent
    return False


def _counts(ev: Any, free_ns: int | None, literals: set[int]) -> bool:
    """Whether the tracker would see the allocation ``ev`` (freed at ``free_ns``; None: never)."""
    if _has_ancestor(ev, COLLECTIVE_PREFIX):
        return False  # a collective's own buffers: the tracker sees only what it returns
    ops = _enclosing_ops(ev)
    if not ops:
        return _has_ancestor(ev, GENERATED_CODE_PREFIX) or _has_ancestor(ev, FSDP_PREFIX)
    if free_ns is not None and free_ns <= ops[-1].end_time_ns:
        return False  # kernel-internal: dead before the op called from Python returned
    op = ops[0]
    if op.name == "aten::empty" and (op.parent is None or not _is_op(op.parent)):
        # torch.tensor() in step() or anywhere (a literal)
        return not _has_ancestor(op, OPTIMIZER_STEP_PREFIX) and op.id not in literals
    return True


LITERAL_MARK = "aten::lift_fresh"
"""The op the profiler shows within two ops after the ``aten::empty`` of a ``torch.tensor()``
call (``torch/csrc/utils/tensor_new.cpp``: ``aten::to`` copies the data in, then
``lift_fresh``); no other Python call makes it."""


def _literals(roots: list[Any]) -> set[int]:
    """Ids of the ``aten::empty`` events that are ``torch.tensor()`` literals: followed, among
    their siblings, by `LITERAL_MARK` within two events."""
    found: set[int] = set()
    stack = [roots]
    while stack:
        siblings = sorted(stack.pop(), key=lambda e: e.start_time_ns)
        for i, ev in enumerate(siblings):
            stack.append(ev.children)
            after = [e.name for e in siblings[i + 1 : i + 3]]
            if ev.name == "aten::empty" and LITERAL_MARK in after:
                found.add(ev.id)
    return found


def _flatten(roots: list[Any]) -> tuple[list[Any], list[Any]]:
    """(allocation events, mark events) of the event tree."""
    allocs: list[Any] = []
    marks: list[Any] = []
    alloc_tag = torch._C._profiler._EventType.Allocation
    stack = list(roots)
    while stack:
        ev = stack.pop()
        if ev.tag == alloc_tag:
            if ev.extra_fields.device.type == "cpu":
                allocs.append(ev)
        elif ev.name.startswith(MARK_PREFIX):
            marks.append(ev)
        stack.extend(ev.children)
    return allocs, marks


def replay_events(
    roots: list[Any], baseline_bytes: int, first_phase: str, kept: frozenset[int] = frozenset()
) -> AllocationPeaks:
    """Replay the profiler's event tree ``roots`` from ``baseline_bytes`` live bytes. An
    allocation at a pointer of ``kept`` that is never freed counts whatever made it (a built
    model's ``torch.tensor()`` buffer, `AllocationMeter.keep`)."""
    allocs, marks = _flatten(roots)
    literals = _literals(roots)
    allocs.sort(key=lambda e: e.start_time_ns)
    # when each allocation is freed: the next negative event at its pointer
    free_at: dict[int, int | None] = {}
    open_at: dict[int, int] = {}
    for i, ev in enumerate(allocs):
        ptr, size = ev.extra_fields.ptr, ev.extra_fields.alloc_size
        if size > 0:
            open_at[ptr] = i
            free_at[i] = None
        elif ptr in open_at:
            free_at[open_at.pop(ptr)] = ev.start_time_ns
    timeline = [(e.start_time_ns, 0, i, e) for i, e in enumerate(allocs)]
    timeline += [(e.start_time_ns, 1, -1, e) for e in marks]
    timeline.sort(key=lambda x: (x[0], x[1]))
    out = AllocationPeaks()
    phase = first_phase
    live = baseline_bytes
    counted: dict[int, int] = {}  # ptr -> bytes counted
    where: dict[int, tuple[str, str]] = {}  # ptr -> (op, phase) of its allocation
    out.phase_peaks[phase] = live
    out.phase_start_bytes[phase] = live
    for _, kind, i, ev in timeline:
        if kind == 1:
            phase = ev.name.removeprefix(MARK_PREFIX)
            out.phase_start_bytes.setdefault(phase, live)
            out.phase_peaks[phase] = max(out.phase_peaks.get(phase, 0), live)
            continue
        ptr, size = ev.extra_fields.ptr, ev.extra_fields.alloc_size
        if size <= 0:
            live -= counted.pop(ptr, 0)
            continue
        forced = ptr in kept and free_at[i] is None
        if not forced and not _counts(ev, free_at[i], literals):
            out.skipped += 1
            counted.pop(ptr, None)
            continue
        out.counted += 1
        counted[ptr] = round_block(size)
        where[ptr] = (_op_name(ev), phase)
        live += counted[ptr]
        if live > out.phase_peaks.get(phase, 0):
            out.phase_peaks[phase] = live
        if live > out.peak_bytes:
            out.peak_bytes, out.peak_phase = live, phase
    out.alive_at_end = sorted(((b, *where[p]) for p, b in counted.items()), reverse=True)
    return out


def _op_name(ev: Any) -> str:
    """The innermost named range around the allocation ``ev`` (an op or a marker)."""
    return ev.parent.name if ev.parent is not None else ""


class AllocationMeter:
    """``mark(phase)`` for the step protocol, and the peaks of what ran inside `profiling`."""

    def __init__(self) -> None:
        self.result = AllocationPeaks()
        self.kept: set[int] = set()

    def keep(self, *tensors: torch.Tensor) -> None:
        """Count the storages of ``tensors`` (a built model's buffers) whatever made them, as
        the tracker's ``StorageTracker.track(model)`` does: a ``torch.tensor()`` buffer
        (Gemma's ``embed_scale``) is otherwise skipped as a literal."""
        self.kept.update(t.untyped_storage().data_ptr() for t in tensors)

    def mark(self, phase: str) -> None:
        """Start phase ``phase`` (an empty ``record_function`` range named after it)."""
        with torch.profiler.record_function(MARK_PREFIX + phase):
            pass

    @contextlib.contextmanager
    def profiling(self, baseline_bytes: int, first_phase: str = "init") -> Iterator[None]:
        """Profile the block's CPU allocations; on exit `result` holds the replayed peaks."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        roots = prof.profiler.kineto_results.experimental_event_tree()
        self.result = replay_events(roots, baseline_bytes, first_phase, frozenset(self.kept))


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes the tracker counts for the distinct storages of ``tensors`` (each rounded)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = round_block(st.nbytes())
    return sum(seen.values())
