"""Knowledge distillation: a frozen teacher beside the trained student (the config).

``calc.Training(..., distill=calc.Distill(teacher=calc.load_card("qwen2.5-7b")))``: each
micro-batch first runs the teacher's forward under ``torch.inference_mode()`` (weights in
``teacher_precision``, no gradients, no optimizer states, no saved activations), holds its
logits, then runs the student and the loss of Hinton et al. 2015 ("Distilling the Knowledge in
a Neural Network", arXiv 1503.02531, §2):
``T^2 * KL(softmax(teacher/T) || softmax(student/T))`` as
``F.kl_div(F.log_softmax(s/T), F.softmax(t/T), reduction="batchmean") * T*T``, plus
``hard_weight * cross_entropy(student, targets)`` when ``hard_weight > 0``. The replay of these
tensors is `calc.compress.distill`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from calc.config.compression import Quant
from calc.config.model_spec import ModelSpec

TeacherPrecision = Literal["fp32", "bf16", "fp16"]
TEACHER_PRECISIONS: tuple[str, ...] = get_args(TeacherPrecision)
TEACHER_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
MAX_TEMPERATURE = 1000.0
"""Largest distillation temperature accepted (guards typos)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Distill:
    """A frozen teacher whose softened logits the student learns from."""

    teacher: ModelSpec
    """The teacher model (any size; its vocabulary covers the student's); a model card is read
    with ``calc.load_card(id)`` first (the CLI's ``--teacher`` and the app do that)."""
    teacher_precision: TeacherPrecision = "bf16"
    """Dtype of the teacher's weights and forward: ``fp32``, ``bf16`` or ``fp16``."""
    temperature: float = 1.0
    """Softmax temperature ``T`` > 0; ``T != 1`` divides both logits first (two more
    logits-sized tensors) and scales the loss by ``T^2``."""
    hard_weight: float = 0.0
    """Weight of the ordinary cross entropy on the targets added to the distillation loss;
    0 (default) trains on the soft targets only."""
    teacher_quant: Quant | None = None
    """Weight-only quantization of the teacher's decoder linears (``calc.Quant``: int8, int4,
    nf4, fp8), computing in ``teacher_precision``; ``None`` keeps them dense."""

    def __post_init__(self) -> None:
        if not isinstance(self.teacher, ModelSpec):
            raise ValueError(
                f"teacher={self.teacher!r} must be a calc.ModelSpec (e.g. calc.load_card(id))"
            )
        if self.teacher_precision not in TEACHER_PRECISIONS:
            raise ValueError(
                f"teacher_precision={self.teacher_precision!r} is not one of {TEACHER_PRECISIONS}"
            )
        if self.teacher_quant is not None and not isinstance(self.teacher_quant, Quant):
            raise ValueError(f"teacher_quant={self.teacher_quant!r} must be a calc.Quant or None")
        for field, value, low_open in (
            ("temperature", self.temperature, True),
            ("hard_weight", self.hard_weight, False),
        ):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or (value <= 0 if low_open else value < 0) or value > MAX_TEMPERATURE:
                bound = "(0" if low_open else "[0"
                raise ValueError(f"{field}={value!r} must be a number in {bound}, 1000]")

    def check_student(self, student: ModelSpec) -> None:
        """Raise ``ValueError`` unless the teacher can teach ``student``: its vocabulary must
        cover the student's (a larger, padded one is sliced: ``t_logits[..., :V_student]``,
        as for Qwen2.5-7B's 152,064 rows over Qwen2.5-0.5B's 151,936)."""
        if self.teacher.vocab < student.vocab:
            raise ValueError(
                f"teacher vocab={self.teacher.vocab} is smaller than the student's "
                f"vocab={student.vocab}: the teacher must score every student token"
            )
