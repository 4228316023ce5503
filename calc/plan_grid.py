"""Peaks of many configurations at once: ``calc.estimate``'s answer, vectorised over a grid.

``calc.estimate`` compiles one *structure* (the tensors a step allocates; sizes are symbols) into
a timeline: candidate peaks ``(C0 + L*C1) @ sizes``, where ``sizes`` are the distinct rounded
storage sizes, sympy expressions of the symbols of ``calc.symbols`` (``calc.timeline``). Within a
structure only sizes change, so a grid of micro-batches and sequence lengths is one
evaluation of the sizes over numpy arrays and one matrix product.

The size expressions are translated once into a small program of integer operations
(``to_program``): exact int64 arithmetic, ``ceil``/``floor`` as integer division, so the
planner's peaks are the exact byte counts and never go through ``eval`` of any text. The
structure's timeline (programs, count matrices, candidate phases) is plain data: it is kept in
memory and, through ``calc.cards``, in a persistent JSON cache keyed by a SHA-256 of calc's
source and of the structure, so the ~1.6 s symbolic replay of a structure is paid once per
machine and calc version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import import_module

import numpy as np
import sympy as sp

from calc import symbols as S
from calc.jobs import Inference, Training
from calc.model_spec import ModelSpec

_estimate = import_module("calc.estimate")  # the module (``calc.estimate`` is the function)

EXACT_FLOAT_LIMIT = 1 << 53
"""Integers below this are exact in float64: the matrix product runs in float64 (BLAS) when
every partial sum is below it, in int64 otherwise."""
CHUNK_POINTS = 2048
"""Points evaluated per matrix product (the product's block then fits in the CPU cache)."""
CACHE_FORMAT = 1
"""Version of the cache entries' layout (part of the cache key)."""
NOT_IN_TABLES = frozenset(
    {
        "cards.py", "cli.py", "evidence.py", "gpus.py", "plan.py", "plan_axes.py",
        "plan_cli.py", "plan_engine.py", "plan_result.py", "plan_search.py", "result.py",
        "throughput.py",
    }
)  # fmt: skip
"""Modules of ``calc`` that do not change a compiled table (the planner's presentation, the
catalog, the CLI): left out of the cache key. Every other module, new ones included, is in it."""
"""Version of the cache entries' layout (part of the cache key)."""

_NAMES = {sym: sym.name for sym in S.ALL_SYMBOLS}


def to_program(expr: sp.Expr) -> tuple:
    """A nested-tuple program computing the integer ``expr`` exactly from integer symbols.

    Operations: ``("int", n)``, ``("sym", name)``, ``("add", ...)``, ``("mul", ...)``,
    ``("pow", base, n)`` (n >= 1), ``("div", num, den)`` (floor division: exact where the
    expression is an integer), ``("ceil", num, den)``, ``("floor", num, den)``, ``("max", ...)``,
    ``("min", ...)``. Rational parts are brought over one integer denominator
    (``sympy.fraction(sympy.together(...))``) so no step divides before the end.
    Raises ``NotImplementedError`` naming any other sympy function.
    """
    expr = sp.sympify(expr)  # a sympy object already (never user text): normalises Python ints
    if expr.is_Integer:
        return ("int", int(expr))
    if expr.is_Symbol:
        if expr not in _NAMES:
            raise NotImplementedError(f"plan_grid: unknown symbol {expr}")
        return ("sym", _NAMES[expr])
    if isinstance(expr, sp.ceiling | sp.floor):
        num, den = sp.fraction(sp.together(expr.args[0]))
        op = "ceil" if isinstance(expr, sp.ceiling) else "floor"
        return (op, to_program(num), to_program(den))
    if isinstance(expr, sp.Max | sp.Min):
        op = "max" if isinstance(expr, sp.Max) else "min"
        return (op, *(to_program(a) for a in expr.args))
    num, den = sp.fraction(sp.together(expr))
    if den != 1:
        return ("div", to_program(num), to_program(den))
    if expr.is_Add:
        return ("add", *(to_program(a) for a in expr.args))
    if expr.is_Mul:
        return ("mul", *(to_program(a) for a in expr.args))
    if expr.is_Pow and expr.exp.is_Integer and int(expr.exp) >= 1:
        return ("pow", to_program(expr.base), int(expr.exp))
    raise NotImplementedError(f"plan_grid cannot evaluate {type(expr).__name__}: {expr}")


def run_program(prog: Sequence, env: dict[str, object]) -> object:
    """Evaluate a ``to_program`` program; ``env`` maps symbol names to ints or int64 arrays."""
    op = prog[0]
    if op == "int":
        return np.int64(prog[1])
    if op == "sym":
        return env[prog[1]]
    if op == "add":
        out = run_program(prog[1], env)
        for arg in prog[2:]:
            out = out + run_program(arg, env)
        return out
    if op == "mul":
        out = run_program(prog[1], env)
        for arg in prog[2:]:
            out = out * run_program(arg, env)
        return out
    if op == "pow":
        return run_program(prog[1], env) ** int(prog[2])
    if op in ("div", "floor"):
        return run_program(prog[1], env) // run_program(prog[2], env)
    if op == "ceil":
        return -((-run_program(prog[1], env)) // run_program(prog[2], env))
    if op in ("max", "min"):
        fn = np.maximum if op == "max" else np.minimum
        out = run_program(prog[1], env)
        for arg in prog[2:]:
            out = fn(out, run_program(arg, env))
        return out
    raise ValueError(f"plan_grid: unknown program operation {op!r}")


def _listify(prog: Sequence) -> list:
    return [_listify(p) if isinstance(p, tuple | list) else p for p in prog]


def _tuplify(prog: Sequence) -> tuple:
    return tuple(_tuplify(p) if isinstance(p, list) else p for p in prog)


@dataclass(frozen=True, slots=True)
class StructureTable:
    """One structure's timeline as plain data (what the persistent cache stores)."""

    programs: tuple
    """One ``to_program`` program per distinct storage size."""
    c0: np.ndarray
    """[candidates, sizes] constant counts (``calc.timeline.Timeline.c0``)."""
    c1: np.ndarray
    """[candidates, sizes] counts per layer."""
    phases: tuple[str, ...]
    """Phase of each candidate."""
    not_modelled: str = ""
    """The cost model's ``NotImplementedError`` message when it does not cover the structure."""
    _rows: dict = field(default_factory=dict, compare=False)
    """Memo: model dimensions -> ``Reduced``."""

    def to_json(self) -> dict:
        return {
            "programs": [_listify(p) for p in self.programs],
            "c0": self.c0.tolist(),
            "c1": self.c1.tolist(),
            "phases": list(self.phases),
            "not_modelled": self.not_modelled,
        }

    @classmethod
    def from_json(cls, data: dict) -> StructureTable:
        n_sizes = len(data["programs"])
        shape = (-1, n_sizes)
        return cls(
            programs=tuple(_tuplify(p) for p in data["programs"]),
            c0=np.asarray(data["c0"], dtype=np.int64).reshape(shape),
            c1=np.asarray(data["c1"], dtype=np.int64).reshape(shape),
            phases=tuple(data["phases"]),
            not_modelled=str(data.get("not_modelled", "")),
        )

    def rows(self, n_layers: int) -> np.ndarray:
        """``C0 + n_layers * C1``: the count of each size at each candidate."""
        return self.c0 + n_layers * self.c1

    def reduced(self, model: ModelSpec) -> Reduced:
        """The candidates that can be the peak for ``model``'s dimensions (memoised)."""
        dims = tuple((sym.name, int(v)) for sym, v in model.dims().items())
        if dims not in self._rows:
            self._rows[dims] = _reduce(self, model.n_layers, dict(dims))
        return self._rows[dims]


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


def _reduce(table: StructureTable, n_layers: int, dims: dict[str, int]) -> Reduced:
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
    keep = np.array(sorted(_undominated(full, np.zeros_like(full))), dtype=np.int64)
    kept = full[keep]
    var_programs = tuple(p for p, v in zip(table.programs, varying, strict=True) if v)
    return Reduced(var_programs, kept.astype(np.float64), kept, keep)


def _cap_grad_accum(job: Training | Inference) -> Training | Inference:
    """``job`` with ``grad_accum`` beyond 2 set to 2: the replay accumulates identically from the
    second micro-batch on, so the peaks agree (tests/test_plan_grid.py checks it) and one
    compile serves every accumulation count >= 2."""
    from dataclasses import replace

    if isinstance(job, Training) and job.grad_accum > 2:
        return replace(job, grad_accum=2)
    return job


def structure_id(model: ModelSpec, job: Training | Inference) -> tuple:
    """What decides the compiled structure of ``(model, job)``: jobs with equal ids differ
    only in sizes and share one ``StructureTable``."""
    return _estimate._structure_key(model, _cap_grad_accum(job))


def _cache_name(key: tuple, device: str, branch: int) -> str:
    from calc.cards import calc_source_digest

    digest = _source_digest(lambda: calc_source_digest(NOT_IN_TABLES))
    text = repr((CACHE_FORMAT, digest, key, device, branch))
    return hashlib.sha256(text.encode()).hexdigest()


_DIGEST: list[str] = []


def _source_digest(fn: Callable[[], str]) -> str:
    if not _DIGEST:
        _DIGEST.append(fn())
    return _DIGEST[0]


_TABLES: dict[tuple, StructureTable] = {}


def _compile_table(model: ModelSpec, job: Training | Inference, device: str) -> StructureTable:
    try:
        comp, _key = _estimate._compiled_for(model, job, device)
    except NotImplementedError as exc:
        return StructureTable(
            (), np.zeros((0, 0), np.int64), np.zeros((0, 0), np.int64), (), str(exc)
        )
    tl = comp.timeline
    return StructureTable(
        programs=tuple(to_program(size) for size in tl.sizes),
        c0=np.asarray(tl.c0, dtype=np.int64),
        c1=np.asarray(tl.c1, dtype=np.int64),
        phases=tuple(c.phase for c in tl.candidates),
    )


def structure_table(
    model: ModelSpec, job: Training | Inference, device: str = "cuda", persist: bool = True
) -> tuple[StructureTable, bool]:
    """The structure of ``(model, job)`` as a ``StructureTable``, and whether it had to be
    compiled now (False: from memory or from the persistent cache).

    Raises ``ValueError`` for a job ``calc.Training``/``calc.Inference`` rejects (they validate
    on construction, so this only re-checks the device)."""
    job = _cap_grad_accum(job)
    key = _estimate._structure_key(model, job)
    branch = _estimate._branch(model.n_layers)
    mem_key = (key, device, branch)
    if mem_key in _TABLES:
        return _TABLES[mem_key], False
    name = _cache_name(key, device, branch) if persist else ""
    if persist:
        from calc.cards import read_plan_cache

        data = read_plan_cache(name)
        if data is not None:
            try:
                table = StructureTable.from_json(data)
            except (KeyError, TypeError, ValueError):
                table = None
            if table is not None:
                _TABLES[mem_key] = table
                return table, False
    table = _compile_table(model, job, device)
    _TABLES[mem_key] = table
    if persist:
        from calc.cards import write_plan_cache

        write_plan_cache(name, table.to_json())
    return table, True


def clear_memory_cache() -> None:
    """Forget the structures held in memory (the persistent cache stays)."""
    _TABLES.clear()


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
    red = table.reduced(model)
    env: dict[str, object] = {sym.name: np.int64(v) for sym, v in model.dims().items()}
    env.update(b=b, s=s, c=c)
    memo = {} if memo is None else memo
    n = len(b)
    sizes = np.empty((n, len(red.var_programs) + 1), dtype=np.int64)
    for j, prog in enumerate(red.var_programs):
        sizes[:, j] = _size_values(prog, env, n, memo)
    sizes[:, -1] = 1
    # every partial sum is at most sum(|counts|) x max(size): exact in float64 below 2**53
    bound = int(np.abs(red.exact_int).sum(axis=1).max(initial=0)) * int(sizes.max(initial=1))
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
