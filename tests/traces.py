"""Allocation traces in one form for both sides of a replay-vs-measurement test: the replay's
events (`calc.replay.tape.Event`) and the CPU tracker's (`verify.measure.tracker`), as
``(phase, bytes allocated, bytes live)`` per allocation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sympy as sp

BASE_KINDS = ("weight", "input", "buffer")
"""Storage kinds alive before the measured region (the tracker counts from zero after them)."""


def replayed_allocations(events: Iterable[Any]) -> list[tuple[str, int, int]]:
    """The replay's allocations with the bytes live beside the base kinds."""
    out = []
    prev = 0
    for e in events:
        live = sum(int(size) * n for (kind, _, _, size), n in e.live if kind not in BASE_KINDS)
        if e.label.startswith("+"):
            out.append((e.phase, live - prev, live))
        prev = live
    return out


def measured_allocations(events: Iterable[Any]) -> list[tuple[str, int, int]]:
    """The tracker's allocations (events that grew the live bytes)."""
    return [(e.phase, e.delta_bytes, e.live_bytes) for e in events if e.delta_bytes > 0]


def assert_symbolic_matches_numeric(symbolic: list[Any], numeric: list[Any], values: Any) -> None:
    """The symbolic replay, its sizes evaluated at ``values``, is the numeric replay: the same
    events, each with the same live storages (kind, name, bytes, count)."""
    assert [e.label for e in symbolic] == [e.label for e in numeric]
    for es, en in zip(symbolic, numeric, strict=True):
        live_s = sorted((k, n, int(sp.sympify(size).subs(values)), c)
                        for (k, n, _, size), c in es.live)  # fmt: skip
        live_n = sorted((k, n, size, c) for (k, n, _, size), c in en.live)
        assert live_s == live_n, es.label
