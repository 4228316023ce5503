"""Peaks of many configurations at once, from a structure's table (``calc.plan_grid``).

Within a structure only sizes change, so a grid of micro-batches and sequence lengths is one
evaluation of the varying size programs over numpy arrays (``calc.plan_program``, exact int64)
and one matrix product with the candidates' counts (``calc.timeline``): the peak is the largest
candidate, as in ``calc.estimate``. For a given model, sizes that do not depend on the job's
sizes are folded into one constant column and candidates another one dominates are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module

import numpy as np

from calc import symbols as S
from calc.jobs import Inference, Training
from calc.model_spec import ModelSpec
from calc.plan_grid import StructureTable, structure_table
from calc.plan_program import run_program

_estimate = import_module("calc.estimate")  # the module (``calc.estimate`` is the function)

EXACT_FLOAT_LIMIT = 1 << 53
"""Integers below this are exact in float64: the matrix product runs in float64 (BLAS) when
no partial sum can reach it, in int64 otherwise."""
CHUNK_POINTS = 2048
"""Points evaluated per matrix product (the product's block then fits in the CPU cache)."""


PRUNE_MIN_POINTS = 256
"""Grids of at least this many points first drop dominated candidates (a few milliseconds per
structure, repaid by a smaller product); smaller grids, such as a plan's micro-batches, skip it."""


def reduced(table: StructureTable, model: ModelSpec, prune: bool = True) -> Reduced:
    """``table`` for ``model``'s dimensions: constant sizes folded into one column and, with
    ``prune``, only the candidates that can be the peak (memoised on the table)."""
    key = (tuple((sym.name, int(v)) for sym, v in model.dims().items()), prune)
    if key not in table._rows:
        table._rows[key] = _reduce(table, model.n_layers, dict(key[0]), prune)
    return table._rows[key]


@dataclass(frozen=True, slots=True)
class Reduced:
    """A structure's candidates for one model: constant sizes folded into one column and
    candidates that another one dominates dropped (``calc.timeline._undominated``: counts
    nowhere above another candidate's, so never strictly the peak)."""

    var_programs: tuple
    """Programs of the sizes that depend on the job's sizes (``b``, ``s``, ``c``)."""
    matrix: np.ndarray
    """float64 [kept candidates, len(var_programs) + 1]: counts of each varying size, then the
    candidate's constant bytes."""
    exact_int: np.ndarray
    """The same matrix in int64 (used when float64 could round)."""
    rows: np.ndarray
    """Index of each kept candidate in the structure's candidates."""


_JOB_SYMBOLS = {sym.name for sym in S.JOB_SYMBOLS}


def _uses_job_symbols(prog: Sequence) -> bool:
    if prog[0] == "sym":
        return prog[1] in _JOB_SYMBOLS
    return any(_uses_job_symbols(a) for a in prog[1:] if isinstance(a, tuple))


def _reduce(table: StructureTable, n_layers: int, dims: dict[str, int], prune: bool) -> Reduced:
    from calc.timeline import _undominated

    rows = table.rows(n_layers)
    varying = np.array([_uses_job_symbols(p) for p in table.programs], dtype=bool)
    env: dict[str, object] = {name: np.int64(v) for name, v in dims.items()}
    const_sizes = np.array(
        [
            0 if v else int(run_program(p, env))
            for p, v in zip(table.programs, varying, strict=True)
        ],
        dtype=np.int64,
    )
    const_bytes = rows[:, ~varying] @ const_sizes[~varying]
    full = np.concatenate([rows[:, varying], const_bytes[:, None]], axis=1)
    if prune:
        keep = np.array(sorted(_undominated(full, np.zeros_like(full))), dtype=np.int64)
    else:
        keep = np.arange(len(full), dtype=np.int64)
    kept = full[keep]
    var_programs = tuple(p for p, v in zip(table.programs, varying, strict=True) if v)
    return Reduced(var_programs, kept.astype(np.float64), kept, keep)


def device_extra_bytes(job: Training | Inference, device: str) -> int:
    """Bytes ``calc.estimate`` adds outside the replay (cuBLAS workspaces on CUDA)."""
    return int(_estimate._device_terms(job, device)[0])


def _size_values(prog: tuple, env: dict[str, object], n: int, memo: dict) -> np.ndarray:
    if prog not in memo:
        memo[prog] = np.broadcast_to(np.asarray(run_program(prog, env), dtype=np.int64), (n,))
    return memo[prog]


@dataclass(frozen=True, slots=True)
class GridPeaks:
    """Peaks of one structure over a grid of sizes."""

    peak_bytes: np.ndarray
    """int64 [points]: predicted peak per GPU (``calc.estimate(...).peak_bytes``)."""
    phase_index: np.ndarray
    """int [points]: index into ``phases`` of the phase where the peak happens."""
    phases: tuple[str, ...]
    """Phase names of the structure's candidates."""


def grid_peaks(
    model: ModelSpec,
    job: Training | Inference,
    b: np.ndarray,
    s: np.ndarray,
    c: np.ndarray | None = None,
    device: str = "cuda",
    table: StructureTable | None = None,
    memo: dict | None = None,
) -> GridPeaks:
    """Peaks of ``job``'s structure at each point ``(b[i], s[i], c[i])`` (micro-batch or batch,
    sequence or prompt length, KV context; ``c`` defaults to ``s``).

    Equal, point by point, to ``calc.estimate(model, job with those sizes, device)``: the same
    timeline, the sizes evaluated in exact integer arithmetic, the same device terms.
    ``memo`` (a dict, empty at first) shares evaluated sizes between calls over the same points
    and model. Raises ``NotImplementedError`` (the cost model's message) for a structure not
    modelled.
    """
    if table is None:
        table, _ = structure_table(model, job, device)
    if table.not_modelled:
        raise NotImplementedError(table.not_modelled)
    b = np.ascontiguousarray(b, dtype=np.int64)
    s = np.ascontiguousarray(s, dtype=np.int64)
    c = s if c is None else np.ascontiguousarray(c, dtype=np.int64)
    red = reduced(table, model, prune=len(b) >= PRUNE_MIN_POINTS)
    env: dict[str, object] = {sym.name: np.int64(v) for sym, v in model.dims().items()}
    env.update(b=b, s=s, c=c)
    memo = {} if memo is None else memo
    n = len(b)
    sizes = np.empty((n, len(red.var_programs) + 1), dtype=np.int64)
    for j, prog in enumerate(red.var_programs):
        sizes[:, j] = _size_values(prog, env, n, memo)
    sizes[:, -1] = 1
    # every partial sum of a row is at most sum_j |count_j| x max |size_j|: exact in float64
    # while that stays below 2**53 (bytes of a few PiB)
    col_max = np.abs(sizes).max(axis=0).astype(object) if n else np.zeros(sizes.shape[1], object)
    bound = max((np.abs(red.exact_int).astype(object) @ col_max).tolist(), default=0)
    exact_float = bound < EXACT_FLOAT_LIMIT
    sizes_f = sizes.astype(np.float64) if exact_float else sizes
    counts_t = (red.matrix if exact_float else red.exact_int).T
    peak = np.empty(n, dtype=np.int64)
    best = np.empty(n, dtype=np.int64)
    for lo in range(0, n, CHUNK_POINTS):  # chunks keep the [points, candidates] block in cache
        totals = sizes_f[lo : lo + CHUNK_POINTS] @ counts_t
        arg = totals.argmax(axis=1)
        peak[lo : lo + CHUNK_POINTS] = totals[np.arange(len(arg)), arg]
        best[lo : lo + CHUNK_POINTS] = arg
    best = red.rows[best]
    return GridPeaks(peak + device_extra_bytes(job, device), best, table.phases)
