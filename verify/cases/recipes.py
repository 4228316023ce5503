"""Cases of the implementations users run (`calc.Training`'s ``implementation``): torchtune's
Llama (``tt-*``, a faithful copy of its model code, `verify.models.torchtune_llama`) in fp32 and
pure bf16, with its recipe's losses and layer recomputation, on the CPU tracker."""

from __future__ import annotations

from verify.cases.case import LLAMA, LLAMA3, MISTRAL, QWEN2, Case, Q
from verify.cases.case import train as _train

TT = {"impl": "torchtune", "loop": "del-logits"}


def recipe_cases() -> list[Case]:
    """torchtune: fp32 and bf16, GQA and not, biases (qwen2), chunked loss, recomputation."""
    tags = ("implementation",)
    return [
        _train("tt-fp32-llama", LLAMA, tags=(*Q, *tags), **TT),
        _train("tt-bf16-llama3", LLAMA3, precision="bf16", tags=tags, **TT),
        _train(
            "tt-bf16-chunked-llama3",
            LLAMA3,
            precision="bf16",
            loss="chunked-ce",
            tags=(*Q, *tags),
            **TT,
        ),
        _train(
            "tt-bf16-chunked-b1-mistral",
            MISTRAL,
            precision="bf16",
            loss="chunked-ce",
            micro_batch=1,
            loss_chunks=4,
            tags=tags,
            **TT,
        ),
        _train(
            "tt-bf16-gqa2-llama3", LLAMA3, precision="bf16", scale={"kv_heads": 2}, tags=tags, **TT
        ),
        _train(
            "tt-fp32-gqa2-chunked-llama3",
            LLAMA3,
            loss="chunked-ce",
            loss_chunks=2,
            micro_batch=3,
            scale={"kv_heads": 2},
            tags=tags,
            **TT,
        ),
        _train(
            "tt-bf16-opt-in-bwd-recompute-chunked-llama3",
            LLAMA3,
            precision="bf16",
            optimizer_in_backward=True,
            recompute="full",
            loss="chunked-ce",
            tags=tags,
            **TT,
        ),
        _train("tt-fp32-recompute-llama3", LLAMA3, recompute="full", tags=tags, **TT),
        _train(
            "tt-bf16-recompute-chunked-qwen2",
            QWEN2,
            precision="bf16",
            recompute="full",
            loss="chunked-ce",
            tags=tags,
            **TT,
        ),
    ]
