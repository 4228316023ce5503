"""The planner's integer programs: a size expression of the cost model as plain data.

``to_program`` turns a sympy expression of the symbols of ``calc.symbols`` (a storage size in
bytes, e.g. ``512*ceiling(b*s*h/256)``) into nested tuples of integer operations; ``run_program``
evaluates one over int64 numpy arrays. The arithmetic is exact (``ceil``/``floor`` as integer
division over one common denominator), and a program is data that a cache can store as JSON:
nothing is ever ``eval``-ed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import sympy as sp

from calc import symbols as S

_NAMES = {sym: sym.name for sym in S.ALL_SYMBOLS}
Value: TypeAlias = np.integer | np.floating | npt.NDArray[np.integer | np.floating]
"""What a program computes from its symbols' values: one int64, or int64 values over a grid of
points (exact); float64 only to bound a size's magnitude before the exact evaluation."""


def to_program(expr: sp.Basic) -> tuple:
    """A nested-tuple program computing the integer ``expr`` exactly from integer symbols.

    Operations: ``("int", n)``, ``("sym", name)``, ``("add", ...)``, ``("mul", ...)``,
    ``("pow", base, n)`` (n >= 1), ``("div", num, den)`` (floor division: exact where the
    expression is an integer), ``("ceil", num, den)``, ``("floor", num, den)``, ``("max", ...)``,
    ``("min", ...)``, ``("ifeq", lhs, rhs, then, otherwise)`` (a ``Piecewise`` on equalities).
    Rational parts are brought over one integer denominator
    (``sympy.fraction(sympy.together(...))``) so no step divides before the end.
    Raises ``NotImplementedError`` naming any other sympy function.
    """
    expr = sp.sympify(expr)  # a sympy object already (never user text): normalises Python ints
    if isinstance(expr, sp.Integer):
        return ("int", int(expr))
    if isinstance(expr, sp.Symbol):
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
    if isinstance(expr, sp.Piecewise):
        return _piecewise(expr.args)
    num, den = sp.fraction(sp.together(expr))
    if den != 1:
        return ("div", to_program(num), to_program(den))
    if expr.is_Add:
        return ("add", *(to_program(a) for a in expr.args))
    if expr.is_Mul:
        return ("mul", *(to_program(a) for a in expr.args))
    if isinstance(expr, sp.Pow) and expr.exp.is_Integer and int(expr.exp) >= 1:
        return ("pow", to_program(expr.base), int(expr.exp))
    raise NotImplementedError(f"plan_grid cannot evaluate {type(expr).__name__}: {expr}")


def _piecewise(pieces: Sequence) -> tuple:
    """``Piecewise`` whose conditions are equalities, the last ``True`` (a storage that differs
    at one size, `calc.compress.nf4_torchao`): ``("ifeq", lhs, rhs, then, otherwise)``."""
    (value, cond), rest = pieces[0], pieces[1:]
    if cond is sp.true:
        return to_program(value)
    if not isinstance(cond, sp.Eq) or not rest:
        raise NotImplementedError(f"plan_grid cannot evaluate the condition {cond}")
    return ("ifeq", to_program(cond.lhs), to_program(cond.rhs), to_program(value),
            _piecewise(rest))  # fmt: skip


_FOLDS: dict[str, Callable[[Value, Value], Value]] = {
    "add": operator.add, "mul": operator.mul, "max": np.maximum, "min": np.minimum,
}  # fmt: skip


def run_program(prog: Sequence, env: Mapping[str, Value]) -> Value:
    """Evaluate a ``to_program`` program; ``env`` maps symbol names to int64 values or arrays."""
    op = prog[0]
    if op == "int":
        return np.int64(prog[1])
    if op == "sym":
        return env[prog[1]]
    if op in _FOLDS:  # add, mul, max, min over two or more arguments
        fold = _FOLDS[op]
        out = run_program(prog[1], env)
        for arg in prog[2:]:
            out = fold(out, run_program(arg, env))
        return out
    if op == "pow":
        return run_program(prog[1], env) ** int(prog[2])
    if op in ("div", "floor"):
        return run_program(prog[1], env) // run_program(prog[2], env)
    if op == "ceil":
        return -((-run_program(prog[1], env)) // run_program(prog[2], env))
    if op == "ifeq":
        same = run_program(prog[1], env) == run_program(prog[2], env)
        return np.where(same, run_program(prog[3], env), run_program(prog[4], env))
    raise ValueError(f"plan_grid: unknown program operation {op!r}")


def program_to_json(prog: Sequence) -> list:
    """A program as nested JSON lists."""
    return [program_to_json(p) if isinstance(p, tuple | list) else p for p in prog]


def program_from_json(prog: Sequence) -> tuple:
    """A program back from nested JSON lists (hashable nested tuples)."""
    return tuple(program_from_json(p) if isinstance(p, list) else p for p in prog)
