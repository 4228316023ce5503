"""The model and job the tensor- and sequence-parallel tests derive their bytes from.

``tp_llama()``: hidden 64, 2 layers, 4 heads of 16 sharing 2 KV heads, ffn 128, vocabulary 64
(`tests.specs.tiny_llama` otherwise): tp = 2 and 4 split every head, KV group and MLP column.
``tp_job()``: one sequence of 8 tokens, fp32, AdamW (for-loop), the reference implementation.
"""

from __future__ import annotations

import calc
from tests.specs import tiny_llama


def tp_llama(**changes: object) -> calc.ModelSpec:
    """The model above, with ``changes`` applied."""
    dims = {"name": "tiny-tp", "hidden": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
            "ffn": 128, "vocab": 64}  # fmt: skip
    return tiny_llama(**{**dims, **changes})


def tp_job(**changes: object) -> calc.Training:
    """The job above, with ``changes`` applied."""
    job = dict(micro_batch=1, seq_len=8, precision="fp32", optimizer="adamw",
               optimizer_impl="for-loop", implementation="reference")  # fmt: skip
    job.update(changes)
    return calc.Training(**job)  # type: ignore[arg-type]
