"""`calc.estimate`'s input checks: wrong types are refused with a ValueError naming the field."""

from __future__ import annotations

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
