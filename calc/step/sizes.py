"""The value of every size symbol (`calc.symbols`) for one model and job: what a replay's
symbolic sizes are evaluated at, and where size-dependent decisions (8-bit Adam's
``min_8bit_size``) are taken."""

from __future__ import annotations

import sympy as sp

from calc import symbols as S
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec


def values_for(model: ModelSpec, job: Training | Inference) -> dict[sp.Symbol, int]:
    """The value of every symbol for this model and job: ``b``, ``s``, ``c`` from the job
    (training: ``c = s``), the model's dimensions from `ModelSpec.dims`."""
    if isinstance(job, Training):
        b, s, c = job.micro_batch, job.seq_len, job.seq_len
    else:
        b, s, c = job.batch, job.prompt_len, job.context
    vals = {S.b: b, S.s: s, S.c: c}
    vals.update(model.dims())
    return vals
