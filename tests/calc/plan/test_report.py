"""`calc.plan.report` and ``python -m calc report``: the search grid, the search, the CLI."""

import json

import pytest

import calc
from calc.cli import main as cli
from calc.plan import report

CARD = "qwen2.5-0.5b"


@pytest.mark.parametrize(
    ("task", "width", "count"),
    [
        ("serve", "bf16", 3),  # bf16 weights x KV {bf16, int8, fp8}
        ("serve", "int8", 6),  # {int8 per-row, fp8 per-row} x 3 KV formats
        ("serve", "int4", 6),  # {int4 g128, nf4} x 3 KV formats
        ("lora", "bf16", 4),  # {adamw, adam8bit} x recompute {none, full}
        ("lora", "int8", 0),  # a quantized base is QLoRA
        ("qlora", "bf16", 0),  # a bf16 base is LoRA
        ("qlora", "int8", 8),  # {int8, fp8} x 2 optimizers x 2 recomputes
        ("qlora", "int4", 8),
        ("full", "bf16", 8),  # {bf16, bf16-master} x 2 x 2
        ("full", "int4", 0),  # quantized weights are not trained
    ],
)
def test_grid(task, width, count):
    jobs = report.candidates(task, width, batch=1, seq_len=4096, lora_rank=16)
    assert len(jobs) == count
    assert len(set(jobs)) == count  # no recipe twice
    for job in jobs:
        assert job.implementation == "reference"
        if task in ("lora", "qlora"):
            assert job.lora is not None and job.lora.rank == 16
        if task == "qlora":
            assert job.quant is not None


def test_bad_cell_names_the_field():
    with pytest.raises(ValueError, match="task"):
        report.candidates("prune", "bf16", batch=1, seq_len=8, lora_rank=8)
    with pytest.raises(ValueError, match="width"):
        report.candidates("serve", "int3", batch=1, seq_len=8, lora_rank=8)
    with pytest.raises(ValueError, match="seq_len"):
        report.report(calc.load_card(CARD), seq_len=0)


def test_serve_search_keeps_the_least_and_narrower_weights_need_less():
    model = calc.load_card(CARD)
    cells = report.report(model, seq_len=1024, tasks=("serve",))
    # the grid of test_grid: 3 bf16 recipes (KV formats), 6 for int8 and for int4
    assert {w: cells[("serve", w)].searched for w in report.WIDTHS} == {
        "bf16": 3, "int8": 6, "int4": 6,
    }  # fmt: skip
    for width in report.WIDTHS:
        # a 1-byte KV cache (int8 or fp8) holds half of a bf16 one, all else equal: the least
        # peak never keeps the 16-bit cache
        assert cells[("serve", width)].job.kv_quant in ("int8", "fp8")
    # bf16 weights by hand: 2 B x the card's published 494,032,768 parameters, plus the CUDA
    # allocator's rounding to 512 B blocks of the tensors that are not multiples of it (hidden
    # 896, 2 KV heads of 64): per layer the q bias (1792 B -> 2048), the k and v biases
    # (256 B -> 512) and the two norms (1792 B -> 2048), 5 x 256 B, over 24 layers, plus the
    # final norm: 121 x 256 B. Every other tensor (embedding 151936 x 896, the linears) is a
    # multiple of 512 B.
    bf16 = cells[("serve", "bf16")]
    assert bf16.weights_bytes == 2 * calc.published_params(CARD) + 121 * 256
    assert bf16.peak_bytes > bf16.weights_bytes
    assert (
        cells[("serve", "int4")].peak_bytes
        < cells[("serve", "int8")].peak_bytes
        < cells[("serve", "bf16")].peak_bytes
    )


def test_cli_report_counts_the_cards_parameters(capsys):
    # "32B" is 32 billion parameters: the count comes from the card, checked here against the
    # card's published figure (model_cards/<id>/, not computed by our code).
    code = cli.main(["report", "--card", CARD, "--tasks", "serve", "--seq-len", "1024", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_params"] == calc.published_params(CARD)
    served = {c["width"]: c for c in out["cells"] if c["task"] == "serve"}
    assert set(served) == {"bf16", "int8", "int4"}
    assert all(c["applies"] and c["peak_bytes"] > 0 for c in served.values())


def test_qwen25_32b_is_32_billion_parameters():
    n = calc.load_card("qwen2.5-32b").n_params
    assert n == calc.published_params("qwen2.5-32b")
    assert 32e9 < n < 33e9


def test_cli_report_bad_task(capsys):
    assert cli.main(["report", "--card", CARD, "--tasks", "prune"]) == 2
    assert "tasks" in capsys.readouterr().err


def test_gpt2_lora_cells_say_not_modelled():
    # LoRA/QLoRA on GPT-2's fused c_attn raise NotImplementedError in the replay: the report
    # names it per cell instead of failing or calling the cell "n/a".
    cells = report.report(calc.load_card("gpt2"), seq_len=64, tasks=("lora",))
    lora = cells[("lora", "bf16")]
    assert isinstance(lora, report.Unavailable)
    assert any("GPT-2" in r for r in lora.reasons)
    assert cells[("lora", "int4")] is None
