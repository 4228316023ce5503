"""Reports of a verification run: a table, ``report.json``, ``report.md`` and a plot.

Bytes stay bytes in the JSON; tables show MiB (2**20 bytes, labelled MiB).
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from calc.config.parallelism import Parallelism
from verify.cases.single import CASES
from verify.measure.tracker import CATEGORIES
from verify.run.runner import FAILING, Record

MIB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "verify" / "reports" / "latest"
"""The committed report of the full battery (the README's accuracy section is made from it)."""
SUBSET_OUT = REPO_ROOT / "verify" / "reports" / "subset"
"""Where a filtered run (``--cases``, ``--impl``, ``--quick``) writes unless ``--out`` is given,
so that a partial run never overwrites the committed full report."""


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


# ---------------------------------------------------------------------- order and scrubbing


def _group(name: str) -> str:
    """A case's group: its name up to the first ``-`` (``prec``, ``opt``, ``hf``, ``infer``...)."""
    return name.split("-", 1)[0]


def ordered(records: Sequence[Any]) -> list[Any]:
    """Records (or their dicts) grouped as `verify.cases.single.CASES` lists the groups, by name within
    a group; groups unknown to ``CASES`` come last, alphabetically. Independent of run order."""
    rank: dict[str, int] = {}
    for c in CASES:
        rank.setdefault(_group(c.name), len(rank))

    def key(r: Any) -> tuple[int, str, str]:
        name = _get(r, "name")
        group = _group(name)
        return (rank.get(group, len(rank)), group, name)

    return sorted(records, key=key)


_SITE = re.compile(r"(/[^\s\"']*)?/(site|dist)-packages/")


def scrub(text: str) -> str:
    """``text`` without machine-specific paths: the repository root becomes relative and
    ``.../site-packages/`` becomes ``<site-packages>/`` (tracebacks in messages)."""
    text = text.replace(str(REPO_ROOT) + "/", "")
    text = _SITE.sub("<site-packages>/", text)
    return text.replace(sys.prefix, "<prefix>")


def _get(rec: Any, field: str, default: Any = None) -> Any:
    return rec.get(field, default) if isinstance(rec, Mapping) else getattr(rec, field, default)


# ---------------------------------------------------------------------- per component

CATEGORY_OF: dict[str, str] = {
    "weights": "parameters",
    "buffers": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer",
    "inputs": "inputs",
    "activations": "activations",
    "temporaries": "temporaries",
    "kv_cache": "temporaries",
}
"""calc's top-level breakdown keys -> the tracker's categories (`verify.measure.tracker.CATEGORIES`).

``buffers`` join ``weights`` because ``attribute`` counts ``model.buffers()`` as parameters.
``kv_cache`` -> ``temporaries``: the prefill runs under ``no_grad`` and the cache is no
registered source, so the tracker sees its storages as neither classified nor autograd-saved.
Keys not listed (``cuda/...`` workspaces, ``other/...``) have no tracker counterpart: they are
reported apart (`components` ``unmapped``), never folded into a category."""

AMBIGUITIES: tuple[str, ...] = (
    "The tracker gives a storage that is in two categories to the earlier one, in the order "
    + ", ".join(CATEGORIES)
    + ": a weight autograd saves counts as parameters, saved token ids as inputs.",
    "The tracker resolves parameters, gradients and optimizer states when a phase is marked and "
    "at the end; a gradient or state that lives only between two marks (the fp32 master "
    "gradients of `bf16-master`, set and freed inside the optimizer step) is counted as a "
    "temporary, while calc calls it a gradient.",
    "The tracker calls a storage an activation as soon as autograd saves it for backward; calc "
    "counts its `saved` tensors as activations and everything else as temporaries, so a tensor "
    "both sides see but classify differently moves bytes between activations and temporaries.",
    "calc's `kv_cache` is compared with the tracker's temporaries (the cache is no registered "
    "source and nothing under `no_grad` is saved).",
    "The predicted breakdown is taken at the predicted peak and the measured categories at the "
    "measured peak: when the two peaks fall in different phases the components describe "
    "different moments (flagged per case).",
    "The CUDA backend records no categories: per-component comparison is CPU-only.",
)
"""Where the mapping is inherently ambiguous; printed with the per-component tables."""


def components(rec: Any) -> dict[str, Any]:
    """Predicted vs measured bytes per tracker category at the peak, for a `Record` or its dict.

    Returns ``comparable`` (both sides present), ``predicted``/``measured``/``diff`` (predicted
    minus measured) per `CATEGORIES`, ``unmapped`` (predicted keys with no tracker category),
    ``totals_agree`` (the category sums and the unmapped terms agree) and ``caveats``.
    """
    breakdown: Mapping[str, int] = _get(rec, "predicted_breakdown") or {}
    measured: Mapping[str, int] = _get(rec, "measured_categories") or {}
    top = {k: int(v) for k, v in breakdown.items() if "/" not in k and k != "total"}
    predicted = dict.fromkeys(CATEGORIES, 0)
    unmapped: dict[str, int] = {}
    for key, nbytes in top.items():
        cat = CATEGORY_OF.get(key)
        if cat is None:
            unmapped[key] = nbytes
        else:
            predicted[cat] += nbytes
    caveats: list[str] = []
    out: dict[str, Any] = {
        "comparable": bool(top) and bool(measured),
        "predicted": predicted,
        "measured": {c: int(measured.get(c, 0)) for c in CATEGORIES} if measured else {},
        "diff": {},
        "unmapped": unmapped,
        "totals_agree": False,
        "caveats": caveats,
    }
    if not top:
        caveats.append("no prediction")
    if not measured:
        caveats.append("no measured categories (only the CPU tracker attributes bytes)")
    if not out["comparable"]:
        return out
    diff = {c: predicted[c] - out["measured"][c] for c in CATEGORIES}
    out["diff"] = diff
    out["totals_agree"] = not unmapped and sum(diff.values()) == 0
    pphase, mphase = _get(rec, "predicted_peak_phase", ""), _get(rec, "measured_peak_phase", "")
    if pphase != mphase:
        caveats.append(
            f"peaks in different phases (predicted {pphase}, measured {mphase}): "
            "the components describe different moments"
        )
    if "kv_cache" in top:
        caveats.append("kv_cache compared as temporaries")
    if unmapped:
        caveats.append(
            "not seen by the tracker: " + ", ".join(f"{k} {v:,} B" for k, v in unmapped.items())
        )
    job = _get(rec, "job") or {}
    if job.get("precision") == "bf16-master" and diff["gradients"] > 0 > diff["temporaries"]:
        caveats.append(
            "bf16-master: the fp32 master gradients live only inside the optimizer step; the "
            "tracker counts them as temporaries, calc as gradients"
        )
    others = [diff[c] for c in CATEGORIES if c not in ("activations", "temporaries")]
    if diff["activations"] and diff["activations"] == -diff["temporaries"] and not any(others):
        caveats.append(
            "bytes moved between activations and temporaries: a tensor autograd saves that calc "
            "counts as a temporary, or the reverse"
        )
    if out["totals_agree"] and any(diff.values()):
        caveats.append("totals agree: bytes are attributed to other categories, not missing")
    return out


def _b(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _sb(n: int) -> str:
    return f"{n:+,}" if n else "0"


def component_summary(records: Sequence[Any]) -> list[dict[str, Any]]:
    """Per category: cases compared, cases where predicted != measured, and of those how many
    have a total error of zero (bytes attributed elsewhere, not missing)."""
    comps = [(r, components(r)) for r in records]
    comps = [(r, c) for r, c in comps if c["comparable"]]
    rows = []
    for cat in CATEGORIES:
        differ = [(r, c) for r, c in comps if c["diff"][cat]]
        rows.append({
            "category": cat,
            "compared": len(comps),
            "differ": len(differ),
            "differ_total_agrees": sum(c["totals_agree"] for _, c in differ),
        })  # fmt: skip
    return rows


def component_markdown(records: Sequence[Any]) -> list[str]:
    """The ``Per-component comparison`` section of report.md."""
    comps = [(r, components(r)) for r in ordered(records)]
    compared = [(r, c) for r, c in comps if c["comparable"]]
    lines = ["", "## Per-component comparison", ""]
    lines += [
        "calc's breakdown at its peak, mapped onto the tracker's categories at the measured "
        "peak: " + ", ".join(f"{k} -> {v}" for k, v in CATEGORY_OF.items())
        + ". Bytes, not MiB. Where the mapping is ambiguous:",
        "",
    ]  # fmt: skip
    lines += [f"- {a}" for a in AMBIGUITIES]
    if not compared:
        lines += ["", "_No case has both a predicted breakdown and measured categories._"]
        return lines
    lines += ["", f"### Summary ({len(compared)} cases with both sides)", ""]
    lines += ["| category | cases where predicted != measured | of which the total agrees |",
              "|---|---|---|"]  # fmt: skip
    for row_ in component_summary(records):
        lines.append(f"| {row_['category']} | {row_['differ']} | {row_['differ_total_agrees']} |")
    unmapped = sorted({k for _, c in compared for k in c["unmapped"]})
    if unmapped:
        lines.append(f"| not seen by the tracker ({', '.join(unmapped)}) | "
                     f"{sum(bool(c['unmapped']) for _, c in compared)} | - |")  # fmt: skip
    missed = [(r, c) for r, c in compared if _get(r, "error_pct")]
    lines += ["", "### Cases with a non-zero error", ""]
    if not missed:
        lines += ["_None._", ""]
    for r, c in missed:
        lines += [f"#### {_get(r, 'name')} ({_get(r, 'error_pct'):+.3f} %, {_get(r, 'status')})",
                  "", "| category | predicted B | measured B | predicted - measured B |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for cat in CATEGORIES:
            lines.append(f"| {cat} | {_b(c['predicted'][cat])} | {_b(c['measured'][cat])} | "
                         f"{_sb(c['diff'][cat])} |")  # fmt: skip
        for key, nbytes in c["unmapped"].items():
            lines.append(f"| {key} (not seen by the tracker) | {_b(nbytes)} | - | - |")
        ptotal = sum(c["predicted"].values()) + sum(c["unmapped"].values())
        mtotal = sum(c["measured"].values())
        lines.append(f"| **total** | {_b(ptotal)} | {_b(mtotal)} | {_sb(ptotal - mtotal)} |")
        if c["caveats"]:
            lines += [""] + [f"- {x}" for x in c["caveats"]]
        lines.append("")
    moved = [(r, c) for r, c in compared if not _get(r, "error_pct") and any(c["diff"].values())]
    if moved:
        lines += ["### Zero total error, components differ", "",
                  "| case | predicted - measured B | why |", "|---|---|---|"]  # fmt: skip
        for r, c in moved:
            parts = ", ".join(f"{k} {_sb(v)}" for k, v in c["diff"].items() if v)
            why = "; ".join(c["caveats"]) or "-"
            lines.append(f"| {_get(r, 'name')} | {parts} | {why} |")
    return lines


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


def per_rank_markdown(records: list[Any]) -> list[str]:
    """Report lines: per-rank predicted vs measured for the distributed records (none when
    there are none). Measured is the maximum over the rank's steps; the spread is the largest
    minus the smallest step peak over all ranks."""
    dist = [r for r in records if getattr(r, "kind", "") == "distributed" and r.extra.get("ranks")]
    if not dist:
        return []
    lines = [
        "",
        "## Distributed cases, per rank",
        "",
        "Each rank measures its own peak under the CPU tracker, entered before the model and its "
        "wrapper are built, reset at the start of each step; measured = the maximum over the "
        "steps. The case's measured peak is the maximum over ranks; calc predicts every rank.",
        "",
        "| case | layout | rank | predicted MiB | measured MiB | error % | step peaks MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    defaults = asdict(Parallelism())
    for r in dist:
        par = r.pins.get("parallel", {})
        layout = ", ".join(f"{k}={v}" for k, v in par.items() if v != defaults.get(k))
        layout = f"{r.pins.get('engine', '')}: {layout}"
        for rank, v in r.extra["ranks"].items():
            pred, meas = v.get("predicted"), v["measured"]
            err = "-" if pred is None else f"{(pred - meas) / meas * 100:+.3f}"
            steps = " / ".join(_mib(p) for p in v["step_peaks"])
            lines.append(
                f"| {r.name} | {layout} | {rank} | {_mib(pred)} | {_mib(meas)} | {err} | {steps} |"
            )
    return lines


def markdown(records: Sequence[Record], meta: dict[str, Any]) -> str:
    """The Markdown report: summary, compared cases, misses, the per-component comparison, the
    rest. Cases are in `ordered` order; messages are `scrub`bed."""
    records = ordered(records)
    lines = ["# vramplan verification report", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", f"**{summary_line(records)}**", "", "![predicted vs measured](pred_vs_meas.png)"]
    compared = [r for r in records if r.status not in ("not-modelled", "not-runnable")]
    lines += ["", "## Cases", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in compared]
    lines += per_rank_markdown(compared)
    misses = [r for r in records if r.status in FAILING]
    if misses:
        lines += ["", "## Misses", ""]
        for r in misses:
            lines.append(f"### {r.name} ({r.status})")
            lines.append("")
            if r.message:
                lines += ["```", scrub(r.message.strip()), "```"]
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
    lines += component_markdown(records)
    rest = [r for r in records if r.status in ("not-modelled", "not-runnable")]
    if rest:
        lines += ["", "## Not modelled / not runnable", "", "| case | status | why |",
                  "|---|---|---|"]  # fmt: skip
        lines += [f"| {r.name} | {r.status} | {_first_line(r.message)} |" for r in rest]
    return "\n".join(lines) + "\n"


def _first_line(message: str) -> str:
    lines = scrub(message).strip().splitlines()
    return lines[0].replace("|", "\\|") if lines else "-"


def plot(records: Sequence[Record], path: Path) -> None:
    """Predicted vs measured peak, one point per compared case, coloured by precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    points = [r for r in ordered(records) if r.predicted_peak and r.measured_peak]
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
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)


def run_meta(device: str) -> dict[str, Any]:
    """Where and when the run happened: the date only (one line that changes per day, so the
    reports can be committed), no host names or paths."""
    import torch

    meta: dict[str, Any] = {
        "date": datetime.now(UTC).date().isoformat(),
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


def case_dict(r: Record) -> dict[str, Any]:
    """One case of report.json: the record without ``seconds``, scrubbed, with ``components``."""
    d = r.as_dict()
    d.pop("seconds", None)
    d["message"] = scrub(d["message"])
    d["components"] = components(r)
    return d


def write_report(records: Sequence[Record], out: Path, meta: dict[str, Any]) -> list[Path]:
    """Write ``report.json``, ``report.md`` and ``pred_vs_meas.png`` under ``out``.

    Deterministic for the same results: cases in `ordered` order, messages `scrub`bed, no
    per-case wall time (``seconds``), no timestamp but ``meta["date"]``, a PNG without metadata.
    Each case gains ``components`` (`components`)."""
    out.mkdir(parents=True, exist_ok=True)
    records = ordered(records)
    data = {
        "meta": meta,
        "summary": summary(records),
        "component_summary": component_summary(records),
        "cases": [case_dict(r) for r in records],
    }
    paths = [out / "report.json", out / "report.md", out / "pred_vs_meas.png"]
    paths[0].write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(records, meta), encoding="utf-8")
    plot(records, paths[2])
    return paths
