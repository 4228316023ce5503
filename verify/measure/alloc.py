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
  (``## Call CompiledFxGraph`` ranges: Inductor's buffers); elsewhere they are Python scalars
  wrapped for an op's call, which the tracker does not see either;
* ``torch.tensor()`` results in the optimizer step (an ``aten::empty`` called by
  ``Optimizer.step`` itself: Adam's ``step`` scalars, ``torch/optim/adam.py`` lines 130-175, 683)
  do not count: they are the tracker's "late" storages, host-side on CUDA.

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


def _counts(ev: Any, free_ns: int | None) -> bool:
    """Whether the tracker would see the allocation ``ev`` (freed at ``free_ns``; None: never)."""
    ops = _enclosing_ops(ev)
    if not ops:
        return _has_ancestor(ev, GENERATED_CODE_PREFIX)
    if free_ns is not None and free_ns <= ops[-1].end_time_ns:
        return False  # kernel-internal: dead before the op called from Python returned
    op = ops[0]
    if op.name == "aten::empty" and (op.parent is None or not _is_op(op.parent)):
        return not _has_ancestor(op, OPTIMIZER_STEP_PREFIX)  # torch.tensor() in step()
    return True


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


def replay_events(roots: list[Any], baseline_bytes: int, first_phase: str) -> AllocationPeaks:
    """Replay the profiler's event tree ``roots`` from ``baseline_bytes`` live bytes."""
    allocs, marks = _flatten(roots)
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
        if not _counts(ev, free_at[i]):
            out.skipped += 1
            counted.pop(ptr, None)
            continue
        out.counted += 1
        counted[ptr] = round_block(size)
        live += counted[ptr]
        if live > out.phase_peaks.get(phase, 0):
            out.phase_peaks[phase] = live
        if live > out.peak_bytes:
            out.peak_bytes, out.peak_phase = live, phase
    return out


class AllocationMeter:
    """``mark(phase)`` for the step protocol, and the peaks of what ran inside `profiling`."""

    def __init__(self) -> None:
        self.result = AllocationPeaks()

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
        self.result = replay_events(roots, baseline_bytes, first_phase)


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes the tracker counts for the distinct storages of ``tensors`` (each rounded)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = round_block(st.nbytes())
    return sum(seen.values())
