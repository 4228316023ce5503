"""Peaks of many configurations at once, from a structure's table (``calc.plan.grid``).

Within a structure only sizes change, so a grid of micro-batches and sequence lengths is one
evaluation of the varying size programs over numpy arrays (``calc.plan.program``, exact int64)
and one matrix product with the candidates' counts (``calc.replay.timeline``): the peak is the largest
candidate, as in ``calc.estimate``. For a given model, sizes that do not depend on the job's
sizes are folded into one constant column and candidates another one dominates are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import reduce

import numpy as np

from calc import symbols as S
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.estimate import core as _estimate
from calc.plan.grid import StructureTable, structure_table
from calc.plan.program import Value, run_program
from calc.replay.timeline import _undominated, step1_mask

EXACT_FLOAT_LIMIT = 1 << 53
"""Integers below this are exact in float64: the matrix product runs in float64 (BLAS) when
no partial sum can reach it, in int64 otherwise."""
CHUNK_POINTS = 2048
"""Points evaluated per matrix product (the product's block then fits in the CPU cache)."""


PRUNE_MIN_POINTS = 256
"""Grids of at least this many points first drop dominated candidates (a few milliseconds per
structure, repaid by a smaller product); smaller grids, such as a plan's micro-batches, skip it."""


def reduced(
    table: StructureTable, model: ModelSpec, prune: bool = True, by_step: bool = False
) -> Reduced:
    """``table`` for ``model``'s dimensions: constant sizes folded into one column and, with
    ``prune``, only the candidates that can be the peak (memoised on the table). ``by_step``:
    a candidate is only dropped for another of its own group, step 1 (phase ``step1/...``) or
    later, so that adding one constant per group (``grid_peaks``'s ``extras``) keeps every
    dropped candidate below a kept one."""
    dims = tuple((sym.name, int(v)) for sym, v in model.dims().items())
    key = (dims, prune, by_step)
    if key not in table._rows:
        table._rows[key] = _reduce(table, model.n_layers, dict(dims), prune, by_step)
    return table._rows[key]


@dataclass(frozen=True, slots=True)
class Reduced:
    """A structure's candidates for one model, as rows over a few columns (``_reduce``);
    optionally without the candidates another one dominates (``calc.replay.timeline._undominated``:
    nowhere above another candidate's, so never strictly the peak)."""

    columns: tuple
    """What each column holds: ``("mono", (i, j, k))`` for the monomial ``b^i s^j c^k``, or
    ``("prog", program)`` for a size that rounds (evaluated as its program)."""
    matrix: np.ndarray
    """float64 [kept candidates, len(columns) + 1]: each candidate's bytes per unit of each
    column, then its constant bytes."""
    exact_int: np.ndarray
    """The same matrix in int64 (used when float64 could round)."""
    rows: np.ndarray
    """Index of each kept candidate in the structure's candidates."""


_JOB_SYMBOLS = {sym.name for sym in S.JOB_SYMBOLS}
_JOB_INDEX = {sym.name: i for i, sym in enumerate(S.JOB_SYMBOLS)}
Poly = dict[tuple[int, ...], int]
_ZERO = (0,) * len(_JOB_INDEX)
"""The exponents of the constant monomial."""


def _uses_job_symbols(prog: Sequence) -> bool:
    if prog[0] == "sym":
        return prog[1] in _JOB_SYMBOLS
    return any(_uses_job_symbols(a) for a in prog[1:] if isinstance(a, tuple))


def _poly_mul(p: Poly, q: Poly) -> Poly:
    out: Poly = {}
    for e1, c1 in p.items():
        for e2, c2 in q.items():
            e = tuple(a + b for a, b in zip(e1, e2, strict=True))
            out[e] = out.get(e, 0) + c1 * c2
    return {e: c for e, c in out.items() if c}


def _poly_leaf(prog: Sequence, dims: dict[str, int]) -> Poly:
    """An ``int`` or a ``sym`` (a job size: its monomial; a model dimension: its value)."""
    if prog[0] == "int":
        return {_ZERO: int(prog[1])} if prog[1] else {}
    if prog[1] in _JOB_INDEX:
        exps = [0] * len(_JOB_INDEX)
        exps[_JOB_INDEX[prog[1]]] = 1
        return {tuple(exps): 1}
    value = int(dims[prog[1]])
    return {_ZERO: value} if value else {}


def _poly_add(parts: Sequence[Poly]) -> Poly:
    out: Poly = {}
    for part in parts:
        for e, c in part.items():
            out[e] = out.get(e, 0) + c
    return {e: c for e, c in out.items() if c}


def _poly_quotient(num: Poly, den: Poly) -> Poly | None:
    """``num / den`` when ``den`` is a positive constant dividing every coefficient of ``num``."""
    if set(den) != {_ZERO} or den[_ZERO] <= 0:
        return None
    d = den[_ZERO]
    if any(c % d for c in num.values()):
        return None
    return {e: c // d for e, c in num.items()}


def polynomial(prog: Sequence, dims: dict[str, int]) -> Poly | None:
    """``prog`` as an exact polynomial in the job sizes ``(b, s, c)`` with integer
    coefficients (monomial exponents -> coefficient), the model's dimensions substituted; None
    when it is not one (a ``ceil``/``floor``/``div`` whose numerator's coefficients are not all
    multiples of a constant denominator, or a ``max``/``min``). Where every coefficient is a
    multiple of the denominator, the division is exact at every integer size, so rounding
    does nothing and the size is that polynomial."""
    op = prog[0]
    if op in ("int", "sym"):
        return _poly_leaf(prog, dims)
    if op not in ("add", "mul", "pow", "div", "floor", "ceil"):
        return None  # max, min
    operands = prog[1:2] if op == "pow" else prog[1:]
    parts = [polynomial(a, dims) for a in operands]
    polys = [p for p in parts if p is not None]
    if len(polys) < len(parts):
        return None
    if op == "add":
        return _poly_add(polys)
    if op == "mul":
        return reduce(_poly_mul, polys, {_ZERO: 1})
    if op == "pow":
        return reduce(_poly_mul, [polys[0]] * int(prog[2]), {_ZERO: 1})
    return _poly_quotient(*polys)


def _reduce(
    table: StructureTable, n_layers: int, dims: dict[str, int], prune: bool, by_step: bool = False
) -> Reduced:
    """Fold constant sizes into one column. For large grids (``prune``), also write the sizes
    that are exact polynomials of the job sizes as their monomials (``polynomial``), so the
    candidates become rows over a few monomials plus the sizes that round, and drop dominated
    candidates; a plan's few points skip both (their setup would cost more than it saves)."""
    rows = table.rows(n_layers)
    varying = np.array([_uses_job_symbols(p) for p in table.programs], dtype=bool)
    env: dict[str, Value] = {name: np.int64(v) for name, v in dims.items()}
    const_sizes = np.array(
        [
            0 if v else int(run_program(p, env))
            for p, v in zip(table.programs, varying, strict=True)
        ],
        dtype=np.int64,
    )
    const = rows[:, ~varying] @ const_sizes[~varying]
    var_programs = [p for p, v in zip(table.programs, varying, strict=True) if v]
    var_counts = rows[:, varying]
    if not prune:
        columns = tuple(("prog", p) for p in var_programs)
        full = np.concatenate([var_counts, const[:, None]], axis=1)
        keep = np.arange(len(full), dtype=np.int64)
        return Reduced(columns, full.astype(np.float64), full, keep)
    index: dict[tuple, int] = {}
    transform: list[dict[int, int]] = []  # per varying size: column -> coefficient
    const_coef = np.zeros(len(var_programs), dtype=np.float64)
    for k, prog in enumerate(var_programs):
        poly = polynomial(prog, dims)
        terms = (
            {("mono", e): c for e, c in poly.items()} if poly is not None else {("prog", prog): 1}
        )
        mapped: dict[int, int] = {}
        for col, coef in terms.items():
            if col == ("mono", _ZERO):
                const_coef[k] = coef
            else:
                mapped[index.setdefault(col, len(index))] = coef
        transform.append(mapped)
    t = np.zeros((len(var_programs), len(index)), dtype=np.float64)
    for k, mapped in enumerate(transform):
        for j, coef in mapped.items():
            t[k, j] = coef
    full_f = np.concatenate(
        [var_counts.astype(np.float64) @ t, (const + var_counts @ const_coef)[:, None]], axis=1
    )
    if not np.abs(full_f).max(initial=0.0) < 2.0**52:
        # coefficients too large: plain sizes
        return _reduce(table, n_layers, dims, prune=False, by_step=by_step)
    t_int = t.astype(np.int64)
    full = np.concatenate(
        [var_counts @ t_int, (const + var_counts @ const_coef.astype(np.int64))[:, None]], axis=1
    )
    groups: tuple[np.ndarray, ...] = (np.arange(len(full)),)
    if by_step:  # dominance within each group only: a group's constant keeps the order
        first = step1_mask(table.phases)
        groups = (np.flatnonzero(first), np.flatnonzero(~first))
    keep_list: list[int] = []
    for group in groups:
        sub = full[group]
        keep_list.extend(int(group[i]) for i in _undominated(sub, np.zeros_like(sub)))
    keep = np.array(sorted(keep_list), dtype=np.int64)
    kept = full[keep]
    return Reduced(tuple(index), kept.astype(np.float64), kept, keep)


def device_extra_bytes(job: Training | Inference, device: str) -> int:
    """Bytes ``calc.estimate`` adds outside the replay (cuBLAS workspaces on CUDA)."""
    return int(_estimate._device_terms(job, device)[0])


def _check_magnitude(
    columns: tuple, env: Mapping[str, Value], b: np.ndarray, s: np.ndarray, c: np.ndarray
) -> None:
    """Refuse sizes whose int64 evaluation could wrap around: every column grows with the job
    sizes, so it is evaluated in float64 at the largest ones first."""
    if not len(b):
        return
    top: dict[str, Value] = {k: np.float64(v) for k, v in env.items() if k not in _JOB_SYMBOLS}
    top.update(b=np.float64(b.max()), s=np.float64(s.max()), c=np.float64(c.max()))
    for col in columns:
        if col[0] == "mono":
            value = np.prod(
                [top[sym.name] ** e for sym, e in zip(S.JOB_SYMBOLS, col[1], strict=True)]
            )
        else:
            value = run_program(col[1], top)
        if not abs(float(value)) < 2.0**61:
            raise OverflowError(f"plan_eval: a size near {float(value):.3g} is beyond exact int64")


def _column_values(col: tuple, env: Mapping[str, Value], n: int, memo: dict) -> np.ndarray:
    if col not in memo:
        if col[0] == "mono":
            value: Value = np.int64(1)
            for sym, exp in zip(S.JOB_SYMBOLS, col[1], strict=True):
                if exp:
                    value = value * env[sym.name] ** exp
        else:
            value = run_program(col[1], env)
        memo[col] = np.broadcast_to(np.asarray(value, dtype=np.int64), (n,))
    return memo[col]


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
    extras: tuple[int | np.ndarray, int | np.ndarray] | None = None,
) -> GridPeaks:
    """Peaks of ``job``'s structure at each point ``(b[i], s[i], c[i])`` (micro-batch or batch,
    sequence or prompt length, KV context; ``c`` defaults to ``s``).

    Equal, point by point, to ``calc.estimate(model, job with those sizes, device)``: the same
    timeline, the sizes evaluated in exact integer arithmetic, the same device terms.
    ``memo`` (a dict, empty at first) shares evaluated sizes between calls over the same points
    and model. ``extras``: ``(step1_bytes, later_bytes)``, ints or int arrays over the points:
    constant storages outside the replay (``calc.estimate.ranks``: DDP's buckets), added to the
    candidates of step 1 (phase ``step1/...``) and to the others, as ``calc.estimate.core.evaluate``
    adds them (dominance pruning then stays within each group, ``reduced``). Raises
    ``NotImplementedError`` (the cost model's message) for a structure not modelled.
    """
    if table is None:
        table, _ = structure_table(model, job, device)
    if table.not_modelled:
        raise NotImplementedError(table.not_modelled)
    b = np.ascontiguousarray(b, dtype=np.int64)
    s = np.ascontiguousarray(s, dtype=np.int64)
    c = s if c is None else np.ascontiguousarray(c, dtype=np.int64)
    red = reduced(table, model, prune=len(b) >= PRUNE_MIN_POINTS, by_step=extras is not None)
    env: dict[str, Value] = {sym.name: np.int64(v) for sym, v in model.dims().items()}
    env.update(b=b, s=s, c=c)
    memo = {} if memo is None else memo
    n = len(b)
    _check_magnitude(red.columns, env, b, s, c)
    sizes = np.empty((n, len(red.columns) + 1), dtype=np.int64)
    for j, col in enumerate(red.columns):
        sizes[:, j] = _column_values(col, env, n, memo)
    sizes[:, -1] = 1
    # Every partial sum of a row is at most sum_j |count_j| x max |column_j|: exact in float64
    # while below 2**53 (checked with a factor-2 margin for the check's own rounding), exact
    # in int64 below 2**62; beyond, refuse rather than wrap around.
    col_max = np.abs(sizes).max(axis=0).astype(np.float64) if n else np.ones(sizes.shape[1])
    bound = float((np.abs(red.matrix) @ col_max).max(initial=0.0))
    add = None
    if extras is not None:  # per point: step-1 candidates get extras[0], the others extras[1]
        first = step1_mask(table.phases)[red.rows]
        e1 = np.broadcast_to(np.asarray(extras[0], dtype=np.int64), (n,))
        e2 = np.broadcast_to(np.asarray(extras[1], dtype=np.int64), (n,))
        add = np.where(first[None, :], e1[:, None], e2[:, None])  # [points, kept candidates]
        bound += float(np.abs(add).max(initial=0))
    if bound >= 2.0**62:
        raise OverflowError(f"plan_eval: peaks near {bound:.3g} B are beyond exact int64")
    exact_float = bound < EXACT_FLOAT_LIMIT / 2
    sizes_f = sizes.astype(np.float64) if exact_float else sizes
    counts_t = (red.matrix if exact_float else red.exact_int).T
    if add is not None:
        add = add.astype(sizes_f.dtype)
    peak = np.empty(n, dtype=np.int64)
    best = np.empty(n, dtype=np.int64)
    for lo in range(0, n, CHUNK_POINTS):  # chunks keep the [points, candidates] block in cache
        totals = sizes_f[lo : lo + CHUNK_POINTS] @ counts_t
        if add is not None:
            totals = totals + add[lo : lo + CHUNK_POINTS]
        arg = totals.argmax(axis=1)
        peak[lo : lo + CHUNK_POINTS] = totals[np.arange(len(arg)), arg]
        best[lo : lo + CHUNK_POINTS] = arg
    best = red.rows[best]
    return GridPeaks(peak + device_extra_bytes(job, device), best, table.phases)


def grad_numels(table: StructureTable, model: ModelSpec) -> list[tuple] | None:
    """``(tag, numel, itemsize)`` of the replay's parameter leaves in first-backward order
    (``StructureTable.grad_order``) at ``model``'s dimensions, the input of
    ``calc.estimate.ranks.expand_layers``; None when a numel depends on the job's sizes (then no
    constant per structure exists)."""
    env: dict[str, Value] = {sym.name: np.int64(v) for sym, v in model.dims().items()}
    out = []
    for tag, prog, itemsize in table.grad_order:
        if _uses_job_symbols(prog):
            return None
        out.append((tag, int(run_program(prog, env)), itemsize))
    return out
