"""Validation of calc.LoRA / calc.Quant and the job fields that take them."""

import pytest

import calc


def test_qlora_job_is_accepted_and_hashable():
    job = calc.Training(
        micro_batch=1, seq_len=8, lora=calc.LoRA(rank=16), quant=calc.Quant(method="nf4")
    )
    assert hash(job) == hash(job)
    assert job.lora.modules == ("q", "k", "v", "o", "gate", "up", "down")


def test_defaults_follow_the_common_tools():
    # int4: groups of 128 with fp16 scale + zero point (GPTQ/AWQ); int8: per-row fp32 absmax
    # (bitsandbytes SCB); nf4: blocks of 64 (bitsandbytes blocksize default).
    i4, i8, n4 = calc.Quant(method="int4"), calc.Quant(method="int8"), calc.Quant(method="nf4")
    assert (i4.group, i4.has_zero_point, i4.scale_bytes) == (128, True, 2)
    assert (i8.group, i8.has_zero_point, i8.scale_bytes) == (None, False, 4)
    assert n4.group == 64 and n4.double_quant
    assert calc.LoRA(rank=8, alpha=16).scale == 2.0
    assert calc.LoRA(rank=8).scale == 1.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": "int3"}, "method"),
        ({"method": "fp8", "group_size": 64}, "group_size"),
        ({"method": "int4", "group_size": 33}, "group_size"),
        ({"method": "nf4", "group_size": 100}, "group_size"),
        ({"method": "nf4", "zero_point": True}, "zero_point"),
        ({"method": "nf4", "scale_dtype": "fp16"}, "scale_dtype"),
        ({"method": "int8", "scale_dtype": "int8"}, "scale_dtype"),
        ({"method": "fp8", "fp8_scaling": "block"}, "fp8_scaling"),
        ({"method": "int8", "keep_16bit": ("embed",)}, "keep_16bit"),
        ({"method": "int8", "keep_16bit": ["norm"]}, "keep_16bit"),
        ({"method": "int8", "double_quant": 1}, "double_quant"),
    ],
)
def test_bad_quant_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        calc.Quant(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": True}, "rank"),
        ({"rank": 8, "alpha": -1}, "alpha"),
        ({"rank": 8, "modules": ()}, "modules"),
        ({"rank": 8, "modules": ("q", "qkv")}, "modules"),
        ({"rank": 8, "modules": ("q", "q")}, "modules"),
        ({"rank": 8, "adapter_dtype": "int8"}, "adapter_dtype"),
        ({"rank": 8, "dropout": 1.0}, "dropout"),
        ({"rank": 8, "dropout": -0.1}, "dropout"),
        ({"rank": 8, "dropout": "0.1"}, "dropout"),
    ],
)
def test_bad_lora_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        calc.LoRA(**kwargs)


def test_job_fields_are_checked():
    with pytest.raises(ValueError, match="quant"):
        calc.Training(micro_batch=1, seq_len=8, quant=calc.Quant(method="nf4"))
    with pytest.raises(ValueError, match="lora"):
        calc.Training(micro_batch=1, seq_len=8, lora={"rank": 8})
    with pytest.raises(ValueError, match="kv_quant"):
        calc.Inference(batch=1, context=8, kv_quant="int4")
    with pytest.raises(ValueError, match="quant"):
        calc.Inference(batch=1, context=8, quant="int8")
