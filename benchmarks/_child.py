"""Run a timing script in a fresh Python process: one BLAS thread, a given disk cache.

The benchmarks that time a first estimate (a recording, a compile) run each measurement in its
own process, so that nothing cached in memory by an earlier one is reused; `first_and_disk`
runs it twice over one empty ``VRAMPLAN_CACHE_DIR``: the first run records, the second reads
the recording from the disk. The script prints one JSON object on its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any


def run_child(script: str, args: Any, cache: str) -> dict:
    """``script`` run as ``python -c script ARGS`` (``args`` as JSON in ``sys.argv[1]``) with
    one BLAS/OpenMP thread and ``VRAMPLAN_CACHE_DIR=cache``; the JSON of its last line."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               VRAMPLAN_CACHE_DIR=cache)  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(args)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_and_disk(script: str, args: Any) -> tuple[dict, dict]:
    """``(first, disk)``: `run_child` with an empty disk cache, then again reading it."""
    with tempfile.TemporaryDirectory() as cache:
        first = run_child(script, args, cache)
        disk = run_child(script, args, cache)
    return first, disk
