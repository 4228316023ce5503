"""``python -m calc`` with pruning and distillation options: the options reach the configs, bad
input exits 2 naming the option, and the pruned-storage numbers are the ones derived here.

GPT-2 (h=768, f=3072, 12 layers), inference in bf16 (2 B): the prunable linears of one layer are
c_attn 3*768*768 = 1,769,472, attn.c_proj 589,824, c_fc and mlp.c_proj 2,359,296 each:
7,077,888 elements = 14,155,776 B per layer (every tensor a multiple of 512 B), 169,869,312 B
for 12 layers. Each tensor has an even size, so amount 0.5 leaves exactly half: density 1/2.
"""

from __future__ import annotations

import json

import pytest

from calc.cli import main as cli

GPT2_PRUNABLE_BF16 = 169_869_312  # module docstring


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_prune_storage_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(
        capsys, "--card", "gpt2", "--task", "infer", "--implementation", "reference",
        "--prune", "unstructured",
    )  # fmt: skip
    st = out["pruned_storage"]
    assert st["dense_bytes"] == GPT2_PRUNABLE_BF16
    assert st["density"] == 0.5
    # CSR at density 1/2 with int64 indices: 0.5 * (2 + 8) = 5 B per element > 2: dense wins.
    assert st["best"] == "dense"
    # bf16, int64 CSR: 10*nnz + 8*(rows+1) < 2*rows*cols -> density just below 1/5.
    assert 0.19 < st["break_even_density"]["csr"] <= 0.2


def test_prune_reaches_the_training_job(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(
        capsys, "--card", "gpt2", "--implementation", "reference", "--precision", "fp32",
        "--dropout", "0", "--prune", "2:4", "--prune-modules", "fc,proj", "--seq-len", "64",
    )  # fmt: skip
    assert out["job"]["pruning"] == {
        "kind": "2:4", "amount": 0.5, "modules": ["fc", "proj"], "removed": False,
    }  # fmt: skip
    assert out["breakdown"]["pruning/weight_mask"] == 12 * 2 * 3072 * 768 * 4


def test_structured_pruning_shrinks_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3.1-8B keeping 16 of 32 query heads, 4 of 8 KV heads, 24 of 32 layers: per layer
    # q/o lose 16*128*4096 each and k/v 4*128*4096 each: 20,971,520 params fewer per layer.
    full = _json(capsys, "--card", "llama-3.1-8b")["n_params"]
    small = _json(
        capsys, "--card", "llama-3.1-8b", "--keep-heads", "16", "--keep-kv-heads", "4",
        "--keep-layers", "24",
    )["n_params"]  # fmt: skip
    per_layer_full = (full - 2 * 128256 * 4096 - 4096) // 32
    assert small == full - 8 * per_layer_full - 24 * 20_971_520


def test_teacher_reaches_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(
        capsys, "--card", "llama-2-7b", "--implementation", "reference", "--precision", "bf16",
        "--teacher", "llama-2-13b", "--distill-temperature", "2", "--seq-len", "128",
    )  # fmt: skip
    assert out["job"]["distill"]["temperature"] == 2
    assert out["job"]["distill"]["teacher"]["name"] == "llama-2-13b"
    assert out["breakdown"]["teacher/weights"] >= 13_015_864_320 * 2  # published count, bf16


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prune-amount", "0.3"], "need --prune"),
        (["--prune", "random"], "kind="),
        (["--prune", "unstructured", "--prune-amount", "2"], "amount="),
        (["--keep-heads", "7"], "n_heads=7"),
        (["--task", "infer", "--teacher", "gpt2"], "--teacher"),
        (["--distill-temperature", "2"], "need --teacher"),
        (["--teacher", "qwen2.5-32b", "--teacher-quant", "int3"], "method="),
        (["--teacher", "gpt2", "--implementation", "reference"], "vocab"),
        (["--prune", "unstructured", "--sparse-index", "int16"], "sparse_index"),
    ],
)
def test_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err
