"""DDP on a derived model (`calc.derive.data_parallel`): the recorded step plus DDP's buckets,
and the one message for the layouts the recording does not hold."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from tests.specs import TINY_PHI3_CONFIG

pytest.importorskip("transformers")

TINY_PHI3 = TINY_PHI3_CONFIG
JOB = calc.Training(micro_batch=2, seq_len=32, precision="fp32", optimizer="adamw")


def test_a_ddp_rank_holds_one_bucket_of_every_gradient_more() -> None:
    # 147,776 parameters (counted by hand in test_replay.py's phi3 test), fp32 gradients:
    # 591,104 B, below DDP's 25 MiB cap, so one bucket before and after the rebuild, rounded
    # up to 512 B by the allocator: 591,360 B on top of the single-process step, whose
    # gradients DDP keeps too (gradient_as_bucket_view=False).
    spec = calc.ModelSpec.from_hf_config(TINY_PHI3)
    single = calc.estimate(spec, JOB, device="cpu").peak_bytes
    ddp = calc.estimate(spec, JOB, calc.Parallelism(dp=2), device="cpu").peak_bytes
    assert ddp - single == 591_360


def test_the_held_output_under_ddp_adds_the_same_bucket() -> None:
    # DDP's buckets are constant storages: the held output changes the single-process step
    # and the DDP rank by the same bytes (the bucket of 591,360 B is on both).
    spec = calc.ModelSpec.from_hf_config(TINY_PHI3)
    job = replace(JOB, loop="hold-output")
    single = calc.estimate(spec, job, device="cpu").peak_bytes
    ddp = calc.estimate(spec, job, calc.Parallelism(dp=2), device="cpu").peak_bytes
    assert ddp - single == 591_360


def _owned_by(rank: int, numels: list[int], world: int) -> list[int]:
    """torch's ZeroRedundancyOptimizer partition, written out here: the parameters sorted by
    size, largest first (stable), each to the rank with the smallest total so far."""
    totals = [0] * world
    owned: list[int] = []
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        to = totals.index(min(totals))
        totals[to] += numels[i]
        if to == rank:
            owned.append(i)
    return owned


def test_a_zero1_rank_holds_the_adam_states_of_its_own_parameters_only() -> None:
    # AdamW keeps exp_avg and exp_avg_sq (fp32, each storage rounded to 512 B) of the
    # parameters the partition gives the rank; the parameters are transformers' own (meta).
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**TINY_PHI3)
        )
    numels = [p.numel() for p in model.parameters()]
    spec = calc.ModelSpec.from_hf_config(TINY_PHI3)
    par = calc.Parallelism(dp=2, zero=1, zero_partition="by-parameter")
    est = calc.estimate(spec, JOB, par, device="cpu")  # the most-loaded rank's
    owned = _owned_by(est.rank, numels, 2)
    assert 0 < len(owned) < len(numels)
    assert est.breakdown["optimizer"] == sum(2 * (-(-4 * numels[i] // 512) * 512) for i in owned)


@pytest.mark.parametrize(
    ("parallel", "job", "says"),
    [
        (calc.Parallelism(dp=2, zero=1), JOB, "ZeRO-1 by shard"),
        (calc.Parallelism(dp=2, zero=1, zero_partition="by-parameter"),
         replace(JOB, precision="amp-fp16"), "without a GradScaler"),
        (calc.Parallelism(dp=2, fsdp=True, offload="optimizer"), JOB, "offload"),
        (calc.Parallelism(dp=2, fsdp=True),
         calc.Training(micro_batch=2, seq_len=32, loss="chunked-ce"), "loss='chunked-ce'"),
        (calc.Parallelism(dp=2, gradient_as_bucket_view=True), JOB, "bucket views"),
        (calc.Parallelism(dp=2), calc.Training(micro_batch=2, seq_len=32, loss="chunked-ce"),
         "loss='chunked-ce'"),
        (calc.Parallelism(dp=2),
         calc.Training(micro_batch=2, seq_len=32, precision="fp32", optimizer_in_backward=True),
         "optimizer_in_backward"),
    ],
)  # fmt: skip
def test_what_the_recording_does_not_hold_is_refused_by_name(
    parallel: calc.Parallelism, job: calc.Training, says: str
) -> None:
    spec = calc.ModelSpec.from_hf_config(TINY_PHI3)
    with pytest.raises(NotImplementedError) as info:
        calc.estimate(spec, job, parallel, device="cpu")
    assert says in str(info.value) and "\n" not in str(info.value)
