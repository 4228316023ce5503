"""The report's per-component comparison and the README's generated accuracy section."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from verify.measure.tracker import CATEGORIES
from verify.run.report import CATEGORY_OF, component_summary, components, markdown
from verify.run.runner import Record

ROOT = Path(__file__).resolve().parents[3]


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "accuracy_section", ROOT / "scripts" / "accuracy_section.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


acc = _load_script()


def _record(name: str = "opt-x", **kw) -> Record:
    base = dict(name=name, card="llama-2-7b", impl="reference", kind="training", label="fp32",
                tags=[], tolerance_pct=1.0, device="cpu", status="ok",
                predicted_peak_phase="step1/optimizer", measured_peak_phase="step1/optimizer")  # fmt: skip
    base.update(kw)
    return Record(**base)


# ---------------------------------------------------------------------- category mapping


def test_mapping_covers_every_tracker_category() -> None:
    assert set(CATEGORY_OF.values()) == set(CATEGORIES)


def test_components_on_a_hand_made_record() -> None:
    breakdown = {
        "total": 12_800, "weights": 4096, "weights/layers": 4096, "buffers": 512,
        "gradients": 4096, "gradients/layers": 4096, "optimizer": 2048, "optimizer/exp_avg": 2048,
        "inputs": 512, "activations": 1024, "activations/layers/x": 1024, "temporaries": 512,
        "temporaries/mm": 512,
    }  # fmt: skip
    measured = {"parameters": 4608, "gradients": 4096, "optimizer": 2560, "inputs": 512,
                "activations": 512, "temporaries": 1024}  # fmt: skip
    rec = _record(predicted_breakdown=breakdown, measured_categories=measured,
                  predicted_peak=12_800, measured_peak=13_312, error_pct=-3.846)  # fmt: skip
    c = components(rec)
    assert c["comparable"]
    # weights + buffers -> parameters; the nested keys are not counted twice
    assert c["predicted"] == {"parameters": 4608, "gradients": 4096, "optimizer": 2048,
                              "inputs": 512, "activations": 1024, "temporaries": 512}  # fmt: skip
    assert c["diff"] == {"parameters": 0, "gradients": 0, "optimizer": -512, "inputs": 0,
                         "activations": 512, "temporaries": -512}  # fmt: skip
    assert not c["totals_agree"]
    assert c["unmapped"] == {}
    # the same comparison from the record's JSON form
    assert components(rec.as_dict())["diff"] == c["diff"]


def test_kv_cache_is_compared_as_temporaries_and_cuda_terms_stay_apart() -> None:
    breakdown = {"total": 3584 + 1024, "weights": 2048, "kv_cache": 1024,
                 "kv_cache/layers": 1024, "temporaries": 512, "cuda": 1024,
                 "cuda/cublas_workspace": 1024}  # fmt: skip
    measured = dict.fromkeys(CATEGORIES, 0) | {"parameters": 2048, "temporaries": 1536}
    c = components(_record(kind="inference", predicted_breakdown=breakdown,
                           measured_categories=measured))  # fmt: skip
    assert c["predicted"]["temporaries"] == 1536
    assert c["diff"]["temporaries"] == 0
    assert c["unmapped"] == {"cuda": 1024}
    assert not c["totals_agree"]  # a term the tracker cannot see
    assert any("kv_cache" in x for x in c["caveats"])
    assert any("not seen by the tracker" in x for x in c["caveats"])


def test_reattribution_is_flagged_not_forced() -> None:
    # bf16-master: calc calls the fp32 master gradients gradients, the tracker temporaries
    breakdown = {"total": 3072, "weights": 1024, "gradients": 1536, "temporaries": 512}
    measured = dict.fromkeys(CATEGORIES, 0) | {"parameters": 1024, "gradients": 512,
                                              "temporaries": 1536}  # fmt: skip
    rec = _record("prec-bf16-master-x", job={"precision": "bf16-master"},
                  predicted_breakdown=breakdown, measured_categories=measured, error_pct=0.0)  # fmt: skip
    c = components(rec)
    assert c["totals_agree"]
    assert c["diff"]["gradients"] == 1024 and c["diff"]["temporaries"] == -1024
    assert any("master gradients" in x for x in c["caveats"])
    assert any("not missing" in x for x in c["caveats"])


def test_no_measured_categories_is_not_comparable() -> None:
    c = components(_record(device="cuda", predicted_breakdown={"total": 512, "weights": 512}))
    assert not c["comparable"] and c["diff"] == {}


def test_peaks_in_different_phases_are_flagged() -> None:
    rec = _record(predicted_breakdown={"total": 512, "weights": 512},
                  measured_categories={"parameters": 512},
                  measured_peak_phase="step2/backward")  # fmt: skip
    assert any("different phases" in x for x in components(rec)["caveats"])


def test_component_tables_in_markdown() -> None:
    exact = _record("opt-a", predicted_breakdown={"total": 1024, "weights": 1024},
                    measured_categories={"parameters": 1024}, predicted_peak=1024,
                    measured_peak=1024, error_pct=0.0)  # fmt: skip
    miss = _record("opt-b", predicted_breakdown={"total": 1024, "weights": 512, "inputs": 512},
                   measured_categories={"parameters": 1024, "inputs": 512}, predicted_peak=1024,
                   measured_peak=1536, error_pct=-33.333, status="fail")  # fmt: skip
    rows = {r["category"]: r for r in component_summary([exact, miss])}
    assert rows["parameters"]["compared"] == 2
    assert rows["parameters"]["differ"] == 1 and rows["inputs"]["differ"] == 0
    md = markdown([miss, exact], {"device": "cpu"})
    assert "## Per-component comparison" in md
    assert "#### opt-b (-33.333 %, fail)" in md
    assert "| parameters | 512 | 1,024 | -512 |" in md
    assert "#### opt-a" not in md  # zero error: no per-case table
    # cases are ordered by name within a group, whatever order they ran in
    assert md.index("| opt-a |") < md.index("| opt-b |")


# ---------------------------------------------------------------------- accuracy section


def _case(name: str, impl: str, status: str, err: float | None, message: str = "") -> dict:
    return {"name": name, "impl": impl, "status": status, "error_pct": err, "message": message}


REPORT = {
    "meta": {
        "date": "2026-01-02",
        "device": "cpu",
        "torch": "2.13.0+cpu",
        "transformers": "5.24.0",
    },
    "cases": [
        _case("r1", "reference", "ok", 0.0),
        _case("r2", "reference", "ok", 0.2),
        _case("r3", "reference", "ok", -0.5),
        _case("h1", "hf", "ok", 1.0),
        _case("h2", "hf", "ok", -2.0),
        _case("h3", "hf", "ok", 0.5),
        _case("h4", "hf", "ok", 2.5),
        _case(
            "h5",
            "hf",
            "not-modelled",
            None,
            "not modelled: implementation='hf' for gpt2 is not modelled yet",
        ),
        _case(
            "h6",
            "hf",
            "not-modelled",
            None,
            "not modelled: implementation='hf' for gpt2 is not modelled yet\nmore",
        ),
    ],
}


def test_impl_stats_medians_by_hand() -> None:
    ref = acc.impl_stats(REPORT["cases"], "reference", "cpu")
    # |errors| 0, 0.2, 0.5: median 0.2, max 0.5, within 1 % / 0.3 %
    assert ref["median_abs_error_pct"] == pytest.approx(0.2)
    assert ref["max_abs_error_pct"] == pytest.approx(0.5)
    assert ref["met"]
    hf = acc.impl_stats(REPORT["cases"], "hf", "cpu")
    # |errors| 0.5, 1.0, 2.0, 2.5: median (1.0 + 2.0) / 2 = 1.5 > 1 %
    assert hf["median_abs_error_pct"] == pytest.approx(1.5)
    assert hf["max_abs_error_pct"] == pytest.approx(2.5)
    assert not hf["met"]
    assert hf["counts"]["ok"] == 4 and hf["counts"]["not-modelled"] == 2


def test_section_text() -> None:
    text = acc.section(REPORT)
    assert (
        "| reference | 3 | 3 | 0 | 0.200 % | 0.500 % | every case ≤ 1 %, median ≤ 0.3 % |" in text
    )
    assert "| hf | 6 | 4 | 2 | 1.500 % | 2.500 % | every case ≤ 3 %, median ≤ 1 % |" in text
    assert "**met** (3 compared cases)" in text
    assert "**not met** (4 compared cases; 2 not modelled/runnable" in text
    assert "- implementation='hf' for gpt2 is not modelled yet: h5, h6" in text
    assert "checked against the recorded GPU runs" in text
    assert "![predicted vs measured peak, one point per case]" in text
    assert "(verify/reports/latest/pred_vs_meas.png)" in text
    assert "Beyond their group's bar" not in text  # every case within its group's bar


def test_section_lists_the_cases_beyond_their_groups_bar() -> None:
    # hf's bar is 3 % per case: h7 at -4.2 % (its own tolerance 15 %) is listed, h4 (2.5 %) not
    case = {**_case("h7", "hf", "ok", -4.2), "tolerance_pct": 15.0,
            "predicted_peak": 958, "measured_peak": 1000}  # fmt: skip
    text = acc.section({**REPORT, "cases": [*REPORT["cases"], case]})
    assert "- h7 (hf): -4.200 %, its tolerance 15 %; predicted 958 B, measured 1,000 B" in text
    assert "- h4 " not in text


README = """# project

intro

## Install

pip install it

## How accurate is it?

_To be written._

### old sub-heading

old text

## Hand check

numbers stay

## Last
"""


def test_replace_section_only_touches_that_section() -> None:
    new = acc.replace_section(README, "NEW BODY\n")
    assert new == README.replace(
        "_To be written._\n\n### old sub-heading\n\nold text\n", "NEW BODY\n"
    )
    assert acc.replace_section(new, "NEW BODY\n") == new  # idempotent


def test_replace_section_at_the_end_and_missing_heading() -> None:
    text = "# p\n\n## How accurate is it?\n\nold\n"
    assert acc.replace_section(text, "body") == "# p\n\n## How accurate is it?\n\nbody\n"
    with pytest.raises(ValueError):
        acc.replace_section("# p\n\n## Other\n", "body")


def test_write_option(tmp_path) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps(REPORT), encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(README, encoding="utf-8")
    assert acc.main(["--report", str(report), "--write", str(readme)]) == 0
    out = readme.read_text(encoding="utf-8")
    assert out.startswith(README.split("## How accurate is it?")[0])
    assert out.endswith("## Hand check\n\nnumbers stay\n\n## Last\n")
    assert acc.section(REPORT).strip() in out
    assert "old text" not in out


# ---------------------------------------------------------------------- committable reports


def test_scrub_removes_machine_paths() -> None:
    from verify.run.report import REPO_ROOT, scrub

    msg = (
        f'File "{REPO_ROOT}/calc/replay/ops.py", line 3\n'
        'File "/opt/py/lib/python3.11/site-packages/torch/nn/modules/module.py", line 9'
    )
    out = scrub(msg)
    assert str(REPO_ROOT) not in out and "/opt/py" not in out
    assert 'File "calc/replay/ops.py"' in out
    assert 'File "<site-packages>/torch/nn/modules/module.py"' in out


def test_reports_are_byte_identical_across_writes(tmp_path) -> None:
    from verify.run.report import write_report

    recs = [
        _record("opt-b", predicted_breakdown={"total": 1024, "weights": 1024},
                measured_categories={"parameters": 1024}, predicted_peak=1024,
                measured_peak=1024, error_pct=0.0, seconds=1.5),
        _record("opt-a", predicted_breakdown={"total": 2048, "weights": 2048},
                measured_categories={"parameters": 2560}, predicted_peak=2048,
                measured_peak=2560, error_pct=-20.0, status="fail", seconds=2.5),
    ]  # fmt: skip
    meta = {"date": "2026-01-02", "device": "cpu"}
    first = [p.read_bytes() for p in write_report(recs, tmp_path / "a", meta)]
    recs[0].seconds, recs[1].seconds = 9.0, 7.0  # wall time never reaches the files
    second = [p.read_bytes() for p in write_report(recs[::-1], tmp_path / "b", meta)]
    assert first == second
    data = json.loads(first[0])
    assert [c["name"] for c in data["cases"]] == ["opt-a", "opt-b"]
    assert "seconds" not in data["cases"][0]
    assert data["cases"][0]["components"]["diff"]["parameters"] == -512


def test_filtered_run_does_not_overwrite_the_full_report(tmp_path, monkeypatch) -> None:
    from verify.__main__ import main
    from verify.run import report

    monkeypatch.setattr(report, "DEFAULT_OUT", tmp_path / "latest")
    monkeypatch.setattr(report, "SUBSET_OUT", tmp_path / "subset")
    main(["--cases", "opt-sgd-foreach", "--no-progress"])
    assert (tmp_path / "subset" / "report.json").exists()
    assert not (tmp_path / "latest").exists()
