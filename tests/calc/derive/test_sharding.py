"""FSDP2 on a derived model (`calc.derive.sharding`): the rank recorded wrapped by torch's own
``fully_shard`` over a fake process group."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from calc.derive.sharding import Shard
from tests.specs import TINY_PHI3_CONFIG

pytest.importorskip("transformers")

TINY_PHI3 = TINY_PHI3_CONFIG
JOB = calc.Training(micro_batch=2, seq_len=32, precision="fp32", optimizer="adamw")
FSDP2 = calc.Parallelism(dp=2, fsdp=True)


def test_a_rank_holds_the_dim0_half_of_every_parameter_and_of_its_adam_states() -> None:
    # Per-parameter dim-0 shards over 2 ranks, fp32, each its own storage rounded to 512 B:
    # embedding and head 256 x 64 (65,536 B each), the final norm 32 (512 B); per layer
    # qkv_proj 96 x 64 (24,576), o_proj 32 x 64 (8,192), gate_up_proj 128 x 64 (32,768),
    # down_proj 32 x 128 (16,384), two norms of 32 (512 each): 82,944 B, twice.
    shards = 2 * 65_536 + 512 + 2 * (24_576 + 8_192 + 32_768 + 16_384 + 2 * 512)
    est = calc.estimate(calc.ModelSpec.from_hf_config(TINY_PHI3), JOB, FSDP2, device="cpu")
    assert est.breakdown["weights"] == shards == 297_472
    assert est.breakdown["optimizer"] == 2 * shards  # exp_avg and exp_avg_sq of the shards


@pytest.mark.parametrize(
    ("parallel", "job"),
    [
        (FSDP2, {}),
        (calc.Parallelism(dp=2, fsdp=True, reshard_after_forward=False), {}),
        (calc.Parallelism(dp=2, fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32"),
         {"loop": "del-logits"}),
        (calc.Parallelism(dp=4, fsdp=True), {"lora": calc.LoRA(rank=8)}),
        (FSDP2, {"recompute": "full", "grad_accum": 2}),
    ],
)  # fmt: skip
def test_the_recorded_rank_equals_the_hand_written_fsdp2_replay(
    parallel: calc.Parallelism, job: dict
) -> None:
    # The hand-written llama graph's FSDP2 rank (calc.parallel.fsdp) is checked against
    # torchrun measurements by verify's dist-fsdp2-* cases; the recording of transformers'
    # llama wrapped by fully_shard must give the same bytes, six layers (generalised from
    # five) included.
    spec = calc.ModelSpec.from_hf_config(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 512, "max_position_embeddings": 512}
    )  # fmt: skip
    hf = replace(JOB, implementation="hf", **job)
    hand = calc.estimate(spec, hf, parallel, device="cpu")
    derived = calc.estimate(spec, replace(hf, implementation="derived"), parallel, device="cpu")
    assert derived.peak_bytes == hand.peak_bytes
    assert derived.peak_phase == hand.peak_phase


@pytest.mark.parametrize(
    ("fields", "says"),
    [({"world": 1}, "Shard.world=1"), ({"world": 2, "param_itemsize": 3}, "param_itemsize=3")],
)
def test_a_shard_outside_its_range_is_refused_by_name(fields: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Shard(**fields)
