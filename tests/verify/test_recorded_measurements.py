"""The calculator against every GPU measurement recorded under verify/measurements/.

Expected values here are measurements (``torch.cuda.max_memory_allocated`` on a real GPU),
never numbers the calculator produced. With no file recorded yet the test is skipped, and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import calc

MEASUREMENTS = Path(__file__).resolve().parents[2] / "verify" / "measurements"


def _records() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(MEASUREMENTS.glob("**/*.json")):
        report = json.loads(path.read_text())
        for rec in report.get("cases", []):
            if rec.get("device") == "cuda" and rec.get("status") in ("ok", "fail"):
                out.append((f"{path.stem}:{rec['name']}", rec))
    return out


RECORDS = _records()


@pytest.mark.skipif(not RECORDS, reason="no GPU measurement recorded yet (verify/measurements/)")
@pytest.mark.parametrize(("name", "rec"), RECORDS, ids=[n for n, _ in RECORDS] or None)
def test_prediction_within_tolerance_of_recorded_gpu_peak(name: str, rec: dict) -> None:
    model = calc.ModelSpec(**rec["spec"])
    job_cls = calc.Training if rec["kind"] == "training" else calc.Inference
    job = job_cls(**rec["job"])
    est = calc.estimate(model, job, device="cuda")
    measured = rec["measured_peak"]
    error_pct = (est.peak_bytes - measured) / measured * 100
    assert abs(error_pct) <= rec["tolerance_pct"], f"{name}: {error_pct:+.2f}%"
