"""``torch.compile`` cases (``Training(compile="default")``), measured by
`verify.run.compiled` (the profiler's allocation events; the storage tracker's dispatch mode
would make Dynamo run the model eagerly).

Each is an hf training step whose activations outweigh the optimizer step (batch 4 x 128
tokens), so the forward and backward peaks, which the compiled graph changes, decide the peak.
calc refuses ``compile="default"`` (not modelled yet): the record's ``extra`` gives the eager
estimate of the same job next to the compiled measurement.
"""

from __future__ import annotations

from verify.cases.case import LLAMA, QWEN2, Case, train

__all__ = ["compiled_cases"]

_SIZE = {"micro_batch": 4, "seq_len": 128}


def compiled_cases() -> list[Case]:
    """The ``compile-*`` cases."""
    hf = {"impl": "hf", "compile": "default", "tags": ("compile",), **_SIZE}
    return [
        train("compile-hf-llama-fp32", LLAMA, precision="fp32", **hf),
        train("compile-hf-llama-bf16", LLAMA, precision="bf16", **hf),
        train("compile-hf-qwen2-fp32", QWEN2, precision="fp32", **hf),
        train("compile-hf-qwen2-amp-bf16", QWEN2, precision="amp-bf16", **hf),
    ]
