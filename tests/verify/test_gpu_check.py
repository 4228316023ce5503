"""`verify.gpu_check` and scripts/gpu_check.sh up to the CUDA calls, on the CPU.

Synthetic measurement files are written to pytest's tmp_path only (marked ``"synthetic":
true``), never to verify/measurements/. Their measured values are chosen by hand to land inside
or outside a tolerance, not taken from calc.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from verify import gpu_check as G
from verify.cases.single import select

ROOT = Path(__file__).resolve().parents[2]


def test_selection_names_existing_cases_and_covers_every_category() -> None:
    names = {c.name for c in select(impl="all", substring=None, quick=False)}
    assert set(G.CASES) <= names and set(G.FULL_CASES) <= names
    for category, fragments in G.CATEGORIES.items():
        assert any(f in n for n in G.CASES for f in fragments), category


def _record(name: str, **kw: object) -> dict:
    case = select(impl="all", substring=name, quick=False)[0]
    rec = {
        "name": case.name, "device": "cuda", "status": "ok", "kind": case.kind,
        "spec": asdict(case.spec()),
        "job": {k: getattr(case.job, k) for k in case.job.__slots__},
        "tolerance_pct": 1e9, "measured_peak": 1 << 30,
    }  # fmt: skip
    rec.update(kw)
    return rec


def _report(recs: list[dict], stat_peaks: dict | None = None) -> dict:
    extra = {"stat_peaks": stat_peaks or {}, "mem_get_info": [1, 2], "torch": "2.13.0+cu130",
             "cuda": "13.0", "capability": [9, 0]}  # fmt: skip
    return {"meta": {"date": "2026-12-04", "torch": "2.13.0+cu130"},
            "cases": [{**r, "extra": extra} for r in recs]}  # fmt: skip


def test_merge_writes_the_schema_from_both_runs() -> None:
    peaks = {"allocated_bytes": 5, "reserved_bytes": 7}
    data = G.merge(
        _report([_record("prec-bf16-llama")], peaks), _report([_record("prec-bf16-llama")], peaks),
        "NVIDIA H200, 570.86.15, 143771 MiB", synthetic=True,
    )  # fmt: skip
    assert data["schema"] == G.SCHEMA and data["synthetic"] is True
    assert (data["gpu"], data["driver"], data["memory_total_mib"]) == (
        "NVIDIA H200",
        "570.86.15",
        143771,
    )
    assert (data["torch"], data["cuda"], data["capability"], data["date"]) == (
        "2.13.0+cu130", "13.0", [9, 0], "2026-12-04",
    )  # fmt: skip
    assert [c["alloc"] for c in data["cases"]] == ["default", "expandable"]
    assert data["cases"][0]["reserved_peak"] == 7 and data["cases"][0]["mem_get_info"] == [1, 2]
    assert G.file_name(data) == "nvidia-h200-2026-12-04.json"
    with pytest.raises(ValueError, match="nvidia-smi"):
        G.merge(_report([]), _report([]), "NVIDIA H200")


def _write(tmp_path: Path, cases: list[dict], **top: object) -> Path:
    data = {"schema": G.SCHEMA, "synthetic": True, "gpu": "NVIDIA H200", "driver": "x",
            "torch": "2.13.0", "date": "2026-12-04", "cases": cases, **top}  # fmt: skip
    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps(data))
    return path


def test_check_file_accepts_within_tolerance_and_flags_outside(tmp_path: Path) -> None:
    ok = [_record("prec-bf16-llama", alloc=a) for a in ("default", "expandable")]
    assert G.check_file(_write(tmp_path, ok)) == []
    # 1 byte measured with a 1 % tolerance: any prediction is far off; reserved likewise
    off = _record("prec-bf16-llama", alloc="expandable", tolerance_pct=1.0, measured_peak=1)
    problems = G.check_file(_write(tmp_path, [off]))
    assert len(problems) == 1 and "allocated" in problems[0]
    off_reserved = _record("prec-bf16-llama", alloc="default", reserved_peak=1)
    problems = G.check_file(_write(tmp_path, [off_reserved]))
    assert len(problems) == 1 and "reserved" in problems[0]
    skipped = _record("prec-bf16-llama", status="oom", measured_peak=1, tolerance_pct=0.0)
    assert G.check_file(_write(tmp_path, [skipped])) == []


def test_check_file_names_missing_schema_fields(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"gpu": "x", "cases": []}))
    assert G.check_file(path) == ["bad.json: missing driver, torch, date"]


def test_cases_command_prints_the_selection(capsys: pytest.CaptureFixture[str]) -> None:
    assert G.main(["cases"]) == 0
    assert capsys.readouterr().out.strip().split(",") == list(G.CASES)
    assert G.main(["cases", "--full"]) == 0
    assert capsys.readouterr().out.strip().split(",") == list(G.FULL_CASES)


def test_merge_command_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("d.json", "e.json", "f.json"):
        (tmp_path / name).write_text(json.dumps(_report([_record("prec-bf16-llama")])))
    (tmp_path / "probe.json").write_text(json.dumps({"schema": "vramplan-gpu-probe/1"}))
    dest = tmp_path / "out"
    argv = ["merge", "NVIDIA A100-SXM4-80GB, 550.54, 81920 MiB", str(dest),
            "--default", str(tmp_path / "d.json"), str(tmp_path / "f.json"),
            "--expandable", str(tmp_path / "e.json"), str(tmp_path / "missing.json"),
            "--probe", str(tmp_path / "probe.json")]  # fmt: skip
    assert G.main(argv) == 0
    out, err = capsys.readouterr()
    written = Path(out.strip())
    assert written == dest / "nvidia-a100-sxm4-80gb-2026-12-04.json"
    data = json.loads(written.read_text())
    assert data["memory_total_mib"] == 81920
    # two default reports and one expandable (the missing one is named, not fatal)
    assert [c["alloc"] for c in data["cases"]] == ["default", "default", "expandable"]
    assert "missing.json is missing" in err
    assert data["outside"] == {"schema": "vramplan-gpu-probe/1"}


def test_merge_command_fails_when_nothing_was_recorded(tmp_path: Path) -> None:
    argv = ["merge", "NVIDIA H200, 1, 143771 MiB", str(tmp_path),
            "--default", str(tmp_path / "a.json"), "--expandable", str(tmp_path / "b.json")]  # fmt: skip
    assert G.main(argv) == 1
    assert not list(tmp_path.glob("*.json"))


def test_script_dry_run_probes_then_runs_both_allocator_settings_then_merges() -> None:
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], capture_output=True, text=True, cwd=ROOT,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "verify.gpu_probe" in lines[0]
    runs = lines[1:5]
    assert ["--cuda-alloc default" in r for r in runs] == [True, False, True, False]
    assert all("--device cuda" in r for r in runs)
    assert all(",".join(G.CASES) in r for r in runs[:2])
    assert all(",".join(G.FULL_CASES) in r for r in runs[2:])
    assert "verify.gpu_check merge" in lines[5] and "verify/measurements" in lines[5]
    assert "--probe" in lines[5]


def test_derived_selection_names_existing_cases_one_group_per_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = {c.name for c in select(impl="all", substring=None, quick=False)}
    for group in G.DERIVED_GROUPS:  # every fragment selects at least one case
        assert all(any(f in n for n in names) for f in group), group
    assert G.main(["cases", "--set", "derived", "--groups"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(",") for line in lines] == [list(g) for g in G.DERIVED_GROUPS]
    assert G.main(["cases", "--set", "derived", "--full"]) == 0
    assert capsys.readouterr().out.strip().split(",") == list(G.DERIVED_GROUPS[-1])


def test_a_case_measured_without_prediction_is_predicted_when_checked(tmp_path: Path) -> None:
    # status "measured" (python -m verify --measure-only): check_record predicts it here; a
    # measurement of 1 GiB against a tolerance of 1 % is far from a tiny model's estimate
    rec = _record("prec-bf16-llama", status="measured", tolerance_pct=1.0, alloc="expandable")
    problems = G.check_record(rec)
    assert len(problems) == 1 and "allocated" in problems[0]
    assert G.check_record({**rec, "status": "error"}) == []


def test_a_recorded_sampling_job_is_rebuilt_as_calc_sampling() -> None:
    rec = _record("gen-sample-llama-fp32-decode")
    rec["job"]["sampling"] = asdict(rec["job"]["sampling"])  # as JSON holds it
    job = G.job_from_record(rec)
    assert isinstance(job.sampling, G.Sampling) and job.sampling.top_k == 50


def test_merge_names_the_file_with_the_selection_suffix(tmp_path: Path) -> None:
    data = {"gpu": "NVIDIA H200", "date": "2026-12-04"}
    assert G.file_name(data) == "nvidia-h200-2026-12-04.json"
    assert G.file_name(data, "derived") == "nvidia-h200-2026-12-04-derived.json"


def test_script_dry_run_of_the_derived_set_measures_only_without_probe() -> None:
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--set", "derived"], capture_output=True,
        text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert not any("verify.gpu_probe" in line for line in lines)
    runs = [line for line in lines if "-m verify " in line]
    assert len(runs) == 2 * len(G.DERIVED_GROUPS)
    assert all("--measure-only" in r and "--device cuda" in r for r in runs)
    assert "--suffix derived" in lines[-1]


def test_script_refuses_an_unknown_argument() -> None:
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--bogus"], capture_output=True, text=True, cwd=ROOT,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "unknown argument --bogus" in proc.stderr
