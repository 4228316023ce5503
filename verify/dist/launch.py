"""Distributed verification: launch cases with torchrun, each rank measuring its own peak.

``python -m verify --nproc N`` (or `run_distributed`) groups the distributed cases by process
count and starts one ``torchrun --standalone --nproc_per_node N -m verify.dist.launch`` per
group. Every rank of that launch runs each case of the group in turn:

1. ``gc`` and a barrier, so no rank starts a case while another still frees the last one;
2. enter a `verify.measure.tracker.StorageTracker` (``count_late=False``: storages first seen on gloo's
   worker threads are not counted, as NCCL has no such allocator temporaries) **before** the
   model and its DDP/FSDP wrapper are built: DDP allocates its gradient buckets in C++ at
   construction, with no Python object a later scan could find
   (/work/shared/reference/cpu-measurement.md §5, trap 1);
3. build the model, wrap it with the case's engine (`ENGINES`), build the optimizer;
4. run ``case.steps`` optimizer steps of the single-GPU protocol (`verify.run.step`), resetting the
   peak at the start of each step (like ``torch.cuda.reset_peak_memory_stats``) and recording
   each step's peak and phase peaks;
5. write ``<out>/<case>/rank<r>.json``.

The parent reads the per-rank files back. The measured peak of a case is the maximum over its
steps and its ranks: the second DDP step rebuilds the buckets, and gloo's timing moves frees
(/work/shared/reference/memory-facts.md §8). The report shows per-rank predicted vs measured.

Engines (what wraps the model) are registered by name in `ENGINES`; `register_engine` lets
other modules (tensor and pipeline parallel plans) add theirs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calc.config.jobs import Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from verify.cases.scale import DEFAULT_MAX_POSITIONS, scaled_spec

DEFAULT_STEPS = 3
"""Optimizer steps measured per case: step 1 creates optimizer states, step 2 rebuilds DDP's
buckets, step 3 is steady."""
LAUNCH_TIMEOUT_S = 1800
"""Upper bound on one torchrun launch (all cases of one process count)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DistCase:
    """One distributed verification case: a scaled card, a per-rank job, a parallel layout and
    the engine that realises it on torch.distributed."""

    name: str
    """Unique name (``--cases`` filters match substrings of it)."""
    card: str
    """Model card id whose structure the scaled model keeps."""
    scale: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments of `verify.cases.scale.scaled_spec`, as pairs."""
    job: Training
    """What each rank runs (micro_batch is per rank)."""
    parallel: Parallelism
    """The layout calc predicts; ``parallel.world_size`` equals ``nproc``."""
    engine: str
    """Key of `ENGINES`: how the model is wrapped (``ddp``, ``zero1``, ``fsdp2``, ...)."""
    tolerance_pct: float = 1.0
    """Largest |predicted - measured| / measured allowed, in percent."""
    tags: tuple[str, ...] = ()
    """Labels: ``quick`` marks the CI subset."""
    note: str = ""
    """Why the case exists; for a 3 % tolerance, which communication buffers are not visible."""
    seed: int = 0
    """Seed of the weights (every rank builds the same) and, plus the rank, of the batch."""
    steps: int = DEFAULT_STEPS
    """Optimizer steps measured."""
    options: tuple[tuple[str, Any], ...] = ()
    """Engine-specific options (as pairs)."""

    def __post_init__(self) -> None:
        if self.impl != self.job.implementation:
            raise ValueError(f"case {self.name}: impl differs from job.implementation")
        if self.tolerance_pct <= 0:
            raise ValueError(f"case {self.name}: tolerance_pct={self.tolerance_pct} must be > 0")
        if self.steps < 1:
            raise ValueError(f"case {self.name}: steps={self.steps} must be >= 1")

    @property
    def impl(self) -> str:
        return self.job.implementation

    @property
    def nproc(self) -> int:
        """Processes the case runs on."""
        return self.parallel.world_size

    @property
    def kind(self) -> str:
        return "distributed"

    def spec(self) -> ModelSpec:
        """The scaled model."""
        kw = dict(self.scale)
        kw.setdefault("max_positions", max(DEFAULT_MAX_POSITIONS, self.job.seq_len))
        return scaled_spec(self.card, **kw)

    def label(self) -> str:
        return self.engine

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


# ---------------------------------------------------------------------- engines


@dataclass(slots=True)
class Built:
    """What a rank trains: the wrapped model, its loss and the optimizer step."""

    model: Any
    """The module whose parameters are the rank's (wrapped or not), for attribution."""
    loss_fn: Callable[[Any, Any], Any]
    """``(ids, targets) -> loss`` through the wrapper."""
    optimizer: Any
    """The torch optimizer holding the rank's states (for attribution)."""
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    scale: Callable[[Any], Any] = field(default=lambda loss: loss)
    backward: Callable[[Any], None] | None = None
    """``loss -> None`` replacing ``loss.backward()`` (e.g. under ``loss_parallel``)."""
    train_step: Callable[[Any, Any], None] | None = None
    """``(ids, targets) -> None`` replacing forward and backward of a micro-batch (a pipeline
    schedule's ``step``); marks ``forward`` only."""


@dataclass(frozen=True, slots=True)
class RankContext:
    """Where this process sits."""

    rank: int
    world: int
    device: str


Engine = Callable[[DistCase, ModelSpec, RankContext], Built]
ENGINES: dict[str, Engine] = {}
"""Engine name -> builder, called inside the tracker on every rank."""


def register_engine(name: str, builder: Engine) -> None:
    """Add an engine; a second registration of one name is an error."""
    if name in ENGINES and ENGINES[name] is not builder:
        raise ValueError(f"engine {name!r} is already registered")
    ENGINES[name] = builder


def _load_engines() -> None:
    """Import the modules that register engines (optional ones may be missing)."""
    import importlib

    for module in ("verify.dist.engines", "verify.dist.tp_plans"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def all_cases() -> tuple[DistCase, ...]:
    """Every distributed case (``verify.cases.distributed`` and, when present,
    ``verify.cases.model_parallel``), in report order."""
    import importlib

    cases: list[DistCase] = []
    for module in ("verify.cases.distributed", "verify.cases.model_parallel"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        cases.extend(mod.CASES)
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
    import torch
    import torch.distributed as dist

    from verify.run.step import AUTOCAST_DTYPE, forced_sdpa, make_batch, pins_for
    from verify.measure.tracker import StorageTracker

    spec = case.spec()
    job = case.job
    pins = pins_for(spec, job, seed=case.seed, device=ctx.device)
    par = case.parallel
    data_rank = ctx.rank // (par.tp * par.pp * par.cp)  # mesh [dp, pp, cp, tp]: same batch per dp
    ids, targets = make_batch(
        spec, job.micro_batch, job.seq_len, seed=case.seed + 1000 * data_rank, device=ctx.device
    )
    engine = ENGINES[case.engine]
    gc.collect()
    dist.barrier()
    tracker = StorageTracker(scan_baseline=False, count_late=False, phase="setup")
    steps: list[dict[str, Any]] = []
    amp = AUTOCAST_DTYPE.get(job.precision)
    with tracker as tr:
        tr.track(ids, targets)
        built = engine(case, spec, ctx)
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
                for mb in range(job.grad_accum):
                    tr.mark(f"step{step}/forward")
                    if built.train_step is not None:
                        built.train_step(ids, targets)
                        continue
                    ctx_amp = (
                        torch.autocast(ctx.device, dtype=amp)
                        if amp is not None
                        else contextlib.nullcontext()
                    )
                    with ctx_amp:
                        loss = built.loss_fn(ids, targets)
                    loss = built.scale(loss)
                    if job.zero_grad == "before_backward" and mb == 0:
                        built.zero_grad()
                    tr.mark(f"step{step}/backward")
                    if built.backward is not None:
                        built.backward(loss)
                    else:
                        loss.backward()
                    del loss
                tr.mark(f"step{step}/optimizer")
                built.step()
                if job.zero_grad == "after_step":
                    built.zero_grad()
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

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    ctx = RankContext(rank=rank, world=world, device="cpu")
    _load_engines()
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
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False
    )
    return (proc.stdout + proc.stderr)[-4000:]


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
    from verify.dist.compare import record_for

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
    # Run from the imported module, not this ``__main__`` copy: engine modules register into
    # ``verify.dist.launch.ENGINES``.
    from verify.dist.launch import main as _main

    sys.exit(_main())


__all__ = [
    "DEFAULT_STEPS",
    "ENGINES",
    "Built",
    "DistCase",
    "RankContext",
    "all_cases",
    "register_engine",
    "run_distributed",
    "select",
]
