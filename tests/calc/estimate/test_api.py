"""`calc.estimate`'s input checks: wrong types are refused with a ValueError naming the field."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from tests.specs import tiny_llama


@pytest.mark.parametrize("parallel", [{"dp": 2}, 2, "dp=2"])
def test_parallel_of_wrong_type_names_the_field(parallel: object) -> None:
    # regression: a dict used to reach `parallel.is_single` and raise AttributeError
    job = calc.Training(micro_batch=1, seq_len=8)
    with pytest.raises(ValueError, match=r"parallel must be a calc\.Parallelism, got"):
        calc.estimate(tiny_llama(), job, parallel=parallel)  # type: ignore[arg-type]


def test_parallel_of_wrong_type_is_refused_for_a_compressed_job_too() -> None:
    # the LoRA layout check used to read `parallel.is_single` first as well
    job = calc.Training(micro_batch=1, seq_len=8, lora=calc.LoRA(rank=2))
    with pytest.raises(ValueError, match=r"parallel must be a calc\.Parallelism, got dict"):
        calc.estimate(tiny_llama(), job, parallel={"dp": 2})  # type: ignore[arg-type]


def test_paged_optimizer_states_leave_the_peak_and_are_named() -> None:
    # tiny llama with a 8192-token vocabulary: the embedding and the head are [8192, 16] =
    # 131,072 elements, at least bitsandbytes' 100,000, so a paged Adam32bit keeps their fp32
    # states (2 x 131,072 x 4 B each) in managed memory: 2,097,152 B outside the allocator;
    # every other param is smaller and stays. The states live through the steady forward.
    model = tiny_llama(vocab=8192)
    job = calc.Training(micro_batch=1, seq_len=8, precision="fp32", optimizer="adam32bit",
                        implementation="reference")  # fmt: skip
    plain = calc.estimate(model, job, device="cpu")
    paged = calc.estimate(model, replace(job, paged_optimizer=True), device="cpu")
    assert paged.paged_state_bytes == 2_097_152 and plain.paged_state_bytes == 0
    assert plain.phases["step2/forward"] - paged.phases["step2/forward"] == 2_097_152
    assert any("2,097,152 B" in n and "managed memory" in n for n in paged.notes)


def test_paged_optimizer_is_checked() -> None:
    with pytest.raises(ValueError, match="paged_optimizer=True with optimizer='adamw'"):
        calc.Training(micro_batch=1, seq_len=8, paged_optimizer=True)
    job = calc.Training(micro_batch=1, seq_len=8, optimizer="adam8bit", paged_optimizer=True)
    with pytest.raises(NotImplementedError, match="paged_optimizer with ZeRO"):
        calc.estimate(tiny_llama(), job, calc.Parallelism(dp=2, zero=1))
