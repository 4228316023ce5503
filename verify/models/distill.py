"""A knowledge-distillation step for real: a frozen teacher beside the reference student.

``wrap`` builds the teacher (a `ReferenceLM` of ``job.distill.teacher``, weights in
``teacher_precision``, ``eval()``, ``requires_grad_(False)``) and returns the loss the training
protocol calls instead of the student's own cross entropy::

    with torch.inference_mode():
        t_logits = F.linear(teacher.hidden_states(ids), teacher.head_weight())
    s_logits = F.linear(student.hidden_states(ids), student.head_weight())
    loss = kd_loss(s_logits, t_logits, targets, distill)

``kd_loss`` is Hinton et al.'s soft-target loss as PyTorch users write it (``F.kl_div`` of the
student's log-probabilities against the teacher's probabilities, ``batchmean``, times ``T^2``),
plus ``hard_weight`` times the ordinary cross entropy. `calc.compress.distill` models exactly this.

``torch.inference_mode()`` and ``torch.no_grad()`` allocate the same storages here (neither
saves anything; the teacher's logits, inference tensors, are only read by the loss): every
distillation case measured the same bytes under both (2026-12-02).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from verify.models import compress
from verify.models.reference import ReferenceLM

if TYPE_CHECKING:
    from collections.abc import Callable

    from calc.config.distill import Distill
    from calc.config.jobs import Training

TEACHER_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def kd_loss(
    s_logits: torch.Tensor, t_logits: torch.Tensor, targets: torch.Tensor, d: Distill
) -> torch.Tensor:
    """``T^2 * KL(p_teacher || p_student)`` over the flattened positions (+ hard CE)."""
    temp = d.temperature
    s = s_logits.flatten(0, 1)
    t = t_logits.flatten(0, 1)[:, : s_logits.shape[-1]]  # a larger (padded) vocab: sliced
    if temp != 1:
        s, t = s / temp, t / temp
    logp = F.log_softmax(s, dim=-1)
    del s
    p_t = F.softmax(t, dim=-1)
    del t
    loss = F.kl_div(logp, p_t, reduction="batchmean")
    del logp, p_t
    if temp != 1:
        loss = loss * (temp * temp)
    if d.hard_weight > 0:
        ce = F.cross_entropy(s_logits.flatten(0, 1), targets.flatten())
        loss = loss + d.hard_weight * ce
    return loss


def wrap(
    student: ReferenceLM, job: Training, *, seed: int, device: str = "cpu"
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Build the teacher and return the distillation loss ``(ids, targets) -> loss``."""
    d = job.distill
    torch.manual_seed(seed + 1)
    attention = "eager" if job.attention == "eager" else "sdpa"
    with torch.device(device):
        teacher = ReferenceLM(d.teacher, attention=attention)
    dtype = TEACHER_DTYPE[d.teacher_precision]
    if dtype != torch.float32:
        teacher.to(dtype)
    if d.teacher_quant is not None:  # packed weight-only linears, as for QLoRA's base
        compress.apply(teacher, d.teacher_quant, None, dtype)
    if not d.teacher.learned_positions:
        teacher.set_rope(job.seq_len)
    teacher.eval()
    teacher.requires_grad_(False)

    def loss_fn(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            t_logits = F.linear(teacher.hidden_states(ids), teacher.head_weight())
        s_logits = F.linear(student.hidden_states(ids), student.head_weight())
        return kd_loss(s_logits, t_logits, targets, d)

    loss_fn.teacher = teacher  # type: ignore[attr-defined]
    return loss_fn
