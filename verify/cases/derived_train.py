"""Training recipes on derived architectures: the loops, losses and optimizer variants of
`calc.Training` (``loop``, ``loss``, ``optimizer=None``, ``optimizer_in_backward``) on models
whose replay calc records from transformers' code (`calc.derive`, `calc.derive.loops`).

The ``dtrain-<type>-*`` cases run the tiny configs of `verify.cases.derived` (vocabulary 4096,
so that the logits a loop holds, or does not, weigh); the ``dtrain-derived-*`` cases run the
jobs of the hand-graph loop cases (`verify.cases.single`, ``_loop_cases``) with
``implementation="derived"``: the same measured run, predicted by the derived replay instead
of the hand-written graph (tests/calc/derive/test_loops.py checks both predictions agree).
"""

from __future__ import annotations

import json
from typing import Any

from calc.config.jobs import Training
from verify.cases.case import LLAMA, QWEN2, TOLERANCE_PCT, Case, pairs
from verify.cases.case import train as _train
from verify.cases.derived import CONFIGS

VOCAB = 4096
"""Vocabulary of the tiny configs here (the loop cases' ``scale={"vocab": 4096}``)."""


def _case(model_type: str, label: str, **job: Any) -> Case:
    attention = "eager" if model_type.startswith(("gemma", "deepseek")) else "sdpa"
    fields = {"micro_batch": 2, "seq_len": 64, "precision": "fp32", "optimizer": "adamw",
              "implementation": "hf", "attention": attention, **job}  # fmt: skip
    return Case(
        name=f"dtrain-{model_type}-{label}",
        card=model_type,
        job=Training(**fields),
        impl="hf",
        tolerance_pct=TOLERANCE_PCT["hf"],
        tags=("training", "hf", "derived", "loop"),
        note="derived replay: the job's loop/loss/optimizer variant recorded as verify runs it",
        config=json.dumps({**CONFIGS[model_type], "vocab_size": VOCAB}, sort_keys=True),
        scale=pairs(None),
    )


def _derived(name: str, card: str, **job: Any) -> Case:
    """A hand-graph loop case's job, predicted by the derived replay."""
    v = {"scale": {"vocab": VOCAB}, "micro_batch": 2, "seq_len": 64}
    return _train(f"dtrain-derived-{name}", card, impl="derived", tags=("derived", "loop"),
                  note="the job of the hf loop case of this name, derived", **v, **job)  # fmt: skip


def derived_training_cases() -> list[Case]:
    """The loop, loss and optimizer variants on derived types, and on llama/qwen2 derived."""
    return [
        _case("gemma2", "hold-fp32", loop="hold-output"),
        _case("phi3", "chunked-bf16", loss="chunked-ce", precision="bf16"),
        _case("phi3", "chunked-hold-amp", loss="chunked-ce", loop="hold-output",
              precision="amp-bf16", loss_chunks=4),
        _case("olmo2", "del-logits-bf16", loop="del-logits", precision="bf16"),
        _case("granite", "sum-hold-fp32", loss="sum", loop="hold-output"),
        _case("mixtral", "hold-fp32", loop="hold-output"),
        _case("qwen3_moe", "chunked-bf16", loss="chunked-ce", precision="bf16"),
        _case("gemma2", "noopt-fp32", optimizer=None),
        _case("phi3", "noopt-hold-bf16", optimizer=None, loop="hold-output", precision="bf16"),
        _case("phi3", "opt-in-bwd-fp32", optimizer_in_backward=True),
        _case("gemma2", "opt-in-bwd-sgdm-bf16", optimizer_in_backward=True,
              optimizer="sgd-momentum", precision="bf16"),
        _case("mixtral", "opt-in-bwd-bf16", optimizer_in_backward=True, precision="bf16"),
        _derived("loop-hold-qwen2-bf16", QWEN2, loop="hold-output", precision="bf16"),
        _derived("loop-hold-llama-amp", LLAMA, loop="hold-output", precision="amp-bf16"),
        _derived("loop-del-logits-qwen2-bf16", QWEN2, loop="del-logits", precision="bf16"),
        _derived("loss-sum-hold-qwen2-fp32", QWEN2, loss="sum", loop="hold-output"),
        _derived("loss-chunked-qwen2-amp", QWEN2, loss="chunked-ce", precision="amp-bf16"),
        _derived("loss-chunked-hold-llama-bf16", LLAMA, loss="chunked-ce", loop="hold-output",
                 precision="bf16"),
        _derived("loop-noopt-qwen2-bf16", QWEN2, optimizer=None, precision="bf16"),
        _derived("opt-in-bwd-adamw-qwen2-bf16", QWEN2, optimizer_in_backward=True,
                 precision="bf16"),
    ]  # fmt: skip
