"""What only the recorded rank models: FSDP1 (``FullyShardedDataParallel``, flat parameters;
`calc.derive.sharding.wrap_fsdp1`) and FSDP2's root ``output_dtype``, each recorded wrapped by
torch's own FSDP over a fake process group."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from calc.derive.sharding import Shard
from tests.specs import TINY_PHI3_CONFIG

pytest.importorskip("transformers")

JOB = calc.Training(micro_batch=2, seq_len=32, precision="fp32", optimizer="adamw")
FSDP1 = calc.Parallelism(dp=2, fsdp=True, fsdp_version=1)


def test_a_rank_holds_half_of_each_flat_parameter_and_of_its_adam_states() -> None:
    # One flat parameter per decoder layer and one for the rest (ModuleWrapPolicy), each split
    # in two and rounded to 512 B. Per layer: qkv_proj 192 x 64, o_proj 64 x 64, gate_up_proj
    # 256 x 64, down_proj 64 x 128, two norms of 64: 41,088 elements, 20,544 a rank, 82,176 B
    # -> 82,432 B. The root: embedding and head 512 x 64 each, the final norm 64: 65,600
    # elements, 32,800 a rank, 131,200 B -> 131,584 B. (FSDP2 shards each parameter on its
    # own instead: 297,472 B, tests/calc/derive/test_sharding.py.)
    flat = 131_584 + 2 * 82_432
    est = calc.estimate(calc.ModelSpec.from_hf_config(TINY_PHI3_CONFIG), JOB, FSDP1, device="cpu")
    assert est.breakdown["weights"] == flat == 296_448
    assert est.breakdown["optimizer"] == 2 * flat  # exp_avg and exp_avg_sq of the flat shards
    assert any("FSDP1 FullyShardedDataParallel over 2 ranks" in note for note in est.notes)


def test_a_hand_modelled_type_answers_with_the_recording_for_hf_and_refuses_reference() -> None:
    spec = calc.load_card("llama-2-7b")
    job = calc.Training(micro_batch=1, seq_len=64, precision="bf16", implementation="hf")
    est = calc.estimate(spec, job, FSDP1, device="cpu")
    assert any(
        "fsdp_version=1 (FullyShardedDataParallel's flat parameters): recorded" in n
        for n in est.notes
    )
    with pytest.raises(NotImplementedError, match="fsdp_version=1"):
        calc.estimate(spec, replace(job, implementation="reference"), FSDP1, device="cpu")


def test_lora_under_fsdp1_without_orig_params_names_the_option() -> None:
    # FSDP1 flattens a layer's frozen base and its adapters into one flat parameter, which
    # torch refuses unless use_orig_params=True: the estimate says so before recording.
    spec = calc.load_card("llama-2-7b")
    job = calc.Training(micro_batch=1, seq_len=64, precision="bf16", lora=calc.LoRA(rank=8))
    with pytest.raises(ValueError, match="fsdp_use_orig_params=True"):
        calc.estimate(spec, job, FSDP1, device="cpu")


def test_the_root_output_dtype_is_answered_by_the_recording() -> None:
    spec = calc.load_card("llama-2-7b")
    job = calc.Training(micro_batch=1, seq_len=64, precision="fp32", implementation="hf")
    policy = {"fsdp_param_dtype": "bf16", "fsdp_reduce_dtype": "fp32"}
    par = calc.Parallelism(dp=2, fsdp=True, fsdp_output_dtype="fp32", **policy)
    est = calc.estimate(spec, job, par, device="cpu")
    assert any("fsdp_output_dtype (MixedPrecisionPolicy output casts)" in n for n in est.notes)
    with pytest.raises(NotImplementedError, match="fsdp_output_dtype"):
        calc.estimate(spec, replace(job, implementation="reference"), par, device="cpu")


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"fsdp_output_dtype": "fp32"}, "it needs fsdp=True and fsdp_version=2"),
        ({"fsdp_output_dtype": "fp16", "fsdp": True}, "fsdp_output_dtype='fp16'"),
        ({"fsdp_version": 3, "fsdp": True}, "fsdp_version=3 is not one of 1, 2"),
        ({"fsdp_version": 1}, "fsdp_version=1 chooses FullyShardedDataParallel: it needs fsdp"),
        ({"fsdp": True, "fsdp_use_orig_params": True}, "needs fsdp=True and fsdp_version=1"),
    ],
)
def test_fsdp1_fields_outside_their_range_are_refused_by_name(fields: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        calc.Parallelism(dp=2, **fields)


def test_a_shard_of_another_version_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Shard\.version=3"):
        Shard(world=2, version=3)
