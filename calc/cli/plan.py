"""``python -m calc plan``: the capacity planner on the command line (display only).

Wires arguments to ``calc.plan`` (``plan``, ``least_hardware``, ``changes_to_fit``) and prints
the ranked configurations, the closest excluded ones with their reasons, and the verdict.
Bytes stay bytes until printed in GiB (2**30 bytes). Values given on the command line are
matched against each axis's allowed values, never evaluated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from calc.cli import model_source
from calc.cli.exits import run_reporting_errors
from calc.config.jobs import DEVICES
from calc.config.model_spec import ModelSpec
from calc.data.gpus import DEFAULT_GPU, gpu_catalog
from calc.estimate.result import GIB
from calc.plan import planner as P
from calc.plan.axes import axes_for
from calc.plan.engine import KIND_OF_TASK, base_fields_of, context, gpu_of, kind_of, make_job
from calc.plan.result import RANK_BYS, TASKS, Change, Evaluated


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m calc plan``."""
    p = model_source.parser(
        "python -m calc plan",
        "Enumerate every configuration the cost model covers for a job and a GPU "
        "budget; list those that fit, ranked, and why the others do not.",
    )
    p.add_argument(
        "--task", default="full-finetune", help=f"{', '.join(TASKS)} (default full-finetune)"
    )
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument(
        "--global-batch", type=int, default=8,
        help="sequences per optimizer step over all GPUs, or served at once (default 8)",
    )  # fmt: skip
    p.add_argument(
        "--gpu", default=DEFAULT_GPU, help=f"GPU catalog id (default {DEFAULT_GPU}; --list-gpus)"
    )
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs (default 1)")
    p.add_argument(
        "--fix", action="append", default=[], metavar="AXIS=V[,V...]",
        help="pin an axis to one or more values, e.g. --fix precision=bf16-master",
    )  # fmt: skip
    p.add_argument(
        "--rank-by", default="throughput", help=f"{', '.join(RANK_BYS)} (default throughput)"
    )
    p.add_argument("--top", type=int, default=10, help="fitting rows shown (default 10)")
    p.add_argument("--excluded", type=int, default=5, help="excluded rows shown (default 5)")
    p.add_argument("--least-hardware", action="store_true", help="also the least hardware")
    p.add_argument(
        "--what-to-change", nargs="+", metavar="AXIS=V",
        help="for this configuration (other axes at their defaults), the smallest changes that fit",
    )  # fmt: skip
    p.add_argument("--device", choices=DEVICES, default="cuda", help="cuda (default) or cpu")
    p.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1,
        help="processes compiling structures missing from the cache (default: CPU count)",
    )  # fmt: skip
    p.add_argument("--no-error-bars", action="store_true", help="skip the verify report")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--list-gpus", action="store_true", help="print the GPU catalog and exit")
    return p


def parse_assignments(items: Sequence[str], kind: str, allow_many: bool) -> dict[str, object]:
    """``["precision=bf16,fp32", ...]`` -> ``{"precision": ("bf16", "fp32")}``; each value is
    matched against the axis's values by its text (``ValueError`` names the axis)."""
    axes = {a.name: a for a in axes_for(kind)}
    out: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in axes:
            raise ValueError(f"{item!r} must be AXIS=VALUE with AXIS one of {', '.join(axes)}")
        texts = [t.strip() for t in text.split(",") if t.strip()]
        if not texts or (len(texts) > 1 and not allow_many):
            raise ValueError(
                f"{item!r}: give {'one or more values' if allow_many else 'one value'}"
            )
        values: list[int | str] = []
        for t in texts:
            if axes[name].size:
                if not t.isdigit():
                    raise ValueError(f"{name}={t!r} must be a positive integer")
                values.append(int(t))
            else:
                values.append(t)
        out[name] = tuple(values) if allow_many else values[0]
    return out


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def _row_json(e: Evaluated) -> dict:
    return {
        "choices": dict(e.config.choices), "grad_accum": e.config.grad_accum,
        "peak_bytes": e.peak_bytes, "usable_bytes": e.usable_bytes, "fits": e.fits,
        "headroom_bytes": e.headroom_bytes, "throughput_proxy": e.throughput_proxy,
        "peak_phase": e.peak_phase, "reason": e.reason,
        "error_bar_pct": e.error_bar.max_abs_error_pct if e.error_bar else None,
    }  # fmt: skip


def _table(rows: Sequence[Evaluated], axes: Sequence[str], with_reason: bool) -> list[str]:
    head = [*axes, "accum", "peak GiB", "headroom GiB", "proxy"]
    body = [
        [*(str(e.config.choices[a]) for a in axes), str(e.config.grad_accum),
         _gib(e.peak_bytes), _gib(e.headroom_bytes), f"{e.throughput_proxy:.3f}"]
        for e in rows
    ]  # fmt: skip
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    for e, r in zip(rows, body, strict=True):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if with_reason and e.reason:
            lines.append(f"    -> {e.reason}")
    return lines


def _progress(done: int, total: int) -> None:
    if total and sys.stderr.isatty():
        bar = "#" * (30 * done // total)
        print(f"\rcompiling structures [{bar:<30}] {done}/{total}", end="", file=sys.stderr)
        if done == total:
            print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Plan and print; raises ``ValueError``/``NotImplementedError`` on bad or unmodelled input."""
    if args.list_gpus:
        for g in gpu_catalog().values():
            print(
                f"{g.id:<14} {g.usable_bytes / GIB:8.2f} GiB usable of {g.total_bytes / GIB:.2f} GiB  {g.name} ({g.marketed})"
            )
        return 0
    if args.task not in TASKS:
        raise ValueError(f"task={args.task!r} is not one of {', '.join(map(repr, TASKS))}")
    kind = KIND_OF_TASK.get(args.task, "training")
    for name in ("top", "excluded"):
        if getattr(args, name) < 0:
            raise ValueError(f"{name}={getattr(args, name)} must be >= 0")
    model, label = model_source.load_model(args)
    fixed = parse_assignments(args.fix, kind, allow_many=True)
    common: dict[str, Any] = dict(  # the arguments, validated by the planner
        task=args.task, seq_len=args.seq_len, global_batch=args.global_batch, gpu=args.gpu,
        fixed=fixed, device=args.device, error_bars=not args.no_error_bars,
    )  # fmt: skip
    if args.workers < 1:
        raise ValueError(f"workers={args.workers} must be >= 1")
    # everything the plan checks, checked before any compile
    kind_of(args.task)
    gpu_of(args.gpu)
    context(kind, args.seq_len, args.global_batch, args.gpus)
    if args.rank_by not in RANK_BYS:
        raise ValueError(f"rank_by={args.rank_by!r} is not one of {', '.join(map(repr, RANK_BYS))}")
    if args.workers > 1:  # compile what is missing from the cache in parallel, then plan
        P.precompile(
            model, task=args.task, seq_len=args.seq_len, global_batch=args.global_batch,
            gpu_count=args.gpus, fixed=fixed, device=args.device, progress=_progress,
            workers=args.workers,
        )  # fmt: skip
    result = P.plan(model, gpu_count=args.gpus, rank_by=args.rank_by, progress=_progress, **common)
    least = P.least_hardware(model, **common) if args.least_hardware else None
    changes: tuple[Change, ...] = ()
    current: Evaluated | None = None
    if args.what_to_change:
        changes, current = _changes(model, args, kind, fixed)
    if args.json:
        print(json.dumps(_json(label, result, least, changes, current), indent=2))
        return 0
    _print(label, result, least, changes, current, args)
    return 0


def _changes(
    model: ModelSpec, args: argparse.Namespace, kind: str, fixed: Mapping
) -> tuple[tuple[Change, ...], Evaluated]:
    """The changes that make the ``--what-to-change`` configuration fit, and its own verdict."""
    ctx = context(kind, args.seq_len, args.global_batch, args.gpus)
    want = parse_assignments(args.what_to_change, kind, allow_many=False)
    fields = base_fields_of(kind, None, args.task)
    for axis in axes_for(kind):
        value = want.get(axis.name, ctx.per_gpu_batch if axis.size else None)
        if value is not None:
            if axis.size and value not in axis.values(ctx):
                raise ValueError(
                    f"micro_batch={value} must divide the per-GPU batch {ctx.per_gpu_batch}"
                )
            axis.apply(fields, value, ctx)
    job = make_job(kind, fields, ctx)
    common: dict[str, Any] = dict(gpu=args.gpu, gpu_count=args.gpus, device=args.device,
                                  error_bars=not args.no_error_bars,
                                  parallel=want.get("parallel"))  # fmt: skip
    current = P.evaluate(model, job, **common)
    return P.changes_to_fit(model, job, **common), current


def _json(
    label: str, result: P.Plan, least: P.LeastHardware | None, changes: tuple[Change, ...],
    current: Evaluated | None,
) -> dict:  # fmt: skip
    out: dict = {
        "model": label, "task": result.task, "seq_len": result.seq_len,
        "global_batch": result.global_batch, "gpu": result.gpu.id, "gpu_count": result.gpu_count,
        "usable_bytes": result.gpu.usable_bytes, "n_configurations": result.n_configurations,
        "verdict": result.verdict(), "fitting": [_row_json(e) for e in result.fitting],
        "excluded": [_row_json(e) for e in result.excluded],
    }  # fmt: skip
    if least is not None:
        out["least_hardware"] = {
            "min_count": least.min_count,
            "smallest_gpu": least.smallest_gpu.id if least.smallest_gpu else None,
            "min_peak_bytes": least.min_peak_bytes,
            "note": least.note,
        }
    if current is not None:
        out["what_to_change"] = {"config": _row_json(current), "verdict": current.verdict()}
    if changes:
        out["changes_to_fit"] = [
            {"changes": {k: list(v) for k, v in c.changes.items()}, **_row_json(c.evaluated)}
            for c in changes
        ]
    return out


def _print(
    label: str, result: P.Plan, least: P.LeastHardware | None, changes: tuple[Change, ...],
    current: Evaluated | None, args: argparse.Namespace,
) -> None:  # fmt: skip
    g = result.gpu
    print(
        f"model: {label}; task {result.task}, seq_len {result.seq_len}, global batch {result.global_batch}"
    )
    print(f"hardware: {result.gpu_count} x {g.id} ({g.usable_bytes / GIB:.2f} GiB usable per GPU)")
    shown = [
        a
        for a in result.axes
        if len({str(e.config.choices[a]) for e in result.fitting + result.excluded}) > 1
    ]
    print(
        f"\n{len(result.fitting)} of {result.n_configurations} configurations fit (ranked by {result.rank_by}):"
    )
    if result.fitting and args.top:
        print("\n".join(_table(result.fitting[: args.top], shown, with_reason=False)))
    if result.excluded and args.excluded:
        print(f"\nexcluded ({len(result.excluded)}), closest first:")
        print("\n".join(_table(result.excluded[: args.excluded], shown, with_reason=True)))
    print(f"\nverdict: {result.verdict()}")
    if least is not None:
        print("\nleast hardware:")
        count = f"{least.min_count} x {least.gpu.id}" if least.min_count else "none found"
        print(f"  smallest count: {count}")
        if least.min_peak_bytes is not None:
            gpu = least.smallest_gpu.id if least.smallest_gpu else "no catalog GPU"
            print(
                f"  smallest single GPU: {gpu} (least peak over the grid {least.min_peak_bytes / GIB:.2f} GiB)"
            )
        if least.note:
            print(f"  note: {least.note}")
    if current is not None:
        picked = ", ".join(f"{k}={v}" for k, v in current.config.choices.items())
        print(f"\nthe configuration {picked}: {current.verdict()}")
        if changes:
            print("what to change to fit:")
        elif current.fits:
            print("what to change: nothing, it fits")
        else:
            print("what to change: no change of one knob, or of two, makes it fit")
        for c in changes:
            print(f"  {c.text()}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m calc plan``: 0 on success, 2 on bad input (one line)."""
    args = build_parser().parse_args(argv)
    return run_reporting_errors(run, args)
