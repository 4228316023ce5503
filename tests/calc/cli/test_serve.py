"""`python -m calc serve`: vLLM's flags reach `calc.Serving`, the JSON is `calc.serve`'s answer,
bad input exits 2 naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import calc
from calc.cli.main import main
from tests.specs import TINY_CONFIG


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


def test_json_is_calc_serve_with_the_flags_mapped(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--config", str(config), "--total-gib", "2", "--vllm-version", "0.10.1",
            "--dtype", "half", "--kv-cache-dtype", "fp8", "-q", "awq", "--max-model-len", "64",
            "--max-num-seqs", "8", "--block-size", "32", "--enforce-eager", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    serving = calc.Serving(
        vllm_version="0.10.1", dtype="fp16", kv_cache_dtype="fp8", quant="w4a16",
        max_model_len=64, max_num_seqs=8, block_size=32, enforce_eager=True,
    )  # fmt: skip
    model = calc.ModelSpec.from_hf_config(TINY_CONFIG)  # what --config reads
    want = calc.serve(model, serving, total_bytes=2 * 2**30)
    assert out["kv_cache_tokens"] == want.kv_cache_tokens
    assert out["weights_bytes"] == want.weights_bytes
    assert out["serving"]["quant"] == "w4a16" and out["serving"]["dtype"] == "fp16"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization=1.5"),
        (["--dtype", "int4"], "dtype='int4'"),
        (["--quantization", "bnb"], "quantization='bnb'"),
        (["--block-size", "7"], "block_size=7"),
    ],
)
def test_bad_flags_exit_2_naming_the_field(
    config: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["serve", "--config", str(config), "--total-gib", "2", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_gpu_or_a_total_is_required(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(config)]) == 2
    assert "--gpu" in capsys.readouterr().err


def test_card_of_a_moe_family_with_expert_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    # --card reads the card's config.json (Mixtral is no calc.ModelSpec type); the flags reach
    # calc.Serving, expert parallelism included
    argv = ["serve", "--card", "mixtral-8x7b", "--gpu", "h100-80gb", "-tp", "2",
            "--enable-expert-parallel", "--max-model-len", "8192", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    serving = calc.Serving(tensor_parallel=2, expert_parallel=True, max_model_len=8192)
    want = calc.serve(calc.load_card_config("mixtral-8x7b"), serving, gpu="h100-80gb")
    assert out["serving"]["expert_parallel"] is True
    assert out["kv_cache_tokens"] == want.kv_cache_tokens
    assert out["weights_bytes"] == want.weights_bytes


def test_config_of_a_hybrid_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(calc.load_card_config("gemma-3-1b-it")))
    assert main(["serve", "--config", str(path), "--total-gib", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_cache_groups"] == 7  # 4 full + 22 sliding layers in groups of 4


def test_the_log_says_whether_vllm_starts(capsys: pytest.CaptureFixture[str]) -> None:
    # Mixtral-8x7B: 46.7 B parameters (Mistral AI's model card) are 87 GiB in bf16, more than
    # the 79.11 GiB an H100 80GB reports to cudaMemGetInfo
    assert main(["serve", "--card", "mixtral-8x7b", "--gpu", "h100-80gb"]) == 0
    assert "vLLM does not start: CUDA out of memory while loading" in capsys.readouterr().out
    assert main(["serve", "--card", "mixtral-8x7b", "--gpu", "h100-80gb", "-tp", "2"]) == 0
    assert "\nvLLM starts\n" in capsys.readouterr().out


def test_a_context_too_long_gets_the_longest_that_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["serve", "--card", "qwen3-32b", "--gpu", "h100-80gb", "--max-model-len", "40960"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    longest = next(line for line in lines if line.startswith("the largest max_model_len"))
    length = int(longest.split(": ")[1].split()[0].replace(",", ""))
    assert 0 < length < 40960
    for max_len, starts in ((length, True), (length + 1, False)):  # the boundary is exact
        assert main([*argv[:-1], str(max_len)]) == 0
        assert ("\nvLLM starts\n" in capsys.readouterr().out) is starts
