"""The CLI's parallelism options: they build a calc.Parallelism, the output names the
most-loaded rank, and bad values exit 2 with one line naming the field."""

from __future__ import annotations

import json

import pytest

from tests.calc.cli.test_main import run_cli

TINY = ["--card", "qwen2.5-0.5b", "--seq-len", "64", "--implementation", "reference"]


def test_fsdp_names_the_most_loaded_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli([*TINY, "--dp", "2", "--zero", "3"], capsys)
    assert code == 0
    assert "parallel: dp=2, zero=3 (2 GPUs)" in out
    assert "the most-loaded GPU is rank 0 of 2" in out
    assert "ranks/" not in out  # per-rank peaks are not rows of the breakdown table


def test_json_has_the_layout_and_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli([*TINY, "--dp", "4", "--gradient-as-bucket-view", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["parallel"]["dp"] == 4 and data["parallel"]["gradient_as_bucket_view"]
    assert sorted(data["rank_peaks"]) == ["0", "1", "2", "3"]
    assert data["peak_bytes"] == max(data["rank_peaks"].values())
    assert data["breakdown"]["ddp/gradient_buckets"] > 0


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--zero", "5"], "zero=5"),
        (["--dp", "0"], "dp=0"),
        (["--tp", "3"], "n_heads=14"),
        (["--offload", "nvme"], "offload='nvme'"),
        (["--fsdp", "--zero", "1"], "fsdp"),
    ],
)
def test_bad_parallel_options_exit_2(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli([*TINY, *extra], capsys)
    assert code == 2
    assert out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_inference_takes_no_parallel_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["--card", "qwen2.5-0.5b", "--task", "infer", "--dp", "2"], capsys)
    assert code == 2
    assert "--dp" in err
