"""Time ``python -m calc report``'s search: every cell of `calc.plan.report.report` for one card, in
a fresh process (nothing compiled yet), then again in the same process (every recipe's
structure compiled and cached).

    python benchmarks/bench_report.py [--card qwen2.5-32b] [--tasks serve,lora,qlora,full]

Prints the wall and CPU seconds of each pass, the number of recipes estimated, and the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--card", default="qwen2.5-32b")
    p.add_argument("--tasks", default="serve,lora,qlora,full")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import calc
    from calc.plan import report

    model = calc.load_card(args.card)
    tasks = tuple(args.tasks.split(","))
    for label in ("first (compiles)", "second (cached)"):
        wall, cpu = time.perf_counter(), time.process_time()
        cells = report.report(model, tasks=tasks)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        searched = sum(getattr(c, "searched", 0) for c in cells.values())
        print(f"{label:18s} {wall:8.1f} s wall {cpu:8.1f} s CPU, {searched} recipes")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
