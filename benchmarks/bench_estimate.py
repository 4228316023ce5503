"""Time ``calc.estimate``: the first call in a fresh process (expressions built and compiled with
``lambdify``) and a compiled call (median over many calls).

    python benchmarks/bench_estimate.py [--card qwen2.5-32b] [--calls 2000] [--json]

Each job's first call runs in its own fresh Python process, so no compiled function is cached
from an earlier job. The compiled calls cycle through jobs that differ only in sizes (micro-batch
or batch), so they reuse one compiled function without repeating one input. Target: a compiled
estimate under 100 microseconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
TARGET_US = 100.0
"""The compiled estimate should take less than this many microseconds."""

# name -> (job class, the job's fields). Sizes vary over `SIZES` in the compiled calls.
JOBS: dict[str, tuple[str, dict[str, object]]] = {
    "train": ("Training", {"micro_batch": 1, "seq_len": 2048}),
    "infer": ("Inference", {"batch": 1, "context": 4096}),
}
SIZE_FIELD = {"train": "micro_batch", "infer": "batch"}
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def _import_calc() -> ModuleType:
    """``calc``, or exit with a message if it has no ``estimate`` yet."""
    sys.path.insert(0, str(ROOT))
    import calc

    if not hasattr(calc, "estimate"):
        sys.exit("bench_estimate: calc.estimate does not exist yet; nothing to time")
    return calc


def _make_job(calc: ModuleType, name: str, size: int | None = None) -> object:
    cls_name, fields = JOBS[name]
    if size is not None:
        fields = {**fields, SIZE_FIELD[name]: size}
    return getattr(calc, cls_name)(**fields)


def child(card: str, name: str) -> dict[str, float]:
    """In a fresh process: seconds to import calc, load the card, and make the first estimate."""
    t0 = time.perf_counter()
    calc = _import_calc()
    t1 = time.perf_counter()
    model = calc.load_card(card)
    job = _make_job(calc, name)
    t2 = time.perf_counter()
    est = calc.estimate(model, job)
    t3 = time.perf_counter()
    return {
        "import_s": t1 - t0,
        "load_card_s": t2 - t1,
        "first_s": t3 - t2,
        "peak_bytes": int(est.peak_bytes),
    }


def first_call(card: str, name: str) -> dict[str, float]:
    """``child`` run in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, __file__, "--child", name, "--card", card],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if proc.returncode != 0:
        sys.exit(proc.stderr.strip() or f"bench_estimate: child for {name!r} failed")
    return json.loads(proc.stdout)


def compiled_calls(card: str, name: str, calls: int) -> dict[str, float]:
    """Microseconds per compiled ``calc.estimate`` call: median and 10th/90th percentiles."""
    calc = _import_calc()
    model = calc.load_card(card)
    jobs = [_make_job(calc, name, n) for n in SIZES]
    for job in jobs:  # warm: compile and cache
        calc.estimate(model, job)
    times = []
    for i in range(calls):
        job = jobs[i % len(jobs)]
        t0 = time.perf_counter_ns()
        calc.estimate(model, job)
        times.append((time.perf_counter_ns() - t0) / 1000)
    deciles = statistics.quantiles(times, n=10)
    return {"median_us": statistics.median(times), "p10_us": deciles[0], "p90_us": deciles[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--card", default="qwen2.5-32b")
    p.add_argument("--calls", type=int, default=2000, help="compiled calls per job")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--child", choices=tuple(JOBS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.card, args.child)))
        return 0
    if args.calls < 10:
        p.error("--calls must be at least 10")

    rows = []
    for name in JOBS:
        first = first_call(args.card, name)
        compiled = compiled_calls(args.card, name, args.calls)
        rows.append({"job": name, "card": args.card, **first, **compiled, "calls": args.calls})

    if args.json:
        meta = {"python": platform.python_version(), "machine": platform.machine()}
        print(json.dumps({"target_us": TARGET_US, **meta, "results": rows}, indent=2))
        return 0

    print(f"calc.estimate on {args.card} (python {platform.python_version()})")
    head = (
        f"{'job':<6} {'import':>9} {'first call':>11} {'compiled median':>16} {'p10':>9} {'p90':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['job']:<6} {r['import_s'] * 1e3:>7.0f}ms {r['first_s'] * 1e3:>9.0f}ms"
            f" {r['median_us']:>14.1f}µs {r['p10_us']:>7.1f}µs {r['p90_us']:>7.1f}µs"
        )
    worst = max(r["median_us"] for r in rows)
    status = "under" if worst < TARGET_US else "OVER"
    print(f"compiled estimate: {worst:.1f} µs, {status} the {TARGET_US:.0f} µs target")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
