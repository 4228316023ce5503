"""`import calc`: the names the README documents, each documented, and no internals."""

from __future__ import annotations

import inspect

import calc


def test_plan_is_reachable_from_import_calc() -> None:
    # the README's `calc.plan.planner.plan(...)`
    assert callable(calc.plan.planner.plan)


def test_every_public_name_has_a_docstring_and_annotations() -> None:
    for name in calc.__all__:
        obj = getattr(calc, name)
        if isinstance(obj, int):  # GIB, a constant
            continue
        assert inspect.getdoc(obj), name
        if inspect.isfunction(obj):
            sig = inspect.signature(obj)
            assert sig.return_annotation is not inspect.Signature.empty, name
            for p in sig.parameters.values():
                assert p.annotation is not inspect.Parameter.empty, (name, p.name)


def test_internals_are_not_exported() -> None:
    for name in ("values_for", "attention_kernel", "check_divisibility"):
        assert name not in calc.__all__
        assert not hasattr(calc, name), name
