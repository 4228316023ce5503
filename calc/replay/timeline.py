"""From a replayed step to the peak for any number of layers, as a small linear system.

A replay (`calc.replay.tape`) of a model with ``n`` concrete layers gives, after each allocation, the
multiset of live storage sizes, each storage tagged with the layer that allocated it. Real
models have ``L`` layers, a symbol. Layers are identical, so a replay of five layers (first,
second, a middle one, second-to-last, last) generalises exactly:

* at an event outside the middle layer, the middle layer's tensors stand for all ``L - 4``
  middle layers (they are all in the same state, all before or all after the event), except
  next to it (events in layers 1 and 3), where layer 4 or layer 0 stands for the far ones;
* at an event inside middle layer ``j`` (``2 <= j <= L-3``), the other middle layers count as
  layer 0 does (two or more below) for the ``j - 2`` below and as layer 4 does for the
  ``L - 3 - j`` above. The live bytes are affine in ``j``, so the maximum over ``j`` is at
  ``j = 2`` or ``j = L - 3``: two candidates per event.

Models with fewer than five layers are replayed as they are. Each candidate is a row of counts
over the distinct storage sizes, the counts affine in ``L``; the live bytes are
``(C0 + L*C1) @ sizes``. An event whose counts are nowhere above another's (for every size,
at every ``L``) can never be the peak and is dropped. What is left is compiled once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sympy as sp

from calc.replay.tape import Event

GENERAL_LAYERS = 5
"""Layers replayed to generalise to any ``L >= 5``."""
MIDDLE = 2
"""The tag of the layer that stands for the middle ones in the five-layer replay."""


_NO_EXTRA = object()
"""``Candidate.extra_tag`` of a candidate that adds no copies of a layer (an exact replay)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One possible peak: which phase, which allocation, and which storages are live.

    ``event``'s live set, plus ``L - 5`` more copies of the storages tagged ``extra_tag`` (the
    layer that stands for the middle layers the five-layer replay lacks, module docstring)."""

    phase: str
    label: str
    event: Event
    extra_tag: object = _NO_EXTRA
    copies: int | None = None
    """The real count of the repeated units when it is known (a recording of five units of a
    repeating pattern of layers, `calc.derive.period`): ``copies - 5`` more copies, a
    constant; None: ``L - 5``."""

    @property
    def counts(self) -> dict:
        """key (kind, name, tag, size) -> (const, per_L) count of live storages."""
        out = {key: (c, 0) for key, c in self.event.live}
        if self.extra_tag is not _NO_EXTRA:
            for key, c in self.event.live:
                if key[2] == self.extra_tag:
                    k0, k1 = out[key]
                    if self.copies is None:
                        out[key] = (k0 - 5 * c, k1 + c)  # (L - 5) more copies
                    else:
                        out[key] = (k0 + (self.copies - 5) * c, k1)
        return out


@dataclass(frozen=True, slots=True)
class Timeline:
    """The candidates of one replay family (one branch of ``L``)."""

    sizes: tuple  # distinct size expressions
    phases: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    c0: np.ndarray  # [n_candidates, n_sizes] constant counts
    c1: np.ndarray  # [n_candidates, n_sizes] counts per layer
    most_counts: tuple[float, float] = (0.0, 0.0)
    """The largest row sums of ``|c0|`` and ``|c1|``: with the largest size they bound every
    candidate's bytes in a few operations (`exceeds_exact_range`'s first test)."""


def _local_maxima(events: Sequence[Event]) -> list[Event]:
    """Allocations followed by a free, a phase change, or the end: the only possible peaks."""
    keep = []
    for i, e in enumerate(events):
        if not e.label.startswith("+"):
            continue
        nxt = events[i + 1] if i + 1 < len(events) else None
        if nxt is None or not nxt.label.startswith("+") or nxt.phase != e.phase:
            keep.append(e)
    return keep


def candidates_exact(events: Sequence[Event]) -> list[Candidate]:
    """Candidates of a replay with the real number of layers (no generalisation)."""
    return [Candidate(e.phase, e.label, e) for e in _local_maxima(events)]


def candidates_general(events: Sequence[Event], copies: int | None = None) -> list[Candidate]:
    """Candidates valid for every ``L >= 5`` from a five-layer replay (module docstring); with
    ``copies``, for that many units of a five-unit replay (`Candidate.copies`)."""
    out = []
    for e in _local_maxima(events):
        if e.segment == MIDDLE:
            # j = 2: the L - 5 other middle layers are all above (as layer 4 is); j = L - 3:
            # all below (as layer 0 is).
            out.append(Candidate(e.phase, e.label, e, GENERAL_LAYERS - 1, copies))
            out.append(Candidate(e.phase, e.label, e, 0, copies))
        else:
            # The L - 5 middle layers the replay lacks stand where layer 2 stands, unless layer
            # 2 is next to the event's layer (1 or 3): a neighbour still holds tensors that
            # cross the boundary (the layer input a checkpoint frame keeps, the gradient passed
            # down), so there a far layer on the same side stands in (4 above, 0 below).
            like = {1: GENERAL_LAYERS - 1, 3: 0}.get(e.segment, MIDDLE)  # type: ignore[call-overload]
            out.append(Candidate(e.phase, e.label, e, like, copies))
    return out


def _count_matrices(cands: Sequence[Candidate]) -> tuple[tuple, np.ndarray, np.ndarray]:
    """(distinct sizes in order of first appearance, C0, C1) of ``cands``: each event's
    (key number, count) pairs are read once as an array and summed per size with ``bincount``;
    keys are looked at once per key table (a replay's tape has one), not once per event."""
    key_index: dict[tuple, int] = {}
    tables: dict[int, np.ndarray] = {}  # id(key table) -> its key numbers in key_index
    per_event: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for cand in cands:
        e = cand.event
        if id(e) in per_event:
            continue
        known = tables.get(id(e.keys))
        if known is None or len(known) < len(e.keys):
            known = np.array(
                [key_index.setdefault(key, len(key_index)) for key in e.keys], dtype=np.int64
            )
            tables[id(e.keys)] = known
        pairs = np.array(e.counts, dtype=np.int64).reshape(-1, 2)
        per_event[id(e)] = (known[pairs[:, 0]], pairs[:, 1])
    size_index: dict = {}
    key_size = np.array(
        [size_index.setdefault(key[3], len(size_index)) for key in key_index], dtype=np.int64
    )
    tag_index: dict = {}
    key_tag = np.array(
        [tag_index.setdefault((type(key[2]), key[2]), len(tag_index)) for key in key_index],
        dtype=np.int64,
    )
    n, m = len(cands), len(size_index)
    c0 = np.zeros((n, m), dtype=np.int64)
    c1 = np.zeros((n, m), dtype=np.int64)
    for i, cand in enumerate(cands):
        ids, counts = per_event[id(cand.event)]
        sizes = key_size[ids]
        c0[i] = np.bincount(sizes, weights=counts, minlength=m).astype(np.int64)
        if cand.extra_tag is _NO_EXTRA:
            continue
        tag = tag_index.get((type(cand.extra_tag), cand.extra_tag))
        if tag is None:
            continue
        mask = key_tag[ids] == tag
        extra = np.bincount(sizes[mask], weights=counts[mask], minlength=m).astype(np.int64)
        if cand.copies is None:
            c0[i] -= 5 * extra
            c1[i] += extra
        else:
            c0[i] += (cand.copies - 5) * extra
    return tuple(size_index), c0, c1


def build(cands: Sequence[Candidate], l_min: int) -> Timeline:
    """Matrix form of ``cands``, with dominated candidates removed (valid for ``L >= l_min``)."""
    sizes, c0, c1 = _count_matrices(cands)
    keep: list[int] = []
    for phase in dict.fromkeys(c.phase for c in cands):
        rows = [i for i, c in enumerate(cands) if c.phase == phase]
        kept = _undominated(c0[rows] + l_min * c1[rows], c1[rows])
        keep.extend(rows[i] for i in kept)
    keep.sort()
    phases = tuple(dict.fromkeys(c.phase for c in cands))
    c0, c1 = c0[keep], c1[keep]
    most = (_most_count(c0), _most_count(c1))
    return Timeline(sizes, phases, tuple(cands[i] for i in keep), c0, c1, most)


def _most_count(counts: np.ndarray) -> float:
    return float(np.abs(counts).sum(axis=1).max(initial=0))


def _undominated(at_min: np.ndarray, slope: np.ndarray) -> list[int]:
    """Rows not dominated by another row (of two equal rows, one is kept)."""
    n = at_min.shape[0]
    alive = np.ones(n, dtype=bool)
    order = np.argsort(-at_min.sum(axis=1), kind="stable")
    for i in order:
        if not alive[i]:
            continue
        ge = np.all(at_min[i] >= at_min, axis=1) & np.all(slope[i] >= slope, axis=1)
        ge[i] = False
        alive &= ~ge
        alive[i] = True
    return [i for i in range(n) if alive[i]]


def step1_mask(phases: Sequence[str]) -> np.ndarray:
    """True for the candidates of the first step (phase ``step1/...``): the constant storages
    outside a replay (DDP's buckets, ``calc.estimate.ranks``) differ there from the later steps."""
    return np.array([p.startswith("step1/") for p in phases], dtype=bool)


EXACT_BYTES_LIMIT = 1 << 53
"""Byte counts below this are exact everywhere a replay is evaluated: in the float64 that
``lambdify`` uses for the rounded sizes (integers up to 2**53 are exact in a double, IEEE 754)
and in the int64 sums of the totals (2**53 x the few thousand terms of a candidate stays far
below 2**63). 2**53 bytes is 8 PiB, a million times any GPU."""


def exceeds_exact_range(tl: Timeline, size_values: Sequence[int], n_layers: int) -> bool:
    """Whether a size or a partial sum of a candidate's live bytes could reach
    `EXACT_BYTES_LIMIT`: a bound from the counts' absolute values, computed in float64 (which
    cannot wrap), so an int64 total that would overflow is never computed."""
    top = max((abs(float(v)) for v in size_values), default=0.0)
    if top >= EXACT_BYTES_LIMIT:
        return True
    most0, most1 = tl.most_counts
    if top * (most0 + n_layers * most1) < EXACT_BYTES_LIMIT:  # a looser bound, already below
        return False
    sizes = np.asarray([float(v) for v in size_values], dtype=np.float64)
    bound = (np.abs(tl.c0) + n_layers * np.abs(tl.c1)).astype(np.float64) @ np.abs(sizes)
    return bool(bound.size) and float(bound.max()) >= EXACT_BYTES_LIMIT


def totals(tl: Timeline, size_values: np.ndarray, n_layers: int) -> np.ndarray:
    """Live bytes of every candidate for the given size values and layer count."""
    return (tl.c0 + n_layers * tl.c1) @ size_values


def candidate_expression(tl: Timeline, i: int, n_layers: sp.Expr) -> sp.Expr:
    """Live bytes at candidate ``i`` as a sum of (count x rounded size) terms."""
    return sp.Add(
        *[
            (int(a) + int(b) * n_layers) * size
            for a, b, size in zip(tl.c0[i], tl.c1[i], tl.sizes, strict=True)
            if a or b
        ]
    )


def expression(tl: Timeline, n_layers: sp.Expr) -> sp.Expr:
    """The peak of this timeline as ``Max`` over its candidates (for display)."""
    terms = []
    for row0, row1 in zip(tl.c0, tl.c1, strict=True):
        terms.append(
            sp.Add(
                *[
                    (int(a) + int(b) * n_layers) * size
                    for a, b, size in zip(row0, row1, tl.sizes, strict=True)
                    if a or b
                ]
            )
        )
    return sp.Max(*terms, evaluate=False) if len(terms) > 1 else terms[0]
