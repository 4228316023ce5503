"""FSDP2 ``MixedPrecisionPolicy`` (`calc.parallel.fsdp`): fp32 shards and states, bf16 compute,
the reduce-scatter in ``reduce_dtype``. Expected values by hand on ``tiny_llama64`` (hidden 64,
2 layers, 4 heads of 16, no GQA, ffn 128, vocab 64, untied) over dp=2, one sequence of 8
tokens, fp32 AdamW; sizes in 512-byte blocks. The torchrun measurements are verify's
``dist-fsdp2-mp-*`` cases."""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama64, tiny_training


def _estimate(**mp: str) -> calc.Estimate:
    par = calc.Parallelism(dp=2, fsdp=True, **mp)
    return calc.estimate(tiny_llama64(), tiny_training(), par, device="cpu")


def test_optimizer_states_are_those_of_the_fp32_shards() -> None:
    # exp_avg over each rank's fp32 dim-0 shard: embed and head 32x64 = 2048 elements = 8192 B
    # each, final norm 32 -> 128 B -> 512; per layer q, k, v, o 32x64 -> 8192 B each, gate, up
    # 64x64 and down 32x128 -> 16384 B each, two norms -> 512 each: 82944 per layer.
    expected = 2 * 8192 + 512 + 2 * (4 * 8192 + 3 * 16384 + 2 * 512)
    assert expected == 182784
    for mp in ({}, {"fsdp_param_dtype": "bf16", "fsdp_reduce_dtype": "fp32"},
               {"fsdp_param_dtype": "bf16", "fsdp_reduce_dtype": "bf16"}):  # fmt: skip
        assert _estimate(**mp).breakdown["optimizer/exp_avg"] == expected


def test_reduce_dtype_sets_the_reduce_scatter_input() -> None:
    # At the backward peak one layer's reduce-scatter input is in flight: 2 ranks x its shard
    # total = the layer's 4*4096 + 3*8192 + 2*64 = 40960 elements, 4 B (fp32) or 2 B (bf16).
    fp32 = _estimate(fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32")
    bf16 = _estimate(fsdp_param_dtype="bf16", fsdp_reduce_dtype="bf16")
    assert fp32.peak_event == bf16.peak_event
    assert fp32.breakdown["temporaries"] - bf16.breakdown["temporaries"] == 40960 * (4 - 2)


def test_bf16_compute_is_below_the_fp32_run() -> None:
    assert _estimate(fsdp_param_dtype="bf16").peak_bytes < _estimate().peak_bytes


def test_validation() -> None:
    with pytest.raises(ValueError, match="need fsdp=True"):
        calc.Parallelism(dp=2, fsdp_param_dtype="bf16")
    with pytest.raises(ValueError, match="without fsdp_param_dtype"):
        calc.Parallelism(dp=2, fsdp=True, fsdp_reduce_dtype="fp32")
    with pytest.raises(ValueError, match="fsdp_param_dtype="):
        calc.Parallelism(dp=2, fsdp=True, fsdp_param_dtype="fp16")
    par = calc.Parallelism(dp=2, fsdp=True, fsdp_param_dtype="bf16")
    bf16 = calc.Training(micro_batch=1, seq_len=8, precision="bf16", implementation="reference")
    with pytest.raises(ValueError, match="precision='fp32'"):
        calc.estimate(tiny_llama64(), bf16, par)
