"""``python -m calc report``: the least per-GPU memory to serve and to fine-tune one model.

Wires arguments to `calc.plan.report` and prints its table: rows serve / LoRA / QLoRA / full
fine-tune, columns bf16 / int8 / int4 weights, each cell the least predicted peak
(``torch.cuda.max_memory_allocated``, GiB = 2**30 bytes) and the recipe that reaches it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from calc.cli import model_source
from calc.cli.exits import run_reporting_errors
from calc.estimate.result import GIB
from calc.plan import report

TASK_LABELS = {
    "serve": "serve",
    "lora": "LoRA fine-tune",
    "qlora": "QLoRA fine-tune",
    "full": "full fine-tune",
}
GPU_SIZES_GIB: tuple[tuple[str, float], ...] = (
    ("24 GiB (RTX 4090 / L4)", 24.0),
    ("40 GiB (A100-40G)", 40.0),
    ("48 GiB (L40S / A6000)", 48.0),
    ("80 GiB (A100-80G / H100)", 80.0),
    ("141 GiB (H200)", 141.0),
)
"""Common GPU memory sizes, for "smallest GPU that holds it" (nominal capacities; the whole
capacity is never available to tensors: the CUDA context and allocator caching take some)."""


def build_parser() -> argparse.ArgumentParser:
    p = model_source.parser(
        "python -m calc report",
        "Least per-GPU memory to serve, LoRA-, QLoRA- and fully fine-tune a model "
        "on one GPU, for bf16, int8 and int4 weights, with the recipe that reaches it.",
    )
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument(
        "--seq-len", type=int, default=4096, help="context served / tokens per training sequence"
    )
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument(
        "--tasks",
        default=",".join(report.TASKS),
        help=f"comma-separated subset of {', '.join(report.TASKS)} (default all)",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _tasks(text: str) -> tuple[str, ...]:
    tasks = tuple(t.strip() for t in text.split(",") if t.strip())
    for t in tasks:
        if t not in report.TASKS:
            raise ValueError(f"tasks entry {t!r} is not one of {report.TASKS}")
    if not tasks:
        raise ValueError(f"tasks={text!r} names no task; allowed: {report.TASKS}")
    return tasks


def smallest_gpu(peak_bytes: int) -> str:
    """The smallest of `GPU_SIZES_GIB` whose capacity is at least ``peak_bytes``."""
    for label, gib in GPU_SIZES_GIB:
        if peak_bytes <= gib * GIB:
            return label
    return "none of one GPU (shard it)"


def _cell_json(task: str, width: str, r: report.Recipe | report.Unavailable | None) -> dict:
    """One cell as JSON: the recipe, or ``applies: false``, or the reasons nothing ran."""
    if r is None:
        return {"task": task, "width": width, "applies": False}
    if isinstance(r, report.Unavailable):
        return {"task": task, "width": width, "applies": True, "not_modelled": list(r.reasons)}
    return {
        "task": task,
        "width": width,
        "applies": True,
        "peak_bytes": r.peak_bytes,
        "peak_gib": r.peak_bytes / GIB,
        "recipe": report.describe(r.job),
        "peak_phase": r.peak_phase,
        "searched": r.searched,
        "breakdown": dict(r.parts),
    }


def run(args: argparse.Namespace) -> int:
    model, label = model_source.load_model(args)
    tasks = _tasks(args.tasks)
    cells = report.report(
        model, batch=args.batch, seq_len=args.seq_len, lora_rank=args.lora_rank,
        device=args.device, tasks=tasks,
    )  # fmt: skip
    if args.json:
        out = {
            "model": label,
            "n_params": int(model.n_params),
            "batch": args.batch,
            "seq_len": args.seq_len,
            "device": args.device,
            "cells": [_cell_json(t, w, r) for (t, w), r in cells.items()],
        }
        print(json.dumps(out, indent=2))
        return 0
    n = int(model.n_params)
    print(f"model: {label}: {n:,} parameters ({n / 1e9:.2f} billion)")
    print(
        f"least per-GPU memory, predicted torch.cuda.max_memory_allocated ({args.device}), "
        f"batch {args.batch}, {args.seq_len} tokens; GiB = 2^30 bytes"
    )
    print()
    head = f"{'':18}" + "".join(f"{w:>14}" for w in report.WIDTHS)
    print(head)
    print("-" * len(head))
    for t in tasks:
        row = f"{TASK_LABELS[t]:18}"
        for w in report.WIDTHS:
            r = cells[(t, w)]
            if r is None:
                row += f"{'n/a':>14}"
            elif isinstance(r, report.Unavailable):
                row += f"{'not modelled':>14}"
            else:
                row += f"{r.peak_bytes / GIB:>10.2f} GiB"
        print(row)
    print()
    print("recipes (the least of the candidates searched; every estimate is calc's replay of")
    print("verify's plain-PyTorch model, whose quantized linears and adapters verify measures):")
    for (t, w), r in cells.items():
        if r is None:
            continue
        if isinstance(r, report.Unavailable):
            print(f"  {TASK_LABELS[t]}, {w}: not modelled: {'; '.join(r.reasons)}")
            continue
        print(
            f"  {TASK_LABELS[t]}, {w}: {r.peak_bytes / GIB:.2f} GiB at {r.peak_phase}; "
            f"{report.describe(r.job)} (best of {r.searched}); fits {smallest_gpu(r.peak_bytes)}"
        )
        shares = ", ".join(f"{k} {n / GIB:.2f}" for k, n in r.parts if n >= GIB // 100)
        print(f"      at the peak (GiB): {shares}")
    print()
    print("n/a: a quantized model is not fully fine-tuned; a bf16 base is LoRA, not QLoRA.")
    print(
        "Quantized linears run dequantize-then-matmul (one dense weight alive per matmul; NF4 as "
        "bitsandbytes' dequantize_4bit allocates it); fused int4/fp8 GEMM kernels hold less."
    )
    print("Recipes are single-GPU: no tensor/pipeline/data parallelism or ZeRO sharding.")
    return 0


def main(argv: Sequence[str]) -> int:
    """``python -m calc report ...``: 0 on success, 2 on bad input (one line on stderr)."""
    args = build_parser().parse_args(list(argv))
    return run_reporting_errors(run, args)
