"""Display tables of an estimate: what the web calculator's charts and tables show, in GiB.

Bytes stay bytes in the cost model; this module turns an ``Estimate`` (and a ``Sweep``) into
rows of plain values (GiB = 2**30 bytes, shares in % of the peak) so that a page only draws
them. Every number here is the estimate's own bytes divided by ``GIB``: nothing is re-derived.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sympy as sp

from calc import symbols as S
from calc.estimate.result import GIB, Estimate
from calc.plan.result import Evaluated
from calc.present.sweep import Sweep


def gib(nbytes: int) -> float:
    """Bytes as GiB (2**30 bytes)."""
    return nbytes / GIB


def _children(tree: Mapping[str, int]) -> dict[str, list[str]]:
    kids: dict[str, list[str]] = {}
    for key in tree:
        if key == "total":
            continue
        parent = key.rsplit("/", 1)[0] if "/" in key else ""
        kids.setdefault(parent, []).append(key)
    return kids


def breakdown_rows(est: Estimate) -> list[dict[str, object]]:
    """One row per node of the breakdown tree (parents before children, ``total`` last):
    ``component`` (slash key), ``label`` (its last part, indented by depth), ``depth`` (0 = top
    level), ``bytes``, ``gib``, ``share_pct``."""
    tree = est.breakdown
    peak = int(est.peak_bytes)
    kids = _children(tree)
    rows: list[dict[str, object]] = []

    def walk(parent: str, depth: int) -> None:
        for key in kids.get(parent, []):
            n = int(tree[key])
            rows.append(_row(key, depth, n, peak))
            walk(key, depth + 1)

    walk("", 0)
    rows.append(_row("total", 0, int(tree["total"]), peak))
    return rows


def _row(key: str, depth: int, n: int, peak: int) -> dict[str, object]:
    return {
        "component": key,
        "label": "\u2003" * depth + key.rsplit("/", 1)[-1],
        "depth": depth,
        "bytes": n,
        "gib": gib(n),
        "share_pct": 100 * n / peak if peak else 0.0,
    }


def stacked_levels(est: Estimate) -> list[dict[str, object]]:
    """Segments of a stacked bar per tree level: bar ``level N`` stacks the nodes at depth
    ``N-1`` (a leaf above that depth carries down), so every bar sums to the peak. Rows:
    ``level``, ``component``, ``group`` (top-level key, for the colour), ``order``, ``gib``,
    ``share_pct``."""
    tree = est.breakdown
    peak = int(est.peak_bytes)
    kids = _children(tree)
    depth_of = {key: key.count("/") for key in tree if key != "total"}
    levels = max(depth_of.values(), default=0) + 1
    out: list[dict[str, object]] = []
    for level in range(levels):
        order = 0

        def walk(parent: str, level: int = level) -> None:
            nonlocal order
            for key in kids.get(parent, []):
                if depth_of[key] < level and key in kids:
                    walk(key)
                    continue
                n = int(tree[key])
                out.append(
                    {
                        "level": f"level {level + 1}",
                        "component": key,
                        "group": key.split("/")[0],
                        "order": order,
                        "gib": gib(n),
                        "share_pct": 100 * n / peak if peak else 0.0,
                    }
                )
                order += 1

        walk("")
    return out


def phase_rows(est: Estimate) -> list[dict[str, object]]:
    """The peak of each phase of the step, in step order: ``phase``, ``order``, ``gib``,
    ``is_peak`` (the phase that holds the overall peak)."""
    return [
        {"phase": phase, "order": i, "gib": gib(int(n)), "is_peak": phase == est.peak_phase}
        for i, (phase, n) in enumerate(est.phases.items())
    ]


def symbol_rows(est: Estimate, inference: bool = False) -> list[dict[str, object]]:
    """The symbols of the peak formula: ``symbol`` (LaTeX), ``meaning``
    (``calc.symbols.DESCRIPTIONS``, or ``INFERENCE_DESCRIPTIONS`` for an inference job) and
    ``value`` at this estimate, in ``ALL_SYMBOLS`` order."""
    used = est.peak_expression.free_symbols
    meanings = S.INFERENCE_DESCRIPTIONS if inference else S.DESCRIPTIONS
    return [
        {
            "symbol": sp.latex(sym),
            "meaning": meanings[sym],
            "value": int(est.values[sym]),
        }
        for sym in S.ALL_SYMBOLS
        if sym in used
    ]


def sweep_rows(sweep: Sweep) -> list[dict[str, object]]:
    """One row per evaluated point that has a peak: ``field`` value and ``gib``."""
    return [
        {sweep.field: v, "gib": gib(n)}
        for v, n in zip(sweep.values, sweep.peak_bytes, strict=True)
        if n is not None
    ]


MIB = 1 << 20
"""Bytes per MiB (verify's cases are scaled-down models of a few MiB)."""


def evidence_rows(report: Mapping[str, Any]) -> list[dict[str, object]]:
    """One row per case of a verify report (``verify/reports/latest/report.json`` as a dict):
    ``case``, ``implementation``, ``kind``, ``card``, ``status``, ``predicted_mib``,
    ``measured_mib`` (None where absent), ``error_pct`` (signed, predicted vs measured),
    ``tolerance_pct``, ``peak_phase`` (measured)."""
    rows: list[dict[str, object]] = []
    for case in report.get("cases", []):
        pred, meas = case.get("predicted_peak"), case.get("measured_peak")
        rows.append(
            {
                "case": case.get("name"),
                "implementation": case.get("impl"),
                "kind": case.get("kind"),
                "card": case.get("card"),
                "status": case.get("status"),
                "predicted_mib": None if pred is None else pred / MIB,
                "measured_mib": None if meas is None else meas / MIB,
                "error_pct": case.get("error_pct"),
                "tolerance_pct": case.get("tolerance_pct"),
                "peak_phase": case.get("measured_peak_phase"),
            }
        )
    return rows


def plan_rows(evaluated: Sequence[Evaluated]) -> list[dict[str, object]]:
    """One row per configuration of a plan (``calc.plan.planner.Evaluated``, in the given order):
    ``rank``, the axis values (``config.choices``), ``grad_accum``, ``peak_gib``,
    ``headroom_gib``, ``headroom_pct``, ``throughput_proxy``, ``error_bar`` and ``reason``."""
    rows: list[dict[str, object]] = []
    for rank, ev in enumerate(evaluated, start=1):
        peak, room = ev.peak_bytes, ev.headroom_bytes
        bar = ev.error_bar
        rows.append(
            {
                "rank": rank,
                **dict(ev.config.choices),
                "grad_accum": ev.config.grad_accum,
                "peak_gib": None if peak is None else gib(peak),
                "headroom_gib": None if room is None else gib(room),
                "headroom_pct": ev.headroom_pct,
                "throughput_proxy": ev.throughput_proxy,
                "error_bar": "" if bar is None else bar.text(),
                "reason": ev.reason,
            }
        )
    return rows


def latex_lines(expr: sp.Expr, terms_per_line: int = 4) -> str:
    """The LaTeX of a sum broken into lines of ``terms_per_line`` terms (an ``aligned``
    block), so that a long formula wraps on a page; other expressions as one line."""
    if terms_per_line < 1:
        raise ValueError(f"terms_per_line={terms_per_line} must be >= 1")
    terms = expr.as_ordered_terms() if isinstance(expr, sp.Add) else [expr]
    parts = [sp.latex(t) for t in terms]
    lines = [
        " + ".join(parts[i : i + terms_per_line]) for i in range(0, len(parts), terms_per_line)
    ]
    if len(lines) == 1:
        return lines[0]
    body = " \\\\\n&+ ".join(lines)
    return "\\begin{aligned}\n&" + body + "\n\\end{aligned}"
