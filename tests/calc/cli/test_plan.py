"""`python -m calc plan`: arguments reach `calc.plan`, output is parseable, bad input exits 2.

A tiny llama config (h=16, L=2, a=k=2, f=24, V=50) keeps the compiles short.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calc.cli.main import main
from calc.plan import grid as plan_grid
from tests.specs import TINY_CONFIG


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path / "cache"))
    plan_grid.clear_memory_cache()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


def test_plan_json(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "plan", "--config", str(config), "--seq-len", "8", "--global-batch", "2",
        "--gpu", "t4-16gb", "--fix", "precision=bf16,fp32", "--fix", "optimizer=sgd",
        "--fix", "recompute=none", "--json", "--no-error-bars", "--workers", "2",
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    # 2 precisions x 1 optimizer x 1 recompute x micro-batches {1, 2} = 4 configurations
    assert out["n_configurations"] == 4
    assert len(out["fitting"]) == 4  # a 2-layer toy fits in a T4
    for row in out["fitting"]:
        assert row["peak_bytes"] <= out["usable_bytes"]
        assert row["choices"]["micro_batch"] * row["grad_accum"] == 2


def test_plan_table_with_least_hardware_and_changes(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([
        "plan", "--config", str(config), "--seq-len", "8", "--global-batch", "2",
        "--fix", "precision=bf16", "--fix", "optimizer=sgd", "--fix", "recompute=none",
        "--least-hardware", "--what-to-change", "micro_batch=2", "--no-error-bars",
        "--workers", "1",
    ])  # fmt: skip
    assert code == 0
    assert capsys.readouterr().out  # a table was printed


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--fix", "zero_stage=3"], "zero_stage"),
        (["--fix", "micro_batch=two"], "micro_batch"),
        (["--gpu", "h300"], "gpu"),
        (["--task", "pretraining"], "task"),
        (["--global-batch", "3", "--gpus", "2"], "global_batch"),
    ],
)
def test_bad_input_exits_2_naming_the_field(
    config: Path, capsys: pytest.CaptureFixture[str], args: list[str], match: str
) -> None:
    narrow = ["--fix", "precision=bf16", "--fix", "optimizer=sgd", "--fix", "recompute=none"]
    argv = ["plan", "--config", str(config), "--seq-len", "8", *args]
    if "--fix" not in args:
        argv += narrow
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


def test_plan_on_two_gpus_fixes_a_layout(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "plan", "--config", str(config), "--seq-len", "8", "--global-batch", "4", "--gpus", "2",
        "--fix", "parallel=dp2-zero3,tp2", "--fix", "precision=bf16", "--fix", "optimizer=sgd",
        "--fix", "recompute=none", "--json", "--no-error-bars", "--workers", "1",
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    # 2 layouts x micro-batches {1, 2}; dp2: grad_accum 4 / (2 x mb), tp2 (dp 1): 4 / mb
    assert out["n_configurations"] == 4 and len(out["fitting"]) == 4  # a toy fits a T4
    for row in out["fitting"]:
        dp = 2 if row["choices"]["parallel"] == "dp2-zero3" else 1
        assert dp * row["choices"]["micro_batch"] * row["grad_accum"] == 4
        # tensor parallelism is replayed for the reference modeling code only
        want = "reference" if dp == 1 else "hf"
        assert row["choices"]["implementation"] == want


def test_two_gpu_workers_precompile_rank_tables(
    config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import calc
    from calc.cli import plan as plan_cli
    from calc.config.parallelism import Parallelism

    compiled: list[tuple[int, int]] = []
    real = plan_cli.P.precompile

    def recording(*args: object, **kw: object) -> int:
        done = real(*args, **kw)  # type: ignore[arg-type]
        compiled.append((kw["gpu_count"], done))  # type: ignore[arg-type]
        return done

    monkeypatch.setattr(plan_cli.P, "precompile", recording)

    argv = [
        "plan", "--config", str(config), "--seq-len", "8", "--global-batch", "4", "--gpus", "2",
        "--fix", "parallel=dp2-zero0,dp2-zero2", "--fix", "precision=bf16", "--fix",
        "optimizer=adamw", "--fix", "recompute=none", "--json", "--no-error-bars",
    ]  # fmt: skip
    # two workers compile the rank-class tables before the plan: the plan compiles nothing
    assert main([*argv, "--workers", "2"]) == 0
    # DDP and ZeRO-2 (one class of ranks each), grad_accum 1 and >= 2: 4 tables
    assert compiled == [(2, 4)]
    first = json.loads(capsys.readouterr().out)
    plan_grid.clear_memory_cache()
    from calc.plan import planner as P

    model = calc.ModelSpec.from_hf_config(TINY_CONFIG, name="tiny")
    p = P.plan(model, task="full-finetune", seq_len=8, global_batch=4, gpu="t4-16gb",
               gpu_count=2, fixed={"parallel": ("dp2-zero0", "dp2-zero2"),
                                   "precision": ("bf16",), "optimizer": ("adamw",),
                                   "recompute": ("none",)}, error_bars=False)  # fmt: skip
    assert p.compiled_now == 0 and p.n_configurations == first["n_configurations"] == 4
    for row in first["fitting"]:
        zero = 2 if row["choices"]["parallel"] == "dp2-zero2" else 0
        job = calc.Training(micro_batch=row["choices"]["micro_batch"], seq_len=8,
                            grad_accum=row["grad_accum"], precision="bf16", optimizer="adamw",
                            recompute="none")  # fmt: skip
        want = calc.estimate(model, job, Parallelism(dp=2, zero=zero)).peak_bytes
        assert row["peak_bytes"] == want
