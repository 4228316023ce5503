"""Time the capacity planner (``calc.plan``) on one CPU core.

    python benchmarks/bench_plan.py [--card qwen2.5-7b] [--seq-len 2048] [--global-batch 8]
                                    [--points 4096] [--json]

What it measures, each step separately (BLAS and OpenMP are pinned to one thread before numpy
is imported, so every number is for one core):

1. **compile** (the one-time cost): every structure of the default training grid of the card
   (precision x optimizer x recompute, each with grad_accum 1 and >= 2), compiled into the
   persistent cache (``$VRAMPLAN_CACHE_DIR``, default ``~/.cache/vramplan``) by
   ``calc.plan.planner.precompile``. Structures already cached cost nothing; the seconds per structure
   actually compiled now are reported.
2. **grid throughput**: configurations evaluated per second by ``calc.plan.grid.grid_peaks``
   over every modelled structure of the grid x ``--points`` sizes per structure (micro-batch
   1..64 x sequence lengths 128..16384), the size expressions shared between structures as
   the planner shares them. One configuration = one (structure, micro-batch, sequence length)
   whose exact peak in bytes is computed. Target: >= 1,000,000 per second.
3. **full plan**: ``calc.plan.planner.plan(card, task="full-finetune", seq_len, global_batch,
   gpu="h100-80gb")`` with the default axes (every configuration of the grid, error bars from
   the latest verify report), in a fresh Python process with a warm persistent cache: the
   seconds of the ``plan`` call (import of calc and loading of the card reported apart), and
   the same call again in that process (tables in memory). Target: under 1 second.

4. **multi-GPU plans** (``--gpus 2,4,8``): the same plan over 2, 4 and 8 GPUs (training
   enumerates the parallel layouts of ``calc.plan.layouts``; each row is evaluated from its rank
   classes' tables, ``calc.plan.engine``). Cold once: the 2-GPU plan in a fresh process with an
   empty cache folder (every rank-class table compiled by the plan itself; its entries are then
   copied into the cache). Then ``calc.plan.planner.precompile(..., gpu_count=n)`` for each count
   (only what is missing), and each plan in a fresh process with the warm cache, and again in
   that process. Target: warm plan under 1 second. ``--multi-gpu-only`` skips steps 1-3.

Wall-clock times are the targets; process CPU times are printed beside them because a shared
machine stretches wall time (the grid step reports the best of 5 runs).
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_CONFIGS_PER_S = 1_000_000
TARGET_PLAN_S = 1.0


def compile_step(card: str) -> dict:
    """Precompile the card's default training grid; seconds and structures compiled now."""
    import calc
    from calc.plan import planner as P

    model = calc.load_card(card)
    t0 = time.perf_counter()
    done = P.precompile(model, task="full-finetune", global_batch=2, progress=_progress)
    seconds = time.perf_counter() - t0
    return {
        "compiled_now": done,
        "compile_s": seconds,
        "s_per_structure": seconds / done if done else None,
    }


def _progress(done: int, total: int) -> None:
    print(f"\rcompile: {done}/{total} structures", end="" if done < total else "\n",
          file=sys.stderr, flush=True)  # fmt: skip


def throughput_step(card: str, n_points: int) -> dict:
    """Configurations per second of ``grid_peaks`` over every cached structure of the grid."""
    import calc
    from calc.plan import grid as plan_grid
    from calc.plan import grid_eval as plan_eval
    from calc.plan.axes import TRAINING, Context, axes_for

    model = calc.load_card(card)
    ctx = Context(kind=TRAINING, seq_len=2048, global_batch=2, gpu_count=1)
    # one GPU: the structural axes (the layout axis has the single value "single", no field)
    axes = [a for a in axes_for(TRAINING) if a.enumerated and not a.size and not a.shards]
    jobs = []
    import itertools

    for combo in itertools.product(*(a.values(ctx) for a in axes)):
        for accum in (1, 2):
            fields = dict(zip((a.name for a in axes), combo, strict=True))
            jobs.append(calc.Training(micro_batch=1, seq_len=2048, grad_accum=accum, **fields))
    tables = []
    for job in jobs:
        table, fresh = plan_grid.structure_table(model, job)
        if fresh:
            sys.exit("bench_plan: a structure was not cached; run the compile step first")
        if not table.not_modelled:
            tables.append((job, table))
    mb = np.arange(1, 65)
    seqs = np.unique(np.geomspace(128, 16384, max(1, n_points // 64)).astype(np.int64))
    b = np.repeat(mb, len(seqs))
    s = np.tile(seqs, len(mb))
    for _job, table in tables:  # warm: reduce each table once for this model (memoised)
        plan_eval.reduced(table, model)
    runs, cpu = [], []
    for _ in range(5):
        memo: dict = {}
        t0, c0 = time.perf_counter(), time.process_time()
        for job, table in tables:
            plan_eval.grid_peaks(model, job, b, s, table=table, memo=memo)
        runs.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    best = min(runs)
    n = len(tables) * len(b)
    return {
        "structures": len(tables),
        "points_per_structure": len(b),
        "configurations": n,
        "seconds_best_of_5": best,
        "seconds_all": runs,
        "cpu_seconds_all": cpu,
        "configs_per_s": n / best,
        "configs_per_cpu_s": n / min(cpu),
    }


CHILD = """
import os, sys, time, json
for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[v] = "1"
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
c0 = time.process_time()
import calc
from calc.plan import planner as P
t1 = time.perf_counter()
model = calc.load_card({card!r})
t2 = time.perf_counter()
c2 = time.process_time()
p = P.plan(model, task="full-finetune", seq_len={seq}, global_batch={batch}, gpu="h100-80gb")
t3 = time.perf_counter()
c3 = time.process_time()
p2 = P.plan(model, task="full-finetune", seq_len={seq}, global_batch={batch}, gpu="h100-80gb")
t4 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "load_card_s": t2 - t1, "plan_s": t3 - t2,
                  "plan_again_s": t4 - t3, "plan_cpu_s": c3 - c2, "n_configurations": p.n_configurations,
                  "fitting": len(p.fitting), "compiled_now": p.compiled_now,
                  "verdict": p.verdict()}}))
"""


def plan_step(
    card: str, seq_len: int, global_batch: int, gpu_count: int = 1, env: dict | None = None
) -> dict:
    """A full default plan in a fresh interpreter (warm persistent cache unless ``env`` points
    ``VRAMPLAN_CACHE_DIR`` elsewhere)."""
    code = CHILD.format(root=str(ROOT), card=card, seq=seq_len, batch=global_batch)
    code = code.replace('gpu="h100-80gb")', f'gpu="h100-80gb", gpu_count={gpu_count})')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=False, env=env)  # fmt: skip
    if proc.returncode != 0:
        sys.exit(proc.stderr.strip() or "bench_plan: the plan child failed")
    return json.loads(proc.stdout)


def multi_gpu_step(card: str, seq_len: int, global_batch: int, counts: list[int]) -> dict:
    """Cold 2-GPU plan (fresh process, empty cache), then precompile and warm plans per count."""
    import shutil
    import tempfile

    import calc
    from calc.data.cards import plan_cache_dir
    from calc.plan import planner as P

    out: dict = {}
    if 2 in counts:
        with tempfile.TemporaryDirectory(prefix="vramplan-cold-") as cold:
            env = {**os.environ, "VRAMPLAN_CACHE_DIR": cold}
            out["cold_2"] = plan_step(card, seq_len, global_batch, 2, env)
            cache = plan_cache_dir()
            cache.mkdir(parents=True, exist_ok=True)
            for entry in Path(cold).glob("*.json"):  # the same keys: reuse them below
                shutil.copy(entry, cache / entry.name)
    model = calc.load_card(card)
    for n in counts:
        t0 = time.perf_counter()
        done = P.precompile(model, task="full-finetune", seq_len=seq_len,
                            global_batch=global_batch, gpu_count=n)  # fmt: skip
        out[f"precompile_{n}"] = {"compiled_now": done, "seconds": time.perf_counter() - t0}
        out[f"warm_{n}"] = plan_step(card, seq_len, global_batch, n)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--card", default="qwen2.5-7b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--points", type=int, default=4096, help="sizes per structure (grid step)")
    p.add_argument("--gpus", default="2,4,8", help="GPU counts of the multi-GPU step ('' skips)")
    p.add_argument("--multi-gpu-only", action="store_true", help="only the multi-GPU step")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.points < 64:
        p.error("--points must be at least 64")
    counts = [int(x) for x in args.gpus.split(",") if x.strip()]
    multi = multi_gpu_step(args.card, args.seq_len, args.global_batch, counts) if counts else {}
    if args.multi_gpu_only:
        if args.json:
            print(json.dumps({"card": args.card, "multi_gpu": multi}, indent=2))
        else:
            _print_multi(multi)
        return 0
    # the plan needs the structures of its micro-batches: grad_accum 1 and >= 2 are compiled
    comp = compile_step(args.card)
    thr = throughput_step(args.card, args.points)
    full = plan_step(args.card, args.seq_len, args.global_batch)
    result = {
        "card": args.card, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "compile": comp, "grid": thr, "plan": full,
        "multi_gpu": multi,
        "targets": {"configs_per_s": TARGET_CONFIGS_PER_S, "plan_s": TARGET_PLAN_S},
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"calc.plan on {args.card} (python {platform.python_version()}, one thread)")
    if comp["compiled_now"]:
        print(f"compile: {comp['compiled_now']} structures in {comp['compile_s']:.1f} s "
              f"({comp['s_per_structure']:.2f} s each, once per calc version)")  # fmt: skip
    else:
        print("compile: every structure already in the persistent cache")
    ok = "MEETS" if thr["configs_per_s"] >= TARGET_CONFIGS_PER_S else "MISSES"
    print(f"grid: {thr['configurations']:,} configurations ({thr['structures']} structures x "
          f"{thr['points_per_structure']} sizes) in {thr['seconds_best_of_5'] * 1e3:.0f} ms "
          f"(best of 5) = {thr['configs_per_s']:,.0f} per second of wall time ({ok} the "
          f"1,000,000/s target); {thr['configs_per_cpu_s']:,.0f} per CPU-second")  # fmt: skip
    ok = "MEETS" if full["plan_s"] < TARGET_PLAN_S else "MISSES"
    print(f"full plan ({full['n_configurations']} configurations, {full['fitting']} fit, "
          f"{full['compiled_now']} compiled): {full['plan_s'] * 1e3:.0f} ms in a fresh process "
          f"({full['plan_cpu_s'] * 1e3:.0f} ms CPU; {ok} the 1 s target), {full['plan_again_s'] * 1e3:.0f} ms again; import calc "
          f"{full['import_s'] * 1e3:.0f} ms, load card {full['load_card_s'] * 1e3:.0f} ms")  # fmt: skip
    print(f"verdict: {full['verdict']}")
    _print_multi(multi)
    return 0


def _print_multi(multi: dict) -> None:
    if "cold_2" in multi:
        c = multi["cold_2"]
        print(f"cold 2-GPU plan ({c['n_configurations']} configurations, {c['compiled_now']} "
              f"tables compiled, empty cache): {c['plan_s']:.1f} s")  # fmt: skip
    for key in sorted(k for k in multi if k.startswith("warm_")):
        n = key.split("_")[1]
        w, pre = multi[key], multi[f"precompile_{n}"]
        ok = "MEETS" if w["plan_s"] < TARGET_PLAN_S else "MISSES"
        print(f"{n} GPUs: precompile {pre['compiled_now']} tables in {pre['seconds']:.1f} s; "
              f"plan ({w['n_configurations']} configurations, {w['fitting']} fit, "
              f"{w['compiled_now']} compiled): {w['plan_s'] * 1e3:.0f} ms in a fresh process "
              f"({w['plan_cpu_s'] * 1e3:.0f} ms CPU; {ok} the 1 s target), "
              f"{w['plan_again_s'] * 1e3:.0f} ms again")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
