"""Reports of a verification run: a table, ``report.json``, ``report.md`` and a plot.

Bytes stay bytes in the JSON; tables show MiB (2**20 bytes, labelled MiB).
"""

from __future__ import annotations

import json
import platform
import statistics
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from verify.runner import FAILING, Record

MIB = 1 << 20
DEFAULT_OUT = Path(__file__).resolve().parent / "reports" / "latest"


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"


def summary(records: Sequence[Record]) -> dict[str, Any]:
    """Counts by outcome and the |error| statistics of the compared cases."""
    compared = [abs(r.error_pct) for r in records if r.error_pct is not None]
    return {
        "cases": len(records),
        "within_tolerance": sum(r.status == "ok" for r in records),
        "failed": sum(r.status in FAILING for r in records),
        "not_modelled": sum(r.status in ("not-modelled", "not-runnable") for r in records),
        "not_runnable": sum(r.status == "not-runnable" for r in records),
        "oom": sum(r.status == "oom" for r in records),
        "median_abs_error_pct": statistics.median(compared) if compared else None,
        "max_abs_error_pct": max(compared) if compared else None,
    }


def summary_line(records: Sequence[Record]) -> str:
    """``N cases: X within tolerance, Y failed, Z not modelled; median |error| M%, max E%``."""
    s = summary(records)
    med = "-" if s["median_abs_error_pct"] is None else f"{s['median_abs_error_pct']:.3f}"
    top = "-" if s["max_abs_error_pct"] is None else f"{s['max_abs_error_pct']:.3f}"
    extra = ""
    if s["not_runnable"]:
        extra = f" (of which {s['not_runnable']} not runnable by the harness yet)"
    if s["oom"]:
        extra += f", {s['oom']} out of memory"
    return (
        f"{s['cases']} cases: {s['within_tolerance']} within tolerance, {s['failed']} failed, "
        f"{s['not_modelled']} not modelled{extra}; median |error| {med}%, max {top}%"
    )


HEADER = ("case", "predicted MiB", "measured MiB", "error %", "peak phase", "status")


def row(r: Record) -> tuple[str, ...]:
    """One table row: name, predicted, measured, error, measured peak phase, status."""
    return (
        r.name,
        _mib(r.predicted_peak),
        _mib(r.measured_peak),
        _pct(r.error_pct),
        r.measured_peak_phase or "-",
        r.status,
    )


def format_row(cells: Sequence[str]) -> str:
    widths = (34, 14, 14, 9, 18, 12)
    return " ".join(c.ljust(w) if i in (0, 4, 5) else c.rjust(w)
                    for i, (c, w) in enumerate(zip(cells, widths, strict=True)))  # fmt: skip


def markdown(records: Sequence[Record], meta: dict[str, Any]) -> str:
    """The Markdown report: summary, compared cases, per-component misses, the rest."""
    lines = ["# vramplan verification report", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", f"**{summary_line(records)}**", "", "![predicted vs measured](pred_vs_meas.png)"]
    compared = [r for r in records if r.status not in ("not-modelled", "not-runnable")]
    lines += ["", "## Cases", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in compared]
    misses = [r for r in records if r.status in FAILING]
    if misses:
        lines += ["", "## Misses", ""]
        for r in misses:
            lines.append(f"### {r.name} ({r.status})")
            lines.append("")
            if r.message:
                lines += ["```", r.message.strip(), "```"]
            if r.measured_categories:
                cats = ", ".join(f"{k} {_mib(v)}" for k, v in r.measured_categories.items())
                lines.append(f"- measured at peak ({r.measured_peak_phase}, op "
                             f"`{r.measured_peak_op}`), MiB: {cats}")  # fmt: skip
            if r.predicted_breakdown:
                top = {k: v for k, v in r.predicted_breakdown.items() if k.count("/") == 0}
                parts = ", ".join(f"{k} {_mib(v)}" for k, v in top.items())
                lines.append(f"- predicted at peak ({r.predicted_peak_phase}, event "
                             f"`{r.predicted_peak_event}`), MiB: {parts}")  # fmt: skip
            phases = sorted(set(r.measured_phases) | set(r.predicted_phases))
            if phases:
                lines.append("- per phase (predicted / measured MiB): " + ", ".join(
                    f"{p} {_mib(r.predicted_phases.get(p))}/{_mib(r.measured_phases.get(p))}"
                    for p in phases))  # fmt: skip
            lines.append("")
    rest = [r for r in records if r.status in ("not-modelled", "not-runnable")]
    if rest:
        lines += ["", "## Not modelled / not runnable", "", "| case | status | why |",
                  "|---|---|---|"]  # fmt: skip
        lines += [f"| {r.name} | {r.status} | {r.message.splitlines()[0]} |" for r in rest]
    return "\n".join(lines) + "\n"


def plot(records: Sequence[Record], path: Path) -> None:
    """Predicted vs measured peak, one point per compared case, coloured by precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    points = [r for r in records if r.predicted_peak and r.measured_peak]
    labels = sorted({r.label for r in points})
    for label in labels:
        xs = [r.measured_peak / MIB for r in points if r.label == label]
        ys = [r.predicted_peak / MIB for r in points if r.label == label]
        ax.scatter(xs, ys, label=label, s=22, alpha=0.8)
    if points:
        lo = min(min(r.measured_peak, r.predicted_peak) for r in points) / MIB * 0.8
        hi = max(max(r.measured_peak, r.predicted_peak) for r in points) / MIB * 1.25
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1, label="y = x")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title(f"calc.estimate vs measurement ({len(points)} cases)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_meta(device: str) -> dict[str, Any]:
    """Where and when the run happened."""
    import torch

    meta: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        meta["transformers"] = None
    return meta


def write_report(records: Sequence[Record], out: Path, meta: dict[str, Any]) -> list[Path]:
    """Write ``report.json``, ``report.md`` and ``pred_vs_meas.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "summary": summary(records), "cases": [r.as_dict() for r in records]}
    paths = [out / "report.json", out / "report.md", out / "pred_vs_meas.png"]
    paths[0].write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(records, meta), encoding="utf-8")
    plot(records, paths[2])
    return paths
