"""``python -m verify``: run the cases, print a table, write the reports, exit 1 on a miss.

Exit code 1 when any case's |error| exceeds its tolerance or a case errored; not-modelled and
not-runnable cases are listed and counted but do not fail the run. The full battery writes
verify/reports/latest (committed); a filtered run writes verify/reports/subset unless --out says
otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from verify.cases.case import Case, DistCase
from verify.cases.single import select
from verify.dist.compare import not_runnable
from verify.dist.launch import all_cases, run_distributed
from verify.dist.launch import select as select_dist
from verify.run import report
from verify.run.runner import FAILING, Record, run_case

ALLOC_CONFS = {"expandable": "expandable_segments:True", "default": ""}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verify", description=__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--impl", choices=("reference", "hf", "all"), default="all")
    p.add_argument(
        "--cases",
        metavar="SUBSTRING",
        default=None,
        help="only cases whose name contains this (comma-separated alternatives)",
    )
    p.add_argument("--quick", action="store_true", help="the CI subset (tag 'quick')")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report folder (default verify/reports/latest for the full battery, "
        "verify/reports/subset when --cases, --impl or --quick filter it)",
    )
    p.add_argument(
        "--cuda-alloc",
        choices=tuple(ALLOC_CONFS),
        default=None,
        help="cuda: run with PYTORCH_CUDA_ALLOC_CONF set (expandable_segments:True) or unset "
        "(the default allocator), in a child process when it differs from this one's",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="only the distributed cases on N processes (torchrun, gloo on CPU); without it "
        "the distributed cases matching the other filters run too",
    )
    p.add_argument(
        "--measure-only",
        action="store_true",
        help="measure without predicting (status 'measured'): for a GPU machine whose torch "
        "or transformers differ from the pins; verify.gpu_check compares calc afterwards",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p  # fmt: skip


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cuda_alloc is not None:
        env = _alloc_env(args.cuda_alloc)
        if env != dict(os.environ):
            return _rerun_with(env, argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    cases = (
        []
        if args.nproc is not None
        else select(impl=args.impl, substring=args.cases, quick=args.quick)
    )
    dist_cases = _distributed_cases(args)
    if not cases and not dist_cases:
        print("no case matches the filters", file=sys.stderr)
        return 2
    skipped = []
    if args.device == "cuda" and dist_cases:  # listed as not runnable; the others run
        why = "distributed cases run on CPU (gloo) only for now: run them without --device cuda"
        skipped, dist_cases = [not_runnable(c, why) for c in dist_cases], []
    filtered = args.cases is not None or args.impl != "all" or args.quick or bool(args.nproc)
    out = args.out or (report.SUBSET_OUT if filtered else report.DEFAULT_OUT)
    records = [
        *_run_single(
            cases, args.device, progress=not args.no_progress, predict=not args.measure_only
        ),
        *skipped,
    ]
    for rec in run_distributed(dist_cases, progress=lambda _line: None) if dist_cases else []:
        records.append(rec)
        print(report.format_row(report.row(rec)))
    _print_outcome(records)
    paths = report.write_report(records, out, report.run_meta(args.device))
    print(f"\nreports: {', '.join(_shown(p) for p in paths)}")
    print(report.summary_line(records))
    return 1 if any(r.status in FAILING for r in records) else 0


def _alloc_env(choice: str) -> dict[str, str]:
    """This process's environment with ``PYTORCH_CUDA_ALLOC_CONF`` as ``--cuda-alloc`` says."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if ALLOC_CONFS[choice]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONFS[choice]
    return env


def _rerun_with(env: dict[str, str], argv: Sequence[str] | None) -> int:
    """Run ``python -m verify`` again in a child process with ``env``: the allocator reads its
    configuration when torch loads, which this process has already done."""
    args = list(sys.argv[1:] if argv is None else argv)
    return subprocess.run([sys.executable, "-m", "verify", *args], env=env, check=False).returncode


def _run_single(
    cases: Sequence[Case], device: str, *, progress: bool, predict: bool = True
) -> list[Record]:
    """Run the single-process ``cases`` one by one, printing a table row for each (measured
    only, with no prediction, when ``predict`` is false)."""
    records = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cases), unit="case", file=sys.stderr, leave=False, disable=None)
    write = bar.write if bar is not None else print
    write(report.format_row(report.HEADER))
    for case in cases:
        if bar is not None:
            bar.set_description(case.name[:28])
        if case.isolated:
            rec = _run_isolated(case, device, predict)
        else:
            rec = run_case(case, device=device, predict_peak=predict)
        records.append(rec)
        write(report.format_row(report.row(rec)))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return records


def _run_isolated(case: Case, device: str, predict: bool) -> Record:
    """`run_case` of a full-size case in a child process of its own: a real-size model leaves
    gigabytes this process would keep (the whole battery in one process was killed for memory
    after nine of them, at 24 GB resident), and one case's crash cannot end the battery."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_case, case, device, predict_peak=predict).result()


def _print_outcome(records: Sequence[Record]) -> None:
    """List the not-modelled / not-runnable cases and the errors' messages."""
    rest = [r for r in records if r.status in ("not-modelled", "not-runnable")]
    if rest:
        print(f"\nnot modelled / not runnable ({len(rest)}):")
        for r in rest:
            print(f"  {r.name}: {r.message.splitlines()[0]}")
    for r in records:
        if r.status == "error":
            print(f"\n{r.name}: {r.message.strip()}", file=sys.stderr)


def _distributed_cases(args: argparse.Namespace) -> list[DistCase]:
    """The distributed cases the filters select (`verify.dist.launch.all_cases`)."""
    if args.nproc is not None and args.nproc < 1:
        raise SystemExit(f"--nproc={args.nproc} must be >= 1")
    picked = select_dist(all_cases(), substring=args.cases, quick=args.quick, nproc=args.nproc)
    return [c for c in picked if args.impl in ("all", c.impl)]


if __name__ == "__main__":
    sys.exit(main())
