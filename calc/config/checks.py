"""The checks every config runs at the edge: each raises ``ValueError`` naming the field, the
value and what is allowed (bools are never taken for numbers)."""

from __future__ import annotations

from typing import TypeGuard

MAX_TOKENS = 1 << 40
"""Upper bound on batch x sequence sizes accepted (beyond any real run; guards typos)."""


def is_int(value: object) -> TypeGuard[int]:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[float]:
    """True for an ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(map(repr, allowed))}")


def check_size(field: str, value: object, low: int = 1, high: int = MAX_TOKENS) -> None:
    """Raise ``ValueError`` unless ``value`` is an int in ``[low, high]`` (bools rejected)."""
    if not is_int(value):
        raise ValueError(f"{field}={value!r} must be an integer in [{low}, {high}]")
    if not low <= value <= high:
        raise ValueError(f"{field}={value} is out of range: allowed [{low}, {high}]")


def check_fraction(field: str, value: object, high_inclusive: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number in ``[0, 1)`` (or ``[0, 1]``)."""
    ok = is_real(value) and 0 <= value and (value <= 1 if high_inclusive else value < 1)
    if not ok:
        bound = "1]" if high_inclusive else "1)"
        raise ValueError(f"{field}={value!r} must be a number in [0, {bound}")


def check_bool(field: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{field}={value!r} must be True or False")
