"""calc.derive.lift: regimes, sample grids and exact polynomial fits, on hand-made sizes."""

from __future__ import annotations

import pytest
import sympy as sp

from calc import symbols as S
from calc.derive import lift


def test_training_regime_and_grid() -> None:
    # b=4, s=1000 with a window of 4096: b lies in (1, inf), s in (1, 4096].
    reg = lift.regime({"b": 4, "s": 1000}, [4096])
    assert reg.free == (("b", 1, -1), ("s", 1, 4096)) and reg.fixed == ()
    grid, held = lift.sample_plan(reg)
    # b: 2, 3 (degree 1) then 4 held out; s: multiples of 64 above 1: 64, 128, 192, then 256.
    assert grid == [{"b": b, "s": s} for b in (2, 3) for s in (64, 128, 192)]
    assert held == {"b": 4, "s": 256}


def test_one_sequence_and_long_sequences_are_other_regimes() -> None:
    # b=1 is its own regime (a slice of one row is contiguous): fixed, never fitted.
    assert lift.regime({"b": 1, "s": 100}, []).fixed == (("b", 1),)
    # s beyond a window of 4096: sampled above it.
    reg = lift.regime({"b": 2, "s": 8192}, [4096])
    _, held = lift.sample_plan(reg)
    assert ("s", 4096, -1) in reg.free and held["s"] == 4096 + 4 * 64
    # s=40 under max_positions 64: (1, 64] cannot hold 4 samples of step 64: fixed at 40.
    assert ("s", 40) in lift.regime({"b": 2, "s": 40}, [64]).fixed


def test_inference_context_samples_lie_above_prompt_samples() -> None:
    reg = lift.regime({"b": 2, "s": 100, "c": 5000}, [])
    grid, held = lift.sample_plan(reg)
    assert all(p["s"] <= p["c"] for p in [*grid, held])
    assert len(grid) == 2 * 3 * 2  # degree+1 values of b, s, c


def test_fit_recovers_hand_polynomials() -> None:
    # Sizes by hand: a constant (4096), ids (8*b*s), scores (4*a*b*s^2 with a=2: 8*b*s^2),
    # and 3/2*s (a bf16 half of an odd count, any rational works).
    reg = lift.regime({"b": 3, "s": 100}, [])
    grid, held = lift.sample_plan(reg)

    def sizes(p: dict[str, int]) -> list[int]:
        b, s = p["b"], p["s"]
        return [4096, 8 * b * s, 8 * b * s * s, 3 * s // 2]

    fitted = lift.fit(reg, grid, held, [sizes(p) for p in grid], sizes(held), list("wxyz"))
    exprs = [lift.expression(poly, reg) for poly in fitted]
    assert exprs[0] == 4096
    assert sp.expand(exprs[1] - 8 * S.b * S.s) == 0
    assert sp.expand(exprs[2] - 8 * S.b * S.s**2) == 0
    assert sp.expand(exprs[3] - sp.Rational(3, 2) * S.s) == 0


def test_fit_refuses_a_size_that_is_no_polynomial() -> None:
    # 2**(s/64) grows faster than s^2: the held-out point exposes it.
    reg = lift.regime({"b": 3, "s": 100}, [])
    grid, held = lift.sample_plan(reg)
    with pytest.raises(lift.FitError, match="odd"):
        lift.fit(reg, grid, held, [[2 ** (p["s"] // 64)] for p in grid], [2 ** (held["s"] // 64)],
                 ["odd"])  # fmt: skip


def test_factor_plan_takes_four_points_and_finds_the_same_polynomials() -> None:
    # Training (b, s): b at its first sample 2, s at 64, 128, 192; the check point is the grid's
    # held-out one (b=4, s=256). Inference adds c at its first sample only.
    reg = lift.regime({"b": 3, "s": 100}, [])
    points, held = lift.factor_plan(reg) or ([], {})
    assert points == [{"b": 2, "s": s} for s in (64, 128, 192)]
    assert held == lift.sample_plan(reg)[1]
    infer = lift.regime({"b": 2, "s": 100, "c": 5000}, [])
    assert len((lift.factor_plan(infer) or ([], {}))[0]) == 3

    # The hand sizes of test_fit_recovers_hand_polynomials plus b-free 6*s^2 + 2*s (a mask
    # and a position table): at b=2 each is a polynomial of s; from b=2 to b=4 the b-sizes
    # double, the others stay.
    def sizes(p: dict[str, int]) -> list[int]:
        b, s = p["b"], p["s"]
        return [4096, 8 * b * s, 8 * b * s * s, 3 * s // 2, 6 * s * s + 2 * s]

    fitted = lift.fit_factors(reg, points, held, [sizes(p) for p in points], sizes(held))
    assert fitted is not None
    exprs = [lift.expression(poly, reg) for poly in fitted]
    assert exprs[0] == 4096
    assert sp.expand(exprs[1] - 8 * S.b * S.s) == 0
    assert sp.expand(exprs[2] - 8 * S.b * S.s**2) == 0
    assert sp.expand(exprs[3] - sp.Rational(3, 2) * S.s) == 0
    assert sp.expand(exprs[4] - (6 * S.s**2 + 2 * S.s)) == 0


def test_factor_plan_refuses_a_size_of_another_form() -> None:
    # b*s + s (a batch of rows plus one shared row) grows by (4*256 + 256) / (2*256 + 256) =
    # 5/3 from b=2 to b=4: neither 1 nor 2, so the full grid is needed.
    reg = lift.regime({"b": 3, "s": 100}, [])
    points, held = lift.factor_plan(reg) or ([], {})

    def sizes(p: dict[str, int]) -> list[int]:
        return [p["b"] * p["s"] + p["s"]]

    assert lift.fit_factors(reg, points, held, [sizes(p) for p in points], sizes(held)) is None
