"""Distributed verification: launch cases with torchrun, each rank measuring its own peak.

``python -m verify --nproc N`` (or `run_distributed`) groups the distributed cases by process
count and starts one ``torchrun --standalone --nproc_per_node N -m verify.dist.launch`` per
group. Every rank of that launch runs each case of the group in turn:

1. ``gc`` and a barrier, so no rank starts a case while another still frees the last one;
2. enter a `verify.measure.tracker.StorageTracker` (``count_late=False``: storages first seen on
   gloo's worker threads are not counted, as NCCL has no such allocator temporaries) **before**
   the model and its DDP/FSDP wrapper are built: DDP allocates its gradient buckets in C++ at
   construction, with no Python object a later scan could find (a compiled step is measured by
   the profiler's allocation events instead, `verify.dist.profiled`)
   (/work/shared/reference/cpu-measurement.md §5, trap 1);
3. build the model, wrap it with the case's engine (`ENGINES`), build the optimizer;
4. run ``case.steps`` optimizer steps of the single-GPU protocol (`verify.run.step`), resetting the
   peak at the start of each step (like ``torch.cuda.reset_peak_memory_stats``) and recording
   each step's peak and phase peaks;
5. write ``<out>/<case>/rank<r>.json``.

The parent reads the per-rank files back. The measured peak of a case is the maximum over its
steps and its ranks: the second DDP step rebuilds the buckets, and gloo's timing moves frees
(/work/shared/reference/memory-facts.md §8). The report shows per-rank predicted vs measured.

Engines (what wraps the model: `verify.dist.engines`, `verify.dist.tp_plans`,
`verify.dist.pp_plans`) are listed by name in `ENGINES`; the cases are plain data
(`verify.cases.case.DistCase`, listed in `verify.cases.distributed` and
`verify.cases.model_parallel`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verify.cases import distributed, model_parallel
from verify.cases.case import DistCase
from verify.dist import engines, pp_plans, tp_plans
from verify.dist.compare import record_for
from verify.dist.engine import Engine, RankContext, run_step
from verify.dist.profiled import measure_profiled
from verify.measure.tracker import StorageTracker
from verify.run.step import forced_sdpa, make_batch, pins_for

LAUNCH_TIMEOUT_S = int(os.environ.get("VRAMPLAN_DIST_TIMEOUT_S", "1800"))
"""Upper bound on one torchrun launch (all cases of one process count); the environment's
``VRAMPLAN_DIST_TIMEOUT_S`` raises it for the full-size cases on a busy machine."""

ENGINES: dict[str, Engine] = {
    "replicas": engines.replicas,
    "ddp": engines.ddp,
    "zero1": engines.zero1,
    "fsdp2": engines.fsdp2,
    "fsdp1": engines.fsdp1,
    "hf-native": engines.hf_native,
    "tp": tp_plans.tp_engine,
    "fsdp-tp": tp_plans.fsdp_tp_engine,
    "pp": pp_plans.pp_engine,
}
"""Engine name (`verify.cases.case.DistCase.engine`) -> builder, called inside the tracker on
every rank."""


def all_cases() -> tuple[DistCase, ...]:
    """Every distributed case (`verify.cases.distributed`, then
    `verify.cases.model_parallel`), in report order."""
    cases = [*distributed.CASES, *model_parallel.CASES]
    names = [c.name for c in cases]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"duplicate distributed case names: {sorted(dupes)}")
    return tuple(cases)


def select(
    cases: Sequence[DistCase], *, substring: str | None, quick: bool, nproc: int | None
) -> list[DistCase]:
    """Cases whose name contains ``substring`` (comma-separated alternatives), tagged ``quick``
    when asked, on ``nproc`` processes when given."""
    subs = [s for s in (substring or "").split(",") if s]
    return [
        c
        for c in cases
        if (not quick or "quick" in c.tags)
        and (not subs or any(s in c.name for s in subs))
        and (nproc is None or c.nproc == nproc)
    ]


# ---------------------------------------------------------------------- worker (one rank)


def _measure_case(case: DistCase, ctx: RankContext) -> dict[str, Any]:
    """Build and train ``case`` on this rank under the tracker; the rank's numbers."""
    spec = case.spec()
    job = case.job
    par = case.parallel
    mp16 = par.shard_level == 3 and par.fsdp_param_dtype == "bf16"  # the policy's bf16 forward
    pins = pins_for(spec, job, seed=case.seed, device=ctx.device, compute_16bit=mp16)
    data_rank = ctx.rank // (par.tp * par.pp * par.cp)  # mesh [dp, pp, cp, tp]: same batch per dp
    ids, targets = make_batch(
        spec, job.micro_batch, job.seq_len, seed=case.seed + 1000 * data_rank, device=ctx.device
    )
    engine = ENGINES[case.engine]
    gc.collect()
    dist.barrier()
    if case.profiled:  # a compiled step: the profiler's allocation events
        return measure_profiled(case, ctx, engine, ids, targets, pins)
    tracker = StorageTracker(scan_baseline=False, count_late=False, phase="setup")
    steps: list[dict[str, Any]] = []
    with tracker as tr:
        tr.track(ids, targets)
        built = engine(case, spec, ctx)
        tr.track(built.model)  # every storage of the model, also one torch.tensor made
        tr.classify(model=built.model, optimizer=built.optimizer, inputs=[ids, targets])
        setup_bytes = tr.live_bytes
        with tr._lock:  # small storages made by the wrapper (device meshes, ...): diagnostics
            setup_small = sorted(
                [e[0][1], e[0][3]] for e in tr._live.values() if 0 < e[0][1] <= 4096
            )
        with forced_sdpa(pins.sdpa_backend):
            for step in range(1, case.steps + 1):
                tr.mark(f"step{step}/forward")
                tr.reset_peak()
                run_step(step, built, ids, targets, job, tr, ctx.device)
                steps.append(
                    {
                        "peak": tr.peak_bytes,
                        "peak_phase": tr.peak_phase,
                        "peak_op": tr.peak_op,
                        "phases": dict(tr.phase_peaks),
                        "top_ops_at_peak": dict(list(tr.peak_by_op().items())[:8]),
                        "live_at_peak": [
                            [x.nbytes, x.op, x.phase, x.category] for x in tr.peak_live()[:40]
                        ],
                        "end_bytes": tr.live_bytes,
                    }
                )
    best = max(range(len(steps)), key=lambda i: steps[i]["peak"])
    result = {
        "rank": ctx.rank,
        "world": ctx.world,
        "setup_bytes": setup_bytes,
        "setup_small": setup_small,
        "steps": steps,
        "peak": steps[best]["peak"],
        "peak_step": best + 1,
    }
    del built, tracker, tr
    gc.collect()
    return result


def worker_main(argv: Sequence[str]) -> int:
    """Entry point of each torchrun process: run the named cases, write one JSON per case."""
    p = argparse.ArgumentParser(prog="python -m verify.dist.launch")
    p.add_argument("--cases", required=True, help="comma-separated case names")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    ctx = RankContext(rank=rank, world=world, device="cpu")
    by_name = {c.name: c for c in all_cases()}
    try:
        for name in args.cases.split(","):
            case = by_name[name]
            start = time.perf_counter()
            try:
                result = _measure_case(case, ctx)
                result["status"] = "ok"
            except Exception as exc:
                result = {
                    "rank": rank,
                    "status": "error",
                    "message": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}",
                }
            result["seconds"] = time.perf_counter() - start
            folder = args.out / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
            if result["status"] == "error":
                break  # collectives of the other ranks may now hang; stop this launch
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------- parent


def launch(cases: Sequence[DistCase], nproc: int, out: Path) -> str:
    """Run ``cases`` (all on ``nproc`` processes) in one torchrun; returns its output tail."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "verify.dist.launch",
        "--cases", ",".join(c.name for c in cases), "--out", str(out),
    ]  # fmt: skip
    # its own session, so that a launch past the limit is killed with its workers (`_kill`):
    # killing torchrun alone left both ranks running, unseen, for as long as their step took
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(proc.pid)
        output, _ = proc.communicate()
        output += (
            f"\ntorchrun killed with its workers after {LAUNCH_TIMEOUT_S} s "
            "(VRAMPLAN_DIST_TIMEOUT_S raises the limit)"
        )
    return output[-4000:]


def _kill(torchrun: int) -> None:
    """Kill a torchrun launch: each worker first, then torchrun's own group. torch's elastic
    agent starts every worker in a session of its own (``SubprocessHandler``:
    ``start_new_session=True``), so torchrun's process group does not hold them; they are
    found as its children in ``/proc``."""
    for pid in _children(torchrun):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(torchrun, signal.SIGKILL)


def _children(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (``/proc/<pid>/stat``: state, then ppid after
    the command's closing parenthesis)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


def read_ranks(out: Path, case: DistCase) -> dict[int, dict[str, Any]]:
    """The per-rank results of ``case`` found under ``out``."""
    found = {}
    for r in range(case.nproc):
        path = out / case.name / f"rank{r}.json"
        if path.exists():
            found[r] = json.loads(path.read_text())
    return found


def run_distributed(
    cases: Sequence[DistCase], out: Path | None = None, progress: Callable[[str], None] = print
) -> list[Any]:
    """Launch ``cases`` (one torchrun per process count), predict them, and compare.

    Returns `verify.run.runner.Record` objects; ``extra["ranks"]`` holds per-rank measured and
    predicted peaks and the per-step peaks.
    """
    records = []
    with tempfile.TemporaryDirectory(prefix="vramplan-dist-") as tmp:
        root = Path(out) if out is not None else Path(tmp)
        for nproc in sorted({c.nproc for c in cases}):
            group = [c for c in cases if c.nproc == nproc]
            start = time.perf_counter()
            log = launch(group, nproc, root)
            seconds = (time.perf_counter() - start) / len(group)
            for case in group:
                rec = record_for(case, read_ranks(root, case), log, seconds)
                records.append(rec)
                progress(f"{case.name}: {rec.status} {rec.error_pct}")
    return records


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
