"""``torch.compile`` cases (``Training(compile="default")``), measured by
`verify.run.compiled` (the profiler's allocation events; the storage tracker's dispatch mode
would make Dynamo run the model eagerly).

Each is a training step whose activations outweigh the optimizer step, so the forward and
backward peaks, which the compiled graph changes, decide the peak. calc records the compiled
step from Inductor's own generated code run on fake tensors (`calc.derive.inductor`); the
record's ``extra`` also gives the eager estimate of the same job, what ignoring
``torch.compile`` would predict.
"""

from __future__ import annotations

from typing import Any

from calc.config.compression import LoRA
from verify.cases.case import GPT2, LLAMA, QWEN2, Case, train
from verify.cases.derived_train import derived_case

__all__ = ["compiled_cases"]

_SIZE = {"micro_batch": 4, "seq_len": 128}


def _derived(model_type: str, label: str, layers: int | None = None, **job: Any) -> Case:
    """A compiled step of a type calc knows only by derivation (`verify.cases.derived`)."""
    fields = {"compile": "default", **job}
    note = "torch.compile(model) of a derived architecture"
    return derived_case(model_type, label, layers, prefix="compile", tag="compile", note=note,
                        **fields)  # fmt: skip


def compiled_cases() -> list[Case]:
    """The ``compile-*`` cases."""
    hf = {"impl": "hf", "compile": "default", "tags": ("compile",), **_SIZE}
    regional = {**hf, "compile": "regional"}
    return [
        train("compile-hf-llama-fp32", LLAMA, precision="fp32", **hf),
        train("compile-hf-llama-bf16", LLAMA, precision="bf16", **hf),
        train("compile-hf-qwen2-fp32", QWEN2, precision="fp32", **hf),
        train("compile-hf-qwen2-amp-bf16", QWEN2, precision="amp-bf16", **hf),
        # runs it never saw while the recording was written
        train("compile-hf-gpt2-fp32", GPT2, precision="fp32", **hf),
        train("compile-hf-llama-accum2-bf16", LLAMA, precision="bf16", grad_accum=2, **hf),
        train("compile-hf-qwen2-hold-fp32", QWEN2, precision="fp32", loop="hold-output", **hf),
        # Qwen2.5-0.5B itself: a 151,936-token vocabulary, the logits' regime of real runs;
        # SGD (no states), so that the compiled backward, not the optimizer, is the peak
        train(
            "compile-full-qwen2.5-0.5b-bf16-sgd",
            QWEN2,
            precision="bf16",
            impl="hf",
            optimizer="sgd",
            compile="default",
            micro_batch=1,
            seq_len=512,
            full_size=True,
            tags=("compile", "full"),
        ),
        _derived("phi3", "fp32"),
        _derived("gemma2", "bf16", precision="bf16"),
        _derived("olmo2", "amp-bf16", precision="amp-bf16"),
        _derived("mixtral", "fp32"),  # MoE: router top-k, experts' grouped matmuls
        _derived("deepseek_v2", "regional-fp32", compile="regional"),  # MLA + shared experts
        _derived("gemma3_text", "bf16", precision="bf16"),
        # each decoder layer compiled on its own (torchtune, torchtitan), the head eager
        train("compile-regional-hf-llama-bf16", LLAMA, precision="bf16", **regional),
        train("compile-regional-hf-qwen2-amp-bf16", QWEN2, precision="amp-bf16", **regional),
        _derived("gemma2", "regional-fp32", compile="regional"),
        # with recomputation (checkpointed random ops: run_and_save_rng_state), LoRA, fp16
        train("compile-hf-llama-recompute-bf16", LLAMA, precision="bf16", recompute="full", **hf),
        train(
            "compile-regional-hf-qwen2-recompute-amp-bf16",
            QWEN2,
            precision="amp-bf16",
            recompute="full",
            **regional,
        ),
        train("compile-hf-llama-lora-bf16", LLAMA, precision="bf16", lora=LoRA(rank=8), **hf),
        train("compile-hf-qwen2-amp-fp16", QWEN2, precision="amp-fp16", **hf),
        train("compile-hf-llama-del-logits-fp32", LLAMA, precision="fp32", loop="del-logits", **hf),
        # 14 layers: recorded as five, the middle ones added (calc.replay.timeline)
        _derived(
            "phi3", "regional-14-layers-bf16", precision="bf16", compile="regional", layers=14
        ),
    ]
