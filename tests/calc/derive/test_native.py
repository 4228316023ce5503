"""transformers' own tensor and expert parallelism on a derived model (`calc.derive.native`):
what is recorded and what is refused by name."""

from __future__ import annotations

import pytest

import calc
from calc.derive.native import Native
from tests.specs import TINY_PHI3_CONFIG

pytest.importorskip("transformers")

JOB = calc.Training(micro_batch=2, seq_len=64, precision="fp32", optimizer_impl="for-loop")
TINY_MIXTRAL = {
    **TINY_PHI3_CONFIG, "model_type": "mixtral", "num_local_experts": 4,
    "num_experts_per_tok": 2, "num_key_value_heads": 2,
}  # fmt: skip


def test_split_and_spread_experts_weigh_the_same_and_the_plan_is_named() -> None:
    # 4 experts over 2 ranks: the tp plan gives each rank half of every expert
    # (gate_up [4, 128, 64], down [4, 64, 64]), the ep plan two whole experts ([2, 256, 64],
    # [2, 64, 128]): the same elements, the rest of the model under the same tp plan
    spec = calc.ModelSpec.from_hf_config(TINY_MIXTRAL)
    tp = calc.estimate(spec, JOB, calc.Parallelism(tp=2), device="cpu")
    ep = calc.estimate(spec, JOB, calc.Parallelism(tp=2, expert_parallel=True), device="cpu")
    assert tp.breakdown["weights"] == ep.breakdown["weights"]
    assert any("base_model_ep_plan" in note for note in ep.notes)


@pytest.mark.parametrize(
    ("parallel", "job", "says"),
    [
        (calc.Parallelism(tp=2), calc.Training(micro_batch=2, seq_len=64), "for-loop"),
        (calc.Parallelism(tp=2, dp=2), JOB, "transformers' own tp_plan alone"),
        (calc.Parallelism(tp=2, sp=True), JOB, "transformers' own tp_plan alone"),
    ],
)
def test_what_transformers_tensor_parallelism_is_not_recorded_with_is_named(
    parallel: calc.Parallelism, job: calc.Training, says: str
) -> None:
    spec = calc.ModelSpec.from_hf_config(TINY_PHI3_CONFIG)
    with pytest.raises(NotImplementedError, match=says):
        calc.estimate(spec, job, parallel, device="cpu")


def test_expert_parallelism_needs_tp_and_a_derived_model() -> None:
    with pytest.raises(ValueError, match="expert_parallel=True needs tp > 1"):
        calc.Parallelism(expert_parallel=True)
    with pytest.raises(NotImplementedError, match="expert_parallel=True"):
        calc.estimate(
            calc.load_card("llama-2-7b"), JOB, calc.Parallelism(tp=2, expert_parallel=True)
        )
    with pytest.raises(ValueError, match=r"Native\.tp=1"):
        Native(tp=1)


def test_waiting_on_a_collective_allocates_nothing() -> None:
    # _c10d_functional.wait_tensor's kernels return their input; its fake rule returns a new
    # tensor (empty_like), which the recording must not count: measured on 2 gloo ranks, tiny
    # Phi-3 fp32 (dist-derived-phi3-tp-2), the forward held 131,072 B less than a recording
    # that counted it (the [2, 32, 512] fp32 logits gathered from [2, 32, 256] shards).
    spec = calc.ModelSpec.from_hf_config(TINY_PHI3_CONFIG)
    est = calc.estimate(spec, JOB, calc.Parallelism(tp=2), device="cpu")
    assert not [name for name in est.breakdown if name.endswith("/wait_tensor")]
    # the collective's output is counted once, under the collective (the embedding's all-reduce)
    assert "activations/embedding/all_reduce" in est.breakdown
