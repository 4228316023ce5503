"""HSDP (`calc.Parallelism(dp_replicate=...)`, `calc.parallel.fsdp`): FSDP2 over a 2-D mesh,
each parameter sharded over ``dp / dp_replicate`` ranks and replicated over ``dp_replicate``
groups. Expected values by hand on ``tiny_llama64`` (hidden 64, 2 layers, 4 heads of 16, ffn
128, vocab 64, untied), one sequence of 8 tokens, fp32 AdamW, CUDA (no CPU DeviceMesh
tensors). The torchrun measurements are verify's ``dist-hsdp-*`` and
``dist-torchtitan-hsdp-*`` cases."""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama64, tiny_training

BF16_POLICY = {"fsdp_param_dtype": "bf16", "fsdp_reduce_dtype": "bf16"}
FP32_REDUCE = {"fsdp_param_dtype": "bf16", "fsdp_reduce_dtype": "fp32"}


def _estimate(**parallel: object) -> calc.Estimate:
    par = calc.Parallelism(fsdp=True, **parallel)  # type: ignore[arg-type]
    return calc.estimate(tiny_llama64(), tiny_training(), par)


@pytest.mark.parametrize("policy", [{}, FP32_REDUCE])
def test_hsdp_holds_what_fsdp_over_its_shard_group_holds(policy: dict) -> None:
    # 2 replicas x 2 shards: the shards, gathers and reduce-scatters of FSDP2 over 2 ranks.
    # The all-reduce across replicas runs in place on the reduce-scatter output, which is the
    # gradient shards' own storage when reduce_dtype is the parameters' (fp32): nothing more.
    hsdp = _estimate(dp=4, dp_replicate=2, **policy)
    fsdp = _estimate(dp=2, **policy)
    assert hsdp.peak_bytes == fsdp.peak_bytes
    assert hsdp.breakdown == {**fsdp.breakdown, **{k: v for k, v in hsdp.breakdown.items()
                                                   if k.startswith("ranks/")}}  # fmt: skip


def test_a_bf16_reduce_keeps_each_reduced_layer_s_buffer_to_the_end_of_backward() -> None:
    # foreach_reduce all-reduces the bf16 reduce-scatter output and FSDPParamGroup keeps it
    # (_all_reduce_state) until finalize_backward, beside its fp32 cast. At the backward peak
    # (layer 0, the same event in both layouts) layer 1's is held: its shard over 2 ranks is
    # 4 x 32x64 (q, k, v, o) + 64x64 (gate, up) x 2 + 32x128 (down) + 2 x 32 (norms) =
    # 20,544 elements, 41,088 B in bf16 -> 81 blocks of 512 = 41,472 B.
    hsdp = _estimate(dp=4, dp_replicate=2, **BF16_POLICY)
    fsdp = _estimate(dp=2, **BF16_POLICY)
    assert hsdp.peak_event == fsdp.peak_event
    assert hsdp.peak_bytes - fsdp.peak_bytes == 81 * 512


def test_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"dp_replicate=2 is HSDP.*fsdp=True"):
        calc.Parallelism(dp=4, dp_replicate=2)
    with pytest.raises(ValueError, match="dp_replicate=3 must divide dp=4"):
        calc.Parallelism(dp=4, fsdp=True, dp_replicate=3)
    with pytest.raises(ValueError, match=r"dp_replicate=4 is out of range: allowed \[1, 2\]"):
        calc.Parallelism(dp=2, fsdp=True, dp_replicate=4)
    assert calc.Parallelism(dp=8, fsdp=True, dp_replicate=2).shard_world == 4


def test_hsdp_with_offload_or_tensor_parallelism_is_refused() -> None:
    par = calc.Parallelism(dp=4, fsdp=True, dp_replicate=2, offload="optimizer")
    with pytest.raises(NotImplementedError, match="HSDP"):
        calc.estimate(tiny_llama64(), tiny_training(), par)
