"""calc.present.sweep (the sweep charts' data) and calc.present.display (the rows the web pages draw), on hand
values: a hand-made breakdown tree, hand-counted powers of two, a hand-written report, peaks the
CPU tracker measured."""

from __future__ import annotations

import pytest
import sympy as sp

import calc
from calc import symbols as S
from calc.present import display
from calc.present.sweep import doubling_values, sweep
from tests.specs import recorded

GIB = 2**30


def _estimate(tree: dict[str, int], phases: dict[str, int], peak_phase: str) -> calc.Estimate:
    expr = S.b * S.s * 512 + S.h * 1024
    return calc.Estimate(
        peak_bytes=tree["total"],
        peak_phase=peak_phase,
        peak_event="x",
        breakdown_fn=lambda: tree,
        phases=phases,
        expression_fn=lambda: expr,
        peak_expression_fn=lambda: expr,
        values={S.b: 2, S.s: 8, S.h: 16},
        device="cuda",
    )


# 3 GiB at the peak: weights 2 GiB (layers 1.5, head 0.5) and inputs 1 GiB (a leaf at depth 0).
TREE = {
    "total": 3 * GIB,
    "weights": 2 * GIB,
    "weights/layers": 3 * GIB // 2,
    "weights/head": GIB // 2,
    "inputs": GIB,
}


def test_breakdown_rows_are_the_tree_in_gib_with_shares() -> None:
    rows = display.breakdown_rows(_estimate(TREE, {"fwd": 3 * GIB}, "fwd"))
    got = [(r["component"], r["depth"], r["gib"], round(r["share_pct"], 2)) for r in rows]
    assert got == [
        ("weights", 0, 2.0, 66.67),  # 2 / 3
        ("weights/layers", 1, 1.5, 50.0),
        ("weights/head", 1, 0.5, 16.67),
        ("inputs", 0, 1.0, 33.33),
        ("total", 0, 3.0, 100.0),
    ]
    assert rows[1]["label"] == "\u2003layers"


def test_stacked_levels_carry_leaves_down_so_every_bar_is_the_peak() -> None:
    rows = display.stacked_levels(_estimate(TREE, {"fwd": 3 * GIB}, "fwd"))
    by_level: dict[str, list[tuple[str, float]]] = {}
    for r in rows:
        by_level.setdefault(r["level"], []).append((r["component"], r["gib"]))
    assert by_level == {
        "level 1": [("weights", 2.0), ("inputs", 1.0)],
        "level 2": [("weights/layers", 1.5), ("weights/head", 0.5), ("inputs", 1.0)],
    }


def test_phase_rows_keep_step_order_and_mark_the_peak() -> None:
    phases = {"step1/forward": GIB, "step1/backward": 3 * GIB, "step1/optimizer": 2 * GIB}
    rows = display.phase_rows(_estimate(TREE, phases, "step1/backward"))
    assert [(r["phase"], r["gib"], r["is_peak"]) for r in rows] == [
        ("step1/forward", 1.0, False),
        ("step1/backward", 3.0, True),
        ("step1/optimizer", 2.0, False),
    ]


def test_symbol_rows_list_the_formulas_symbols_with_values_in_symbol_order() -> None:
    rows = display.symbol_rows(_estimate(TREE, {"fwd": 1}, "fwd"))
    assert [(r["symbol"], r["value"]) for r in rows] == [("b", 2), ("s", 8), ("h", 16)]
    assert rows[0]["meaning"] == S.DESCRIPTIONS[S.b]


def test_symbol_rows_of_an_inference_job_call_b_the_batch_and_s_the_prompt() -> None:
    rows = display.symbol_rows(_estimate(TREE, {"fwd": 1}, "fwd"), inference=True)
    meaning = {r["symbol"]: r["meaning"] for r in rows}
    assert "micro-batch" not in meaning["b"] and "batch" in meaning["b"]
    assert "prompt" in meaning["s"]
    assert meaning["h"] == S.DESCRIPTIONS[S.h]


def test_latex_lines_breaks_a_sum_every_n_terms() -> None:
    x = sp.symbols("x1:6")
    text = display.latex_lines(sum(x), terms_per_line=2)  # 5 terms: 2 + 2 + 1
    assert text.startswith("\\begin{aligned}") and text.endswith("\\end{aligned}")
    assert text.count("\\\\") == 2
    assert display.latex_lines(x[0] + x[1], terms_per_line=4) == "x_{1} + x_{2}"
    with pytest.raises(ValueError, match="terms_per_line"):
        display.latex_lines(x[0], terms_per_line=0)


def test_evidence_rows_are_the_report_in_mib() -> None:
    report = {
        "cases": [
            {"name": "a", "impl": "hf", "kind": "training", "card": "gpt2", "status": "ok",
             "predicted_peak": 3 * 2**20, "measured_peak": 2 * 2**20, "error_pct": 50.0,
             "tolerance_pct": 3.0, "measured_peak_phase": "step1/backward"},
            {"name": "b", "impl": "hf", "kind": "inference", "card": "gpt2",
             "status": "not-modelled", "predicted_peak": None, "measured_peak": 2**19,
             "error_pct": None},
        ]
    }  # fmt: skip
    rows = display.evidence_rows(report)
    assert (rows[0]["predicted_mib"], rows[0]["measured_mib"], rows[0]["error_pct"]) == (3, 2, 50)
    assert (rows[1]["predicted_mib"], rows[1]["measured_mib"]) == (None, 0.5)


# ----------------------------------------------------------------------------- sweep


def test_doubling_values_window_around_the_current_value() -> None:
    # 2**0 .. 2**20 are 21 powers; 11 of them are below 2048; a window of 9 centred there
    # starts at index 11 - 4 = 7 (2**7 = 128) and ends at 2**15.
    assert doubling_values(2048, high=1 << 20, points=9) == [2**i for i in range(7, 16)]
    # 1, 2, 4, 8 all fit in 12 points; 3 is added.
    assert doubling_values(3, high=8, points=12) == [1, 2, 3, 4, 8]
    # at the top of the range the window slides down: the last 3 powers up to 2**4
    assert doubling_values(16, high=16, points=3) == [4, 8, 16]
    with pytest.raises(ValueError, match="points"):
        doubling_values(1, points=0)


def test_sweep_points_are_the_measured_peaks_and_bad_points_are_reported() -> None:
    # expected values measured, not computed: two verify cases on the same scaled llama-2
    # (reference, fp32, AdamW), whose peaks the CPU tracker recorded in verify/reports/latest
    model, short, short_peak = recorded("size-b1-s16-llama")  # micro_batch 1, seq_len 16
    _, long, long_peak = recorded("size-b4-s64-llama")  # micro_batch 4, seq_len 64
    by_seq = sweep(model, short, "seq_len", [0, 64, 16, 32], device="cpu")
    assert by_seq.values == (0, 16, 32, 64)
    assert by_seq.peak_bytes[0] is None
    assert len(by_seq.errors) == 1 and "seq_len=0" in by_seq.errors[0]
    assert by_seq.peak_bytes[1] == short_peak
    by_batch = sweep(model, long, "micro_batch", [1, 2, 4], device="cpu")
    assert by_batch.peak_bytes[2] == long_peak
    for result in (by_seq, by_batch):  # longer or wider never smaller
        assert list(result.peak_bytes[1:]) == sorted(result.peak_bytes[1:])


def test_inference_context_sweep_shortens_a_longer_prompt() -> None:
    model = calc.load_card("qwen2.5-0.5b")
    job = calc.Inference(batch=1, context=4096, prompt=1024)
    result = sweep(model, job, "context", [512, 4096])
    small = calc.estimate(model, calc.Inference(batch=1, context=512, prompt=512))
    assert result.peak_bytes[0] == small.peak_bytes
    assert result.errors == ()


def test_sweep_refuses_a_field_that_is_not_a_size_of_the_job() -> None:
    model = calc.load_card("gpt2")
    with pytest.raises(ValueError, match="not one of"):
        sweep(model, calc.Training(micro_batch=1, seq_len=8), "context", [1, 2])
    with pytest.raises(ValueError, match="at most"):
        sweep(model, calc.Inference(batch=1, context=8), "batch", list(range(1, 100)))
