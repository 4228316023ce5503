"""Where a hand-written graph refuses a Hugging Face job, the replay derived from transformers'
own code (`calc.derive`) may answer instead: `derived_fallback` says whether and with which
job. Used by `calc.estimate` for one GPU and by `calc.estimate.ranks` for FSDP1, which only the
recording models."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.derive.replay import check_cuda


def derived_fallback(
    model: ModelSpec, job: Training | Inference, device: str
) -> Training | Inference | None:
    """``job`` with ``implementation="derived"`` where that replay stands in for the hf one:
    a hand-modelled type, torch and transformers installed (the recording needs them), and
    the recorded CPU kernels the ones the device runs: always on the CPU tracker; on CUDA only
    without attention dropout (CUDA keeps its fused SDPA kernels with dropout, the CPU takes the
    math kernel: `calc.models.attention`) and not for fp32 grouped-query inference (math on
    CUDA: `calc.derive.replay.check_cuda`)."""
    if job.implementation != "hf" or model.derived:
        return None
    if any(importlib.util.find_spec(name) is None for name in ("torch", "transformers")):
        return None
    if device != "cpu" and isinstance(job, Training):
        attn_dropout = job.dropout if job.dropout is not None else model.attention_dropout
        if attn_dropout > 0:
            return None
    derived = replace(job, implementation="derived")
    if device != "cpu":
        try:
            check_cuda(model, derived)
        except (NotImplementedError, ValueError):
            return None  # CUDA runs another kernel: the hand graph's refusal stands
    return derived
