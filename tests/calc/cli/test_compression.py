"""``python -m calc`` options for quantization and LoRA: they reach the job, or fail clearly."""

import pytest

from calc.cli import main as cli


def _job(*argv):
    return cli.build_job(cli.build_parser().parse_args(list(argv)))


def test_qlora_options_reach_the_training_job():
    job = _job("--task", "train", "--precision", "bf16", "--lora-rank", "16",
               "--lora-modules", "q,v", "--quant", "nf4", "--no-double-quant",
               "--lora-dropout", "0.05")  # fmt: skip
    assert job.lora.rank == 16 and job.lora.modules == ("q", "v") and job.lora.dropout == 0.05
    assert job.quant.method == "nf4" and job.quant.double_quant is False


def test_quant_lm_head_leaves_only_embeddings_and_norms_in_16_bit():
    job = _job("--task", "train", "--precision", "bf16", "--lora-rank", "8", "--quant", "nf4",
               "--quant-lm-head")  # fmt: skip
    assert job.quant.keep_16bit == ("embed", "norm")
    assert _job("--task", "infer", "--quant", "nf4").quant.keep_16bit == (
        "embed", "norm", "lm_head",
    )  # fmt: skip


def test_quant_and_kv_options_reach_the_inference_job():
    job = _job("--task", "infer", "--quant", "int4", "--group-size", "64", "--no-zero-point",
               "--kv-quant", "fp8")  # fmt: skip
    assert (job.quant.method, job.quant.group_size, job.quant.zero_point) == ("int4", 64, False)
    assert job.kv_quant == "fp8"


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (("--task", "train", "--quant", "nf4"), "lora"),  # a quantized base needs adapters
        (("--task", "infer", "--lora-rank", "8"), "lora-rank"),
        (("--task", "train", "--kv-quant", "int8"), "kv-quant"),
        (("--task", "infer", "--group-size", "64"), "group-size"),
        (("--task", "infer", "--quant", "int3"), "method"),
        (("--task", "train", "--lora-rank", "8", "--lora-modules", "q,x"), "modules"),
        (("--task", "train", "--lora-dropout", "0.1"), "lora-dropout"),
        (("--task", "train", "--lora-rank", "8", "--lora-dropout", "1.5"), "dropout"),
        (("--task", "infer", "--quant-lm-head"), "quant-lm-head"),
    ],
)
def test_bad_options_name_the_field(argv, field):
    with pytest.raises(ValueError, match=field):
        _job(*argv)


def test_main_exits_2_on_bad_option(capsys):
    assert cli.main(["--task", "infer", "--kv-quant", "int4"]) == 2
    assert "kv_quant" in capsys.readouterr().err
