"""Time the web calculator's reruns for a 32B card (target: each rerun under 200 ms).

    python benchmarks/bench_app.py [--card qwen2.5-32b] [--reruns 30] [--json]

What is measured: the wall time of one script run of ``app.py`` (entry page + calculator page)
under ``streamlit.testing.v1.AppTest``, i.e. the server's work for a rerun: reading the widgets,
``calc.estimate`` and the two sweeps (cached or not, as the scenario says), building the chart
specs and the formula, and serialising every element. Not measured: the websocket transfer and
the browser drawing the page (client side, after the server's part).

Scenarios, each a widget change followed by a rerun, cycled so that no input repeats within a
scenario (a repeat would be served from ``st.cache_resource``):

* ``size``: micro-batch or sequence length changes (the common interaction: new estimate and
  new sweeps from the already compiled expressions);
* ``accumulation``: gradient accumulation set to 2, 64, 1000, 4096 and 65,536 in turn (one
  compiled structure serves every count from two on);
* ``gpu``: the GPU changes (estimate cached, verdict and charts redrawn);
* ``structure-cached``: a choice that changes the compiled structure (precision) toggles
  between values compiled before in this process;
* ``structure-first``: a structure seen for the first time in the process and not prefetched
  (two choices changed at once, prefetching off): the sympy replay and ``lambdify`` compile
  (reported separately; the target is for the others, and this is the cost a server pays once
  per structure);
* ``structure-neighbour``: one choice (optimizer, recompute, precision) changed to a value not
  used before, after the page's background compile of its neighbours (``webapp/prefetch.py``)
  has finished; how long that took before each change is printed.

The ``size`` and ``gpu`` scenarios start right after the first page, while the background
thread compiles that page's neighbours (it competes for the interpreter lock).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_MS = 200.0


def _timed_run(at: object) -> float:
    t0 = time.perf_counter()
    at.run()  # type: ignore[attr-defined]
    elapsed = (time.perf_counter() - t0) * 1000
    if at.exception:  # type: ignore[attr-defined]
        sys.exit(f"bench_app: the page raised {at.exception[0].value}")  # type: ignore[attr-defined]
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--card", default="qwen2.5-32b")
    p.add_argument("--reruns", type=int, default=30, help="reruns per scenario")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--no-prefetch", action="store_true",
        help="background compiling of neighbouring structures off (webapp/prefetch.py)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.reruns < 5:
        p.error("--reruns must be at least 5")

    sys.path.insert(0, str(ROOT))
    from streamlit.testing.v1 import AppTest

    from calc.data import gpus
    from webapp import prefetch

    on = "0" if args.no_prefetch else "1"
    os.environ["VRAMPLAN_PREFETCH"] = on

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.query_params["card"] = args.card
    first_load_ms = _timed_run(at)
    catalog = list(gpus.gpu_catalog())
    results: dict[str, list[float]] = {}

    sizes = [(mb, seq) for seq in (512, 1024, 2048, 4096, 8192, 16384) for mb in (1, 2, 3, 4, 6)]
    times = []
    for i in range(args.reruns):
        mb, seq = sizes[i % len(sizes)]
        at.number_input(key="train.micro_batch").set_value(mb)
        at.number_input(key="train.seq_len").set_value(seq)
        times.append(_timed_run(at))
    results["size"] = times

    times = []  # one compiled structure serves every grad_accum >= 2 (issue 16)
    accums = (2, 64, 1000, 4096, 65536)
    for i in range(args.reruns):
        at.number_input(key="train.grad_accum").set_value(accums[i % len(accums)])
        times.append(_timed_run(at))
    results["accumulation"] = times
    at.number_input(key="train.grad_accum").set_value(1)
    _timed_run(at)

    times = []
    for i in range(args.reruns):
        at.selectbox(key="gpu").set_value(catalog[i % len(catalog)])
        times.append(_timed_run(at))
    results["gpu"] = times

    # A structure neither compiled nor prefetched: two choices changed at once, prefetching off.
    os.environ["VRAMPLAN_PREFETCH"] = "0"
    at.selectbox(key="train.precision").set_value("fp32")
    at.selectbox(key="train.optimizer").set_value("sgd")
    results["structure-first"] = [_timed_run(at)]
    os.environ["VRAMPLAN_PREFETCH"] = on
    _timed_run(at)  # the same page again, now queueing its neighbours

    # One choice changed at a time, after the background compile of the page's neighbours
    # (webapp/prefetch.py) has finished (the time a user takes to read the page; reported).
    walk = [
        ("train.optimizer", "adamw"), ("train.optimizer", "adafactor"),
        ("train.optimizer", "adam8bit"), ("train.recompute", "full"),
        ("train.precision", "bf16"), ("train.precision", "bf16-master"),
        ("train.optimizer", "lion"),
    ]  # fmt: skip
    times, waits = [], []
    for key, value in walk:
        t0 = time.perf_counter()
        prefetch.wait_idle()
        waits.append((time.perf_counter() - t0) * 1000)
        at.selectbox(key=key).set_value(value)
        times.append(_timed_run(at))
    results["structure-neighbour"] = times
    prefetch.wait_idle()

    at.selectbox(key="train.precision").set_value("bf16")
    at.selectbox(key="train.optimizer").set_value("adamw")
    at.selectbox(key="train.recompute").set_value("none")
    _timed_run(at)
    times = []
    for i in range(args.reruns):
        at.selectbox(key="train.precision").set_value(("amp-bf16", "bf16")[i % 2])
        # a new size each time, so the estimate itself is not a cache hit
        at.number_input(key="train.seq_len").set_value(1024 + i)
        times.append(_timed_run(at))
    results["structure-cached"] = times

    rows = []
    for name, ts in results.items():
        row = {"scenario": name, "runs": len(ts), "median_ms": statistics.median(ts)}
        row["max_ms"] = max(ts)
        if len(ts) >= 5:
            row["p90_ms"] = statistics.quantiles(ts, n=10)[-1]
        rows.append(row)
    meta = {
        "card": args.card,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "first_load_ms": first_load_ms,
        "target_ms": TARGET_MS,
        "prefetch_wait_ms": waits,
    }
    if args.json:
        print(json.dumps({**meta, "results": rows}, indent=2))
        return 0
    print(f"web calculator reruns on {args.card} (AppTest script runs, python {meta['python']})")
    print(f"first load of the page (imports, card, first compile): {first_load_ms:.0f} ms")
    head = f"{'scenario':<18} {'runs':>5} {'median':>9} {'p90':>9} {'max':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        p90 = f"{r['p90_ms']:.1f}" if "p90_ms" in r else "-"
        print(
            f"{r['scenario']:<18} {r['runs']:>5} {r['median_ms']:>7.1f}ms {p90:>7}ms"
            f" {r['max_ms']:>7.1f}ms"
        )
    print(
        "structure-neighbour: each change made after the background compile of the page's "
        f"neighbours finished (waited {statistics.median(waits):.0f} ms median, "
        f"{max(waits):.0f} ms max before a change)"
    )
    judged = [r for r in rows if r["scenario"] != "structure-first"]
    worst = max(r.get("p90_ms", r["max_ms"]) for r in judged)
    status = "under" if worst < TARGET_MS else "OVER"
    print(
        f"worst p90 of the interactive reruns: {worst:.1f} ms, {status} the {TARGET_MS:.0f} ms target"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
