"""`calc.plan.program`, `calc.plan.grid`, `calc.plan.grid_eval`: exact integer programs of size
expressions, bulk peaks equal to `calc.estimate`, and the persistent cache.

Tiny model (llama, h=16, L=2, a=k=2, d=8, f=24, V=50), as in tests/calc/estimate/test_terms.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import calc
from calc import symbols as S
from calc.plan import grid as G
from calc.plan import grid_eval as E
from calc.plan import program as PP
from tests.specs import tiny_llama

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")


_llama = tiny_llama


TINY = _llama()


def _run(expr: sp.Expr, **values: int) -> int:
    env = {name: np.int64(v) for name, v in values.items()}
    return int(PP.run_program(PP.to_program(expr), env))


def test_program_rounds_up_to_512_bytes_by_hand() -> None:
    # 512 * ceil(b*s*h*2 / 512): b=3, s=7, h=16 -> 672 B of bf16 -> 2 blocks -> 1024 B
    expr = 512 * sp.ceiling(S.b * S.s * S.h * 2 / 512)
    assert _run(expr, b=3, s=7, h=16) == 1024
    # exactly 512 B (b=1, s=16, h=16, 2 B): one block, no rounding up
    assert _run(expr, b=1, s=16, h=16) == 512


def test_program_is_exact_where_floats_are_not() -> None:
    # h*k/(128*a) with h=5120, k=8, a=40: exactly 8, so 512*ceil(8) = 4096; no float 1/a
    expr = 512 * sp.ceiling(S.h * S.k / (128 * S.a))
    assert _run(expr, h=5120, k=8, a=40) == 4096
    # ceil(b*h/3) at b = 10**17 + 2, h = 3 is exactly b: int64 keeps the +2 (float64 has
    # 53 bits, so b*h/3 in floating point would not be b)
    assert _run(sp.ceiling(S.b * S.h / 3), b=10**17 + 2, h=3) == 10**17 + 2


def test_program_floor_max_min_by_hand() -> None:
    assert _run(sp.floor(S.s / 3), s=10) == 3
    assert _run(sp.Max(S.b, S.s), b=4, s=9) == 9
    assert _run(sp.Min(S.b, S.s) * 2, b=4, s=9) == 8
    assert _run(S.h**2 / 4, h=6) == 9


def test_program_piecewise_on_an_equality_by_hand() -> None:
    # torchao's quantization factor keeps h*h/64 elements at h*h = 16,384 (one scaler block),
    # h*h/16,384 otherwise (calc.compress.nf4_torchao)
    expr = sp.Piecewise((S.h**2 / 64, sp.Eq(S.h**2, 16384)), (S.h**2 / 16384, True))
    assert _run(expr, h=128) == 256
    assert _run(expr, h=256) == 4
    env = {"h": np.array([128, 256, 512], dtype=np.int64)}
    assert PP.run_program(PP.to_program(expr), env).tolist() == [256, 4, 16]


def test_program_refuses_functions_it_does_not_know() -> None:
    with pytest.raises(NotImplementedError, match="cannot evaluate"):
        PP.to_program(sp.sin(S.b))


def _est(job: calc.Training | calc.Inference, device: str) -> int:
    return int(calc.estimate(TINY, job, device=device).peak_bytes)


STRUCTURES = [
    calc.Training(micro_batch=1, seq_len=8, precision="fp32", optimizer="adamw", implementation="reference"),
    calc.Training(micro_batch=1, seq_len=8, precision="bf16", optimizer="sgd", recompute="full"),
    calc.Training(micro_batch=1, seq_len=8, precision="amp-bf16", optimizer="adam8bit", grad_accum=2),
    calc.Inference(batch=1, context=8, implementation="reference"),
]  # fmt: skip


@settings(max_examples=12, deadline=None)
@given(
    which=st.integers(0, len(STRUCTURES) - 1),
    sizes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 40)), min_size=1, max_size=5),
    device=st.sampled_from(["cuda", "cpu"]),
)
def test_grid_peaks_equal_estimate(which: int, sizes: list, device: str) -> None:
    job = STRUCTURES[which]
    b = np.array([x for x, _ in sizes])
    s = np.array([y for _, y in sizes])
    got = E.grid_peaks(TINY, job, b, s, device=device)
    for i, (bi, si) in enumerate(sizes):
        if isinstance(job, calc.Training):
            one = replace(job, micro_batch=bi, seq_len=si)
        else:
            one = replace(job, batch=bi, context=si)
        est = calc.estimate(TINY, one, device=device)
        assert int(got.peak_bytes[i]) == est.peak_bytes
        # the phase the grid names reaches the peak (phases can tie)
        assert est.phases[got.phases[int(got.phase_index[i])]] == est.peak_bytes


def test_persistent_cache_round_trip(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))
    G.clear_memory_cache()
    job = STRUCTURES[0]
    _, fresh = G.structure_table(TINY, job)
    assert fresh
    files = list(tmp_path.glob("*.json"))  # type: ignore[attr-defined]
    assert len(files) == 1
    G.clear_memory_cache()
    again, fresh_again = G.structure_table(TINY, job)
    assert not fresh_again
    b, s = np.array([1, 3]), np.array([8, 13])
    assert E.grid_peaks(TINY, job, b, s, table=again).peak_bytes.tolist() == [
        _est(replace(job, micro_batch=1, seq_len=8), "cuda"),
        _est(replace(job, micro_batch=3, seq_len=13), "cuda"),
    ]
    # a damaged entry is recompiled, never trusted
    files[0].write_text(json.dumps({"programs": "nonsense"}))
    G.clear_memory_cache()
    _, fresh_damaged = G.structure_table(TINY, job)
    assert fresh_damaged


def test_not_modelled_structure_carries_the_cost_model_message(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))
    G.clear_memory_cache()
    job = calc.Training(micro_batch=1, seq_len=8, recompute="selective", implementation="hf")
    with pytest.raises(NotImplementedError, match="selective"):
        calc.estimate(TINY, job)
    with pytest.raises(NotImplementedError, match="selective"):
        E.grid_peaks(TINY, job, np.array([1]), np.array([8]))
    # the verdict is cached too: read back, not recompiled
    G.clear_memory_cache()
    table, fresh = G.structure_table(TINY, job)
    assert not fresh and "selective" in table.not_modelled


def test_a_size_the_programs_cannot_compute_is_not_modelled(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a plan row says why rather than the whole plan failing
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))
    G.clear_memory_cache()

    def refuse(expr: object) -> tuple:
        raise NotImplementedError("plan_grid cannot evaluate Foo: foo(b)")

    monkeypatch.setattr(G, "to_program", refuse)
    table, _ = G.structure_table(TINY, calc.Training(micro_batch=1, seq_len=8), persist=False)
    assert table.not_modelled == "plan_grid cannot evaluate Foo: foo(b)"
    G.clear_memory_cache()


def test_int64_path_agrees_with_the_float_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peaks beyond 2**53 bytes take the int64 product; force it and compare."""
    job = STRUCTURES[1]
    b, s = np.array([1, 2, 7]), np.array([8, 30, 3])
    fast = E.grid_peaks(TINY, job, b, s).peak_bytes.tolist()
    monkeypatch.setattr(E, "EXACT_FLOAT_LIMIT", 0)
    assert E.grid_peaks(TINY, job, b, s).peak_bytes.tolist() == fast


def test_large_grids_prune_dominated_candidates_without_changing_peaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = STRUCTURES[0]
    b = np.repeat(np.arange(1, 17), 20)  # 16 x 20 = 320 points: above PRUNE_MIN_POINTS
    s = np.tile(np.arange(1, 21), 16)
    assert len(b) >= E.PRUNE_MIN_POINTS
    pruned = E.grid_peaks(TINY, job, b, s).peak_bytes
    monkeypatch.setattr(E, "PRUNE_MIN_POINTS", 10**9)
    assert E.grid_peaks(TINY, job, b, s).peak_bytes.tolist() == pruned.tolist()
    for i in (0, 57, 319):
        one = replace(job, micro_batch=int(b[i]), seq_len=int(s[i]))
        assert int(pruned[i]) == _est(one, "cuda")


def test_polynomial_only_where_rounding_does_nothing() -> None:
    # 512*ceil(b*s*h/128) at h=256: b*s*256/128 = 2*b*s is an integer for every b, s, so the
    # size is exactly 1024*b*s (exponents of b, s, c -> coefficient)
    exact = PP.to_program(512 * sp.ceiling(S.b * S.s * S.h / 128))
    assert E.polynomial(exact, {"h": 256}) == {(1, 1, 0): 1024}
    # 512*ceil(b*s/64) rounds (b*s = 1 gives 512, not 8): not a polynomial
    rounding = PP.to_program(512 * sp.ceiling(S.b * S.s / 64))
    assert E.polynomial(rounding, {}) is None
    assert E.polynomial(PP.to_program(sp.Max(S.b, S.s)), {}) is None


def test_sizes_beyond_int64_are_refused() -> None:
    env = {"b": np.array([2**21]), "s": np.array([1]), "c": np.array([1])}
    with pytest.raises(OverflowError):
        E._check_magnitude((("mono", (3, 0, 0)),), env, env["b"], env["s"], env["c"])  # 2**63
