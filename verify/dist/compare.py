"""Per-rank comparison of a distributed case: measured (from the ranks' JSON) vs predicted.

The case's measured peak is the maximum over its steps and ranks; its predicted peak is
``calc.estimate(spec, job, device="cpu", parallel=case.parallel)``, the most-loaded rank. Per rank,
``extra["ranks"]`` holds the measured peak (max over steps), the step it came from, every step's
peak, and the predicted peak of that rank (``Estimate.rank_peaks`` when calc gives them); the
report's per-rank table (`verify.run.report.per_rank_markdown`) is made from it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import calc
from verify.cases.case import DistCase
from verify.run.runner import Record


def predict(case: DistCase) -> tuple[Any | None, str]:
    """``(estimate, "")`` or ``(None, why)`` when calc does not model the layout."""
    try:
        return calc.estimate(case.spec(), case.job, device="cpu", parallel=case.parallel), ""
    except NotImplementedError as exc:
        return None, f"not modelled: {exc}"


def _record(case: DistCase, seconds: float) -> Record:
    job = case.job
    return Record(
        name=case.name,
        card=case.card,
        impl=case.impl,
        kind="distributed",
        label=case.label(),
        tags=["distributed", f"nproc{case.nproc}", *case.tags],
        tolerance_pct=case.tolerance_pct,
        device="cpu",
        spec=asdict(case.spec()),
        job={k: getattr(job, k) for k in job.__slots__},
        seconds=seconds,
    )


def not_runnable(case: DistCase, why: str) -> Record:
    """The record of a distributed case the harness does not run here (status ``not-runnable``:
    listed and counted, not a failure)."""
    rec = _record(case, 0.0)
    rec.status, rec.message = "not-runnable", why
    return rec


def record_for(
    case: DistCase, ranks: dict[int, dict[str, Any]], log: str, seconds: float
) -> Record:
    """The `verify.run.runner.Record` of ``case`` from its ranks' results."""
    rec = _record(case, seconds)
    rec.pins = {"engine": case.engine, "parallel": asdict(case.parallel), "steps": case.steps}
    try:
        est, why = predict(case)
    except Exception as exc:
        est, why = None, ""
        rec.message = f"calc.estimate raised {type(exc).__name__}: {exc}"
    if est is not None:
        rec.set_prediction(est)
    missing = [r for r in range(case.nproc) if r not in ranks]
    errors = [v for v in ranks.values() if v.get("status") != "ok"]
    if errors or missing:
        rec.status = "error"
        first = errors[0]["message"] if errors else f"no result from ranks {missing}"
        rec.message = f"{first}\n--- torchrun output (tail) ---\n{log[-2000:]}"
        return rec
    per_rank: dict[str, Any] = {}
    rank_pred = dict(getattr(est, "rank_peaks", None) or {}) if est is not None else {}
    for r, res in sorted(ranks.items()):
        step_peaks = [s["peak"] for s in res["steps"]]
        per_rank[str(r)] = {
            "measured": res["peak"],
            "peak_step": res["peak_step"],
            "step_peaks": step_peaks,
            "predicted": rank_pred.get(r, rec.predicted_peak),
        }
    worst = max(ranks, key=lambda r: ranks[r]["peak"])
    top = ranks[worst]
    step = top["steps"][top["peak_step"] - 1]
    rec.measured_peak = top["peak"]
    rec.measured_peak_phase = step["peak_phase"]
    rec.measured_peak_op = step["peak_op"]
    phases: dict[str, int] = {}
    for res in ranks.values():
        for s in res["steps"]:
            for p, b in s["phases"].items():
                phases[p] = max(phases.get(p, 0), b)
    rec.measured_phases = phases
    all_peaks = [p for v in per_rank.values() for p in v["step_peaks"]]
    rec.extra = {
        "ranks": per_rank,
        "most_loaded_rank": worst,
        "spread_bytes": max(all_peaks) - min(all_peaks),
        "top_ops_at_peak": step["top_ops_at_peak"],
    }
    if est is None:
        if not rec.message:
            rec.status, rec.message = "not-modelled", why
        else:
            rec.status = "error"
        return rec
    rec.error_pct = (rec.predicted_peak - rec.measured_peak) / rec.measured_peak * 100
    rec.status = "ok" if abs(rec.error_pct) <= case.tolerance_pct else "fail"
    return rec

