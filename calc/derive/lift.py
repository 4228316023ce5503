"""From recorded runs at a few sizes to storage sizes as exact polynomials of the job's symbols.

A run of the modeling code is recorded at the points of a small grid of (batch, sequence[,
context]) values (`sample_plan`); every point must give the same stream of allocations and frees
(the same ops, layers and order: `calc.derive.record.Trace.structure`), else the sizes decide
the code path and no polynomial describes them. Each storage's raw bytes are then solved
exactly, with rational coefficients, over the monomials ``b^i s^j c^k`` of degree at most 1 in
``b`` and ``c`` and 2 in ``s`` (attention scores are ``b * heads * s * s``): the grid is the
tensor product of ``degree + 1`` values per symbol, so the system is square and invertible
(a tensor-product Vandermonde matrix). One more point, with every symbol at a value outside the
grid, checks each fit; a size that misses it is refused.

A symbol whose range of values keeps the code path cannot hold enough sample points (a
sequence of 1 token, a window boundary closer than the grid) is fixed at the job's value: the
estimate is then exact for that value only, and the compile key says so (`Regime`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import sympy as sp

from calc import symbols as S

DEGREE: dict[str, int] = {"b": 1, "s": 2, "c": 1}
"""Highest power of each symbol in a storage size."""
STEP: dict[str, int] = {"b": 1, "s": 64, "c": 64}
"""Spacing of the sample values of each symbol (sequences in multiples of 64 tokens)."""
SYMBOL: dict[str, sp.Symbol] = {"b": S.b, "s": S.s, "c": S.c}


@dataclass(frozen=True, slots=True)
class Regime:
    """The range of job sizes one derived replay holds for: per symbol, either the interval
    ``(low, high]`` its samples are drawn from (no threshold of the config inside), or the one
    value it is fixed at."""

    free: tuple[tuple[str, int, int], ...]
    """(symbol, low, high) of the symbols fitted; ``high`` is -1 for no upper bound."""
    fixed: tuple[tuple[str, int], ...]
    """(symbol, value) of the symbols fixed at the job's value."""


def _interval(value: int, thresholds: Sequence[int]) -> tuple[int, int]:
    """``(low, high]`` around ``value`` with no threshold inside (``high`` -1: unbounded)."""
    low = max((t for t in thresholds if t < value), default=0)
    high = min((t for t in thresholds if t >= value), default=-1)
    return low, high


def regime(values: Mapping[str, int], thresholds: Sequence[int]) -> Regime:
    """The regime of a job: its sizes ``values`` (``b``, ``s`` and for inference ``c``) placed
    among the config's ``thresholds`` (window sizes, where the modeling code changes path).
    Every symbol has the threshold 1: one sequence or one token takes other paths (a slice
    of a single row is contiguous and is not copied; a one-token prompt has no mask). A symbol whose interval cannot hold its samples is fixed at the job's value."""
    free: list[tuple[str, int, int]] = []
    fixed: list[tuple[str, int]] = []
    top = 0  # the largest prompt sample: every context sample lies above it
    for name, value in values.items():
        limits = [1] if name == "b" else [1, *thresholds]
        if name == "s" and "c" in values:
            limits.append(values["c"])  # a prompt never exceeds the context
        low, high = _interval(value, limits)
        axis = _axis(name, low, top)
        if high != -1 and axis[-1] > high:
            fixed.append((name, value))
            top = max(top, value) if name == "s" else top
        else:
            free.append((name, low, high))
            top = max(top, axis[-1]) if name == "s" else top
    return Regime(tuple(free), tuple(fixed))


def _axis(name: str, low: int, top: int) -> list[int]:
    """The sample values of a symbol above ``low`` (a context also above ``top``, the
    largest prompt sample): ``degree + 1`` for the grid, then the held-out one."""
    start = max(low, top) if name == "c" else low
    first = (start // STEP[name] + 1) * STEP[name]  # multiples of the step, above ``start``
    return [first + STEP[name] * i for i in range(DEGREE[name] + 2)]


def _axes(reg: Regime) -> dict[str, list[int]]:
    """The sample values of every free symbol (`_axis`), contexts above the prompts'."""
    axes: dict[str, list[int]] = {}
    top = dict(reg.fixed).get("s", 0)
    for name, low, _high in reg.free:
        axes[name] = _axis(name, low, top)
        if name == "s":
            top = axes[name][-1]
    return axes


def sample_plan(reg: Regime) -> tuple[list[dict[str, int]], dict[str, int]]:
    """(grid points, held-out point): ``degree + 1`` values per free symbol, one more for the
    check; fixed symbols at their value."""
    return points(_axes(reg), dict(reg.fixed))


def points(
    axes: Mapping[str, Sequence[int]], fixed: Mapping[str, int]
) -> tuple[list[dict[str, int]], dict[str, int]]:
    """(grid, held-out point) of sample ``axes`` (the values of each free symbol, the last one
    held out): the tensor product of all but the last value of each, fixed symbols added."""
    names = list(axes)
    grid = [
        {**dict(zip(names, combo, strict=True)), **fixed}
        for combo in itertools.product(*(axes[n][:-1] for n in names))
    ]
    held = {**{n: axes[n][-1] for n in names}, **fixed}
    return grid, held


def _monomials(reg: Regime) -> list[tuple[int, ...]]:
    names = [name for name, *_ in reg.free]
    return list(itertools.product(*(range(DEGREE[n] + 1) for n in names)))


def _row(point: Mapping[str, int], names: Sequence[str], monos: Sequence[tuple]) -> list:
    return [math.prod(point[n] ** e for n, e in zip(names, mono, strict=True)) for mono in monos]


def _inverse(matrix: list[list[int]]) -> list[list[Fraction]]:
    """Gauss-Jordan inverse over the rationals (a square, invertible matrix)."""
    n = len(matrix)
    a = [[Fraction(x) for x in row] + [Fraction(int(i == j)) for j in range(n)]
         for i, row in enumerate(matrix)]  # fmt: skip
    for col in range(n):
        pivot = next(r for r in range(col, n) if a[r][col] != 0)
        a[col], a[pivot] = a[pivot], a[col]
        inv = 1 / a[col][col]
        a[col] = [x * inv for x in a[col]]
        for r in range(n):
            if r != col and a[r][col] != 0:
                factor = a[r][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col], strict=True)]
    return [row[n:] for row in a]


Poly = tuple[tuple[tuple[int, ...], int, int], ...]
"""A size as ((exponents per free symbol), numerator, denominator) terms."""


class FitError(Exception):
    """A storage size is not a polynomial of the symbols (the held-out point misses)."""


def fit(
    reg: Regime, grid: Sequence[Mapping[str, int]], held: Mapping[str, int],
    sizes: Sequence[Sequence[int]], held_sizes: Sequence[int], labels: Sequence[str],
) -> list[Poly]:  # fmt: skip
    """Exact polynomial of every storage: ``sizes[p][i]`` is storage ``i``'s bytes at grid point
    ``p``. Raises `FitError` naming the first storage whose polynomial misses ``held``."""
    names = [name for name, *_ in reg.free]
    monos = _monomials(reg)
    inv = _inverse([_row(p, names, monos) for p in grid])
    held_row = _row(held, names, monos)
    out: list[Poly] = []
    for i in range(len(held_sizes)):
        column = [point[i] for point in sizes]
        if all(v == column[0] for v in column) and held_sizes[i] == column[0]:
            out.append((((0,) * len(names), column[0], 1),) if column[0] else ())
            continue
        coef = [sum((x * y for x, y in zip(row, column, strict=True)), Fraction(0)) for row in inv]
        if sum(c * r for c, r in zip(coef, held_row, strict=True)) != held_sizes[i]:
            raise FitError(
                f"the size of {labels[i]} is not a polynomial of degree <= "
                f"{', '.join(f'{n}^{DEGREE[n]}' for n in names)} (checked at {dict(held)})"
            )
        out.append(
            tuple((m, c.numerator, c.denominator) for m, c in zip(monos, coef, strict=True) if c)
        )
    return out


def expression(poly: Poly, reg: Regime) -> int | sp.Expr:
    """A fitted size as an int (constant) or a sympy expression of ``b``, ``s``, ``c``."""
    names = [name for name, *_ in reg.free]
    if all(not any(m) for m, _, _ in poly):
        return sum(num // den for _, num, den in poly)
    return sp.Add(
        *[
            sp.Rational(num, den) * sp.Mul(*[SYMBOL[n] ** e for n, e in zip(names, m, strict=True)])
            for m, num, den in poly
        ]
    )


FACTORS = ("b", "c")
"""Symbols first tried as a plain factor of every size (power 0 or 1): the batch and the
cache length are a dimension of a tensor or absent from it (`factor_plan`)."""


def _factors(reg: Regime) -> tuple[list[str], list[str]]:
    """(factor symbols, polynomial symbols) among the free ones, in the regime's order."""
    names = [name for name, *_ in reg.free]
    return [n for n in names if n in FACTORS], [n for n in names if n not in FACTORS]


def _ratios(reg: Regime, base: Mapping[str, int], held: Mapping[str, int]) -> dict:
    """Powers (0 or 1 per factor symbol) -> how much a size of that form grows from ``base``
    to ``held`` (the factor symbols' ratios multiplied)."""
    factors, _ = _factors(reg)
    return {
        powers: math.prod(
            (Fraction(held[n], base[n]) ** e for n, e in zip(factors, powers, strict=True)),
            start=Fraction(1),
        )
        for powers in itertools.product((0, 1), repeat=len(factors))
    }


def factor_plan(reg: Regime) -> tuple[list[dict[str, int]], dict[str, int]] | None:
    """(points, check point) for sizes of the form ``b^i c^k q(s)`` (``i, k`` 0 or 1, ``q``
    a polynomial of degree `DEGREE` in ``s``), or None when the plan cannot tell the forms
    apart (two of them would grow alike from a point to the check point).

    The points are the first grid points of `sample_plan` (the factor symbols at their first
    sample, ``degree + 1`` values of ``s``): they give ``q`` exactly; the check point is
    `sample_plan`'s held-out one, where exactly one power of the factors must give the size
    measured. 3 + 1 recordings instead of 6 + 1 for training, 12 + 1 for a prefill; a size
    of another form is refused by `fit_factors` and the full grid is recorded."""
    factors, poly = _factors(reg)
    axes = _axes(reg)
    fixed = dict(reg.fixed)
    base = {n: axes[n][0] for n in factors}
    points = [
        {**base, **dict(zip(poly, combo, strict=True)), **fixed}
        for combo in itertools.product(*(axes[n][:-1] for n in poly))
    ]
    held = {**{n: axes[n][-1] for n in axes}, **fixed}
    ratios = _ratios(reg, base, held)
    if len(set(ratios.values())) < len(ratios):
        return None
    return points, held


def fit_factors(
    reg: Regime, points: Sequence[Mapping[str, int]], held: Mapping[str, int],
    sizes: Sequence[Sequence[int]], held_sizes: Sequence[int],
) -> list[Poly] | None:  # fmt: skip
    """The polynomial of every storage from `factor_plan`'s points (``sizes[p][i]``: storage
    ``i``'s bytes at point ``p``) and its check point, or None when a size is not of the form
    ``b^i c^k q(s)`` (no power of the factors gives the size at the check point). The terms
    are `fit`'s: the same polynomial, in the order of `_monomials`."""
    factors, poly = _factors(reg)
    names = [name for name, *_ in reg.free]
    base = {n: points[0][n] for n in factors}
    poly_monos = list(itertools.product(*(range(DEGREE[n] + 1) for n in poly)))
    inv = _inverse([_row(p, poly, poly_monos) for p in points])
    held_row = _row(held, poly, poly_monos)
    ratios = _ratios(reg, base, held)
    out: list[Poly] = []
    for i, measured in enumerate(held_sizes):
        column = [point[i] for point in sizes]
        if all(v == column[0] for v in column) and measured == column[0]:
            out.append((((0,) * len(names), column[0], 1),) if column[0] else ())
            continue
        coef = [sum((x * y for x, y in zip(row, column, strict=True)), Fraction(0)) for row in inv]
        at_held = sum((c * r for c, r in zip(coef, held_row, strict=True)), Fraction(0))
        found = [p for p, ratio in ratios.items() if at_held * ratio == measured]
        if len(found) != 1:
            return None
        scale = math.prod((Fraction(base[n]) ** e for n, e in zip(factors, found[0], strict=True)),
                          start=Fraction(1))  # fmt: skip
        terms: dict[tuple[int, ...], Fraction] = {}
        for mono, c in zip(poly_monos, coef, strict=True):
            powers = dict(zip(poly, mono, strict=True)) | dict(zip(factors, found[0], strict=True))
            terms[tuple(powers[n] for n in names)] = c / scale
        out.append(
            tuple(
                (m, c.numerator, c.denominator)
                for m in _monomials(reg)
                if (c := terms.get(m, Fraction(0)))
            )
        )
    return out
