"""Print the README's "How accurate is it?" section from the latest verification report.

    python scripts/accuracy_section.py                   # print the section body
    python scripts/accuracy_section.py --write README.md # replace it in place

Reads ``verify/reports/latest/report.json`` (or ``--report``), standard library only. The body
says how many cases ran per implementation and status, the median and largest |error| per
implementation against the bar of issue 3, which combinations calc does not model yet, which
backend measured (the CPU storage tracker until a GPU measurement is recorded) and links the
predicted-vs-measured plot. ``--write`` replaces only the lines between the
``## How accurate is it?`` heading and the next ``## `` heading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REPORT = Path("verify/reports/latest/report.json")
PLOT = "verify/reports/latest/pred_vs_meas.png"
HEADING = "## How accurate is it?"

BARS: dict[tuple[str, str], tuple[float, float]] = {
    ("cpu", "reference"): (1.0, 0.3),
    ("cpu", "hf"): (3.0, 1.0),
    ("cuda", "reference"): (3.0, 1.0),
    ("cuda", "hf"): (3.0, 1.0),
    ("cpu", "distributed"): (3.0, 0.5),
    ("cuda", "distributed"): (3.0, 0.5),
}
"""(device, implementation) -> (every case within, median within), |error| in %, from issue 3;
distributed cases (``python -m verify --nproc``, any implementation) from issue 4: each within
its stated tolerance (1 %, or 3 % where gloo's communication buffers are named), median 0.5 %."""

STATUS_ORDER = ("ok", "fail", "error", "oom", "not-modelled", "not-runnable")
NOT_COMPARED = ("not-modelled", "not-runnable")
FAILING = ("fail", "error", "oom")
IMPL_ORDER = ("reference", "hf", "distributed")


def _impl(case: Mapping[str, Any]) -> str:
    """The row a case counts in: its implementation, or ``distributed`` for multi-rank cases."""
    return "distributed" if case.get("kind") == "distributed" else case["impl"]


def _impls(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    seen = {_impl(c) for c in cases}
    return [i for i in IMPL_ORDER if i in seen] + sorted(seen - set(IMPL_ORDER))


def impl_stats(cases: Sequence[Mapping[str, Any]], impl: str, device: str) -> dict[str, Any]:
    """Counts by status, median/max |error| over the compared cases, and the bar's verdict."""
    mine = [c for c in cases if _impl(c) == impl]
    errors = [abs(c["error_pct"]) for c in mine if c.get("error_pct") is not None]
    counts = {s: 0 for s in STATUS_ORDER}
    for c in mine:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    bar = BARS.get((device, impl), BARS.get(("cuda", impl), (3.0, 1.0)))
    median = statistics.median(errors) if errors else None
    top = max(errors) if errors else None
    failing = sum(c["status"] in FAILING for c in mine)
    met = (
        bool(errors) and not failing and top is not None and top <= bar[0] and median <= bar[1]
    )  # fmt: skip
    return {
        "impl": impl,
        "cases": len(mine),
        "counts": counts,
        "compared": len(errors),
        "median_abs_error_pct": median,
        "max_abs_error_pct": top,
        "bar": bar,
        "met": met,
        "failing": failing,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} %"


def _bar_text(s: Mapping[str, Any]) -> str:
    every, median = s["bar"]
    return f"every case ≤ {every:g} %, median ≤ {median:g} %"


def _verdict(s: Mapping[str, Any]) -> str:
    if not s["compared"]:
        return "not yet: no compared case"
    if s["met"]:
        text = f"**met** ({s['compared']} compared cases"
    else:
        text = f"**not met** ({s['compared']} compared cases"
    if s["failing"]:
        text += f", {s['failing']} failing"
    rest = sum(s["counts"].get(k, 0) for k in NOT_COMPARED)
    if rest:
        text += f"; {rest} not modelled/runnable, outside the bar until modelled"
    return text + ")"


def not_modelled(cases: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, list[str]]]:
    """(status, reason, case names) per distinct reason, in first-seen order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for c in cases:
        if c["status"] not in NOT_COMPARED:
            continue
        lines = (c.get("message") or "").strip().splitlines()
        why = lines[0] if lines else "(no reason recorded)"
        why = why.removeprefix("not modelled: ")
        groups.setdefault((c["status"], why), []).append(c["name"])
    return [(st, why, sorted(names)) for (st, why), names in groups.items()]


def beyond_bar(
    cases: Sequence[Mapping[str, Any]], stats: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """Compared cases whose |error| exceeds their implementation group's per-case bar, worst
    first: the cases that make a group's verdict "not met"."""
    bars = {s["impl"]: s["bar"][0] for s in stats}
    out = [
        c for c in cases
        if c.get("error_pct") is not None and abs(c["error_pct"]) > bars.get(_impl(c), 3.0)
    ]  # fmt: skip
    return sorted(out, key=lambda c: -abs(c["error_pct"]))


def section(report: Mapping[str, Any]) -> str:
    """The Markdown body of the "How accurate is it?" section (no heading)."""
    meta = report.get("meta", {})
    cases = report.get("cases", [])
    device = meta.get("device", "cpu")
    stats = [impl_stats(cases, impl, device) for impl in _impls(cases)]
    present = [s for s in STATUS_ORDER if any(st["counts"].get(s) for st in stats)]
    present += sorted({k for st in stats for k, v in st["counts"].items() if v} - set(present))
    lines = [
        "<!-- generated by scripts/accuracy_section.py from verify/reports/latest/report.json;"
        " edit the script, not this text -->",
        "",
    ]
    versions = ", ".join(
        f"{k} {meta[k]}" for k in ("torch", "transformers") if meta.get(k)
    )  # fmt: skip
    when = f" on {meta['date']}" if meta.get("date") else ""
    if device == "cpu":
        lines.append(
            f"`python -m verify` runs {len(cases)} scaled-down real models and compares "
            '`calc.estimate(..., device="cpu")` with the peak measured by the CPU storage '
            f"tracker ({versions}{when}). These are CPU-tracker measurements: the CUDA-only terms "
            "(cuBLAS workspaces, kernel choice on the GPU, reserved memory) are checked against "
            "the recorded GPU runs instead ([verify/measurements](verify/measurements/README.md), "
            "tested on every CI run)."
        )
    else:
        gpu = next((c.get("extra", {}).get("gpu") for c in cases if c.get("extra")), None)
        lines.append(
            f"`python -m verify --device cuda` runs {len(cases)} scaled-down real models and "
            "compares `calc.estimate(...)` with `torch.cuda.max_memory_allocated()`"
            f"{' on ' + gpu if gpu else ''} ({versions}{when})."
        )
    lines += ["", "| implementation | cases | " + " | ".join(present)
              + " | median abs error | max abs error | bar (issue 3) | met? |",
              "|---|---:|" + "---:|" * len(present) + "---:|---:|---|---|"]  # fmt: skip
    for s in stats:
        counts = " | ".join(str(s["counts"].get(k, 0)) for k in present)
        lines.append(
            f"| {s['impl']} | {s['cases']} | {counts} | {_pct(s['median_abs_error_pct'])} | "
            f"{_pct(s['max_abs_error_pct'])} | {_bar_text(s)} | {_verdict(s)} |"
        )
    beyond = beyond_bar(cases, stats)
    if beyond:
        lines += ["", "Beyond their group's bar (each within its own case tolerance, which the "
                  "case's note in `verify/` explains):", ""]  # fmt: skip
        for c in beyond:
            tol = c.get("tolerance_pct")
            own = f", its tolerance {tol:g} %" if tol is not None else ""
            lines.append(
                f"- {c['name']} ({_impl(c)}): {c['error_pct']:+.3f} %{own}; predicted "
                f"{c.get('predicted_peak', '?'):,} B, measured {c.get('measured_peak', '?'):,} B"
            )
    groups = not_modelled(cases)
    if groups:
        lines += ["", "Not modelled yet (listed, counted, not compared):", ""]
        for status, why, names in groups:
            tag = "" if status == "not-modelled" else f" ({status})"
            lines.append(f"- {why}{tag}: {', '.join(names)}")
    lines += [
        "",
        "Per-case numbers, the per-component comparison (which term a miss comes from) and the "
        "cases are in [verify/reports/latest/report.md](verify/reports/latest/report.md).",
        "",
        f"![predicted vs measured peak, one point per case]({PLOT})",
    ]
    return "\n".join(lines) + "\n"


def replace_section(text: str, body: str, heading: str = HEADING) -> str:
    """``text`` with the lines between ``heading`` and the next ``## `` heading replaced by
    ``body`` (one blank line after the heading and before the next one). Raises ``ValueError``
    when the heading is missing or appears twice."""
    lines = text.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.rstrip("\r\n").rstrip() == heading]
    if len(hits) != 1:
        raise ValueError(f"expected one {heading!r} line, found {len(hits)}")
    start = hits[0] + 1
    end = next(
        (i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines)
    )  # fmt: skip
    new = ["\n", body.strip("\n") + "\n"]
    if end < len(lines):
        new.append("\n")
    return "".join(lines[:start] + new + lines[end:])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", type=Path, default=ROOT / REPORT, help="report.json to read")
    p.add_argument("--write", type=Path, metavar="README", help="replace the section in this file")
    args = p.parse_args(argv)
    report = json.loads(args.report.read_text(encoding="utf-8"))
    body = section(report)
    if args.write is None:
        sys.stdout.write(body)
        return 0
    text = args.write.read_text(encoding="utf-8")
    try:
        new = replace_section(text, body)
    except ValueError as exc:
        print(f"{args.write}: {exc}", file=sys.stderr)
        return 1
    args.write.write_text(new, encoding="utf-8")
    print(f"{args.write}: section {HEADING!r} written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
