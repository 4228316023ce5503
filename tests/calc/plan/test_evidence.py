"""`calc.plan.evidence`: the nearest verified cases of a job and their largest error.

Reports are written by hand here; the expected cases and errors follow from the rule in the
module docstring (same kind of job, most shared fields, largest absolute error among them).
"""

from __future__ import annotations

import pytest

import calc
from calc.plan.evidence import cuda_only_terms, error_bar, nearest_cases, verified_cases
from tests.specs import tiny_llama


def _case(name: str, err: object, kind: str = "training", model_type: str = "llama",
          **job: object) -> dict:  # fmt: skip
    return {"name": name, "kind": kind, "error_pct": err, "device": "cpu", "job": job,
            "spec": {"model_type": model_type}}  # fmt: skip


MODEL = tiny_llama(name="tiny-qwen", model_type="qwen2", qkv_bias=True)
JOB = calc.Training(micro_batch=1, seq_len=8, precision="bf16-master", optimizer="adamw",
                    recompute="full")  # fmt: skip


def test_only_compared_cases_count() -> None:
    report = {"cases": [_case("ok", -0.4, implementation="hf"), _case("nm", None),
                        _case("bad", True), "not a case"]}  # fmt: skip
    cases = verified_cases(report)
    assert [c.name for c in cases] == ["ok"]
    assert cases[0].abs_error_pct == pytest.approx(0.4)
    assert verified_cases(None) == () and verified_cases({"cases": []}) == ()


def test_nearest_share_most_fields_and_the_bar_is_their_largest_error() -> None:
    hf_full = dict(implementation="hf", precision="bf16-master", optimizer="adamw",
                   recompute="full", attention="sdpa", optimizer_impl="foreach")  # fmt: skip
    report = {"cases": [
        # all six job fields and the model type: the nearest two, errors 0.2 and 0.9
        _case("a", 0.2, model_type="qwen2", **hf_full),
        _case("b", -0.9, model_type="qwen2", **hf_full),
        # same job fields, other model type: one field fewer
        _case("c", 5.0, model_type="llama", **hf_full),
        # an inference case is never near a training job
        _case("d", 0.0, kind="inference", model_type="qwen2", implementation="hf"),
    ]}  # fmt: skip
    bar = error_bar(JOB, MODEL, verified_cases(report))
    assert bar is not None
    assert set(bar.cases) == {"a", "b"}
    assert bar.max_abs_error_pct == pytest.approx(0.9)
    assert "model_type=qwen2" in bar.similarity


def test_no_case_of_the_kind_gives_no_bar() -> None:
    report = {"cases": [_case("d", 0.1, kind="inference", implementation="hf")]}
    assert error_bar(JOB, MODEL, verified_cases(report)) is None
    assert nearest_cases(JOB, MODEL, ()) == ((), ())


def test_bar_says_its_source_and_the_unverified_cuda_terms() -> None:
    # Only CPU-tracker cases near: on CUDA every CUDA-only term of the job is unverified (this
    # bf16 llama job: the cuBLAS workspaces and the CUDA flash kernel's own tensors; its SDPA
    # kernel is flash on both devices, and it has no dropout).
    report = {"cases": [_case("a", 0.2, model_type="qwen2", implementation="reference")]}
    job = calc.Training(micro_batch=1, seq_len=8, precision="bf16")
    bar = error_bar(job, MODEL, verified_cases(report))
    assert bar is not None
    assert bar.source == "CPU storage tracker (python -m verify)"
    assert bar.unverified == ("cuBLAS workspaces", "flash kernel tensors")
    assert "unverified CUDA-only terms: cuBLAS workspaces, flash kernel tensors" in bar.text()
    # the same bar for the CPU tracker has nothing unverified
    cpu = error_bar(job, MODEL, verified_cases(report), device="cpu")
    assert cpu is not None and cpu.unverified == () and "unverified" not in cpu.text()
    # a GPU-measured neighbour covers them
    gpu_case = {**_case("g", 0.5, model_type="qwen2", implementation="reference"), "device": "cuda"}
    gpu = error_bar(job, MODEL, verified_cases({"cases": [gpu_case]}))
    assert gpu is not None and gpu.unverified == () and gpu.source == "recorded GPU runs"


def test_dropout_and_autocast_terms() -> None:
    # attention dropout: CUDA keeps flash, the CPU takes math; GPT-2 under autocast: fp32 ops.
    gpt2 = tiny_llama(name="tiny-gpt2", model_type="gpt2", attention_dropout=0.1)
    job = calc.Training(micro_batch=1, seq_len=8, precision="amp-bf16", dropout=0.1)
    terms = cuda_only_terms(job, gpt2)
    assert terms == (
        "cuBLAS workspaces", "SDPA kernel (flash on CUDA)", "flash kernel tensors",
        "dropout masks", "autocast fp32 ops",
    )  # fmt: skip
    assert cuda_only_terms(calc.Inference(batch=1, context=8, attention="eager"), None) == (
        "cuBLAS workspaces",
    )
