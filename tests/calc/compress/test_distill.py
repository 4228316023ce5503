"""Knowledge distillation in the replay: the teacher's terms on tiny dims, derived by hand here.

Student: `tests/calc/estimate/test_terms.py`'s TINY (llama, h=16, L=2, a=k=2, d=8, f=24, V=50, fp32),
b=1, s=8. Every storage is charged ``r(n) = max(512, ceil(n/512)*512)`` bytes.

Teacher: TINY's shape with 3 layers, in bf16 (2 B):

=======================  =========  ===========
tensor                   bytes      r(bytes)
=======================  =========  ===========
embed_tokens [50, 16]    1600       2048
q, k, v, o [16, 16]      512 each   512 each
gate, up, down 24 x 16   768 each   1024 each
2 layer norms [16]       32 each    512 each
final norm [16]          32         512
lm_head [50, 16]         1600       2048
=======================  =========  ===========

One layer: 4*512 + 3*1024 + 2*512 = 6144; teacher weights 2048 + 3*6144 + 512 + 2048 = 23040.
RoPE tables cos/sin [s=8, d=8] bf16 = 128 B -> 512 each: 1024.
"""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama

TEACHER_WEIGHTS = 23040  # module docstring
TEACHER_ROPE = 1024


_llama = tiny_llama


TINY = _llama()
TEACHER = _llama(n_layers=3, name="tiny-teacher")


def _train(**changes: object) -> calc.Training:
    job = dict(micro_batch=1, seq_len=8, precision="fp32", implementation="reference")
    job.update(changes)
    return calc.Training(**job)  # type: ignore[arg-type]


def test_teacher_weights_and_rope_by_hand() -> None:
    est = calc.estimate(TINY, _train(distill=calc.Distill(teacher=TEACHER)), device="cpu")
    assert est.breakdown["teacher/weights"] == TEACHER_WEIGHTS
    assert est.breakdown["teacher/rope"] == TEACHER_ROPE


def test_teacher_adds_only_its_weights_at_the_optimizer_step() -> None:
    # After the loss the teacher's logits and activations are gone: during the optimizer step
    # the distillation job holds exactly the teacher's weights and RoPE tables more.
    base = calc.estimate(TINY, _train(), device="cpu").phases
    kd = calc.estimate(TINY, _train(distill=calc.Distill(teacher=TEACHER)), device="cpu").phases
    for phase in ("step1/optimizer", "step2/optimizer"):
        assert kd[phase] - base[phase] == TEACHER_WEIGHTS + TEACHER_ROPE


def test_deeper_teacher_adds_its_layer_weights() -> None:
    # Two more teacher layers (replayed as one summed storage): + 2 * 6144 everywhere the
    # teacher's weights are alive, i.e. at every event.
    shallow = calc.estimate(TINY, _train(distill=calc.Distill(teacher=TEACHER)), device="cpu")
    deep = calc.estimate(
        TINY, _train(distill=calc.Distill(teacher=_llama(n_layers=5))), device="cpu"
    )
    assert deep.breakdown["teacher/weights"] == TEACHER_WEIGHTS + 2 * 6144
    assert deep.peak_bytes - shallow.peak_bytes == 2 * 6144


def test_fp32_teacher_weights() -> None:
    # fp32 teacher: embed/lm_head 3200 -> 3584 each; q..o 1024; gate/up/down 1536; norms 512.
    # Layer 4*1024 + 3*1536 + 2*512 = 9728; weights 3584 + 3*9728 + 512 + 3584 = 36864.
    job = _train(distill=calc.Distill(teacher=TEACHER, teacher_precision="fp32"))
    assert calc.estimate(TINY, job, device="cpu").breakdown["teacher/weights"] == 36864


def test_temperature_and_hard_loss_never_cost_less() -> None:
    plain = calc.estimate(TINY, _train(distill=calc.Distill(teacher=TEACHER)), device="cpu")
    hot = calc.estimate(
        TINY, _train(distill=calc.Distill(teacher=TEACHER, temperature=2.0)), device="cpu"
    )
    both = calc.estimate(
        TINY,
        _train(distill=calc.Distill(teacher=TEACHER, temperature=2.0, hard_weight=0.5)),
        device="cpu",
    )
    assert plain.peak_bytes <= hot.peak_bytes <= both.peak_bytes


def test_teacher_is_a_model_spec_not_a_card_id() -> None:
    """The config reads no card: a card id is refused, naming the field and the way to load it."""
    with pytest.raises(ValueError, match=r"teacher='qwen2\.5-32b' must be a calc\.ModelSpec"):
        calc.Distill(teacher="qwen2.5-32b")  # type: ignore[arg-type]
    d = calc.Distill(teacher=calc.load_card("qwen2.5-32b"))
    assert d.teacher.n_params == 32_763_876_352  # the card's published count


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"teacher": 7}, "teacher"),
        ({"teacher": TEACHER, "teacher_precision": "int8"}, "teacher_precision"),
        ({"teacher": TEACHER, "temperature": 0}, "temperature"),
        ({"teacher": TEACHER, "temperature": True}, "temperature"),
        ({"teacher": TEACHER, "hard_weight": -1}, "hard_weight"),
    ],
)
def test_distill_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        calc.Distill(**kwargs)


def test_smaller_teacher_vocab_is_refused() -> None:
    job = _train(distill=calc.Distill(teacher=_llama(vocab=40)))
    with pytest.raises(ValueError, match="vocab"):
        calc.estimate(TINY, job, device="cpu")


def test_larger_teacher_vocab_costs_its_embedding_and_head() -> None:
    # Teacher vocab 64 instead of 50 (bf16): embed and lm_head [64, 16] = 2048 B each, the
    # same rounded bytes as [50, 16] (1600 -> 2048): the teacher's weights do not change;
    # only its logits (sliced to the student's 50 for the loss) are wider.
    wide = _llama(n_layers=3, vocab=64)
    est = calc.estimate(TINY, _train(distill=calc.Distill(teacher=wide)), device="cpu")
    assert est.breakdown["teacher/weights"] == TEACHER_WEIGHTS


@pytest.mark.parametrize(
    "changes",
    [{"implementation": "hf"}, {"precision": "amp-fp16"}],
)
def test_not_modelled_combinations(changes: dict) -> None:
    job = _train(distill=calc.Distill(teacher=TEACHER), **changes)
    with pytest.raises(NotImplementedError):
        calc.estimate(TINY, job, device="cpu")


def test_int8_teacher_weights_by_hand() -> None:
    # int8 weight-only, per-row symmetric with fp32 scales (calc.Quant's int8 default), bf16
    # compute. Each linear: int8 values + one fp32 scale per output row, each rounded to 512:
    # q/k/v/o [16, 16]: 256 B -> 512, 16*4 = 64 B -> 512; gate/up [24, 16]: 384 -> 512,
    # 96 -> 512; down [16, 24]: 384 -> 512, 64 -> 512: 1024 per linear, 7168 per layer,
    # + 2 norms 1024 = 8192; 3 layers 24576 + embed 2048 + final norm 512 + head 2048 = 29184.
    job = _train(distill=calc.Distill(teacher=TEACHER, teacher_quant=calc.Quant(method="int8")))
    assert calc.estimate(TINY, job, device="cpu").breakdown["teacher/weights"] == 29184


def test_compiled_replay_is_not_shared_across_student_vocabularies() -> None:
    # One teacher of vocab 128 over students of vocab 128 (first) and 50 (same structure, so
    # one compiled replay): the teacher's embedding and head stay [128, 16] bf16 = 4096 B each
    # for both; were the teacher's vocabulary the student's symbol, the second would get
    # [50, 16] = 1600 -> 2048 B each.
    teacher = _llama(n_layers=3, vocab=128)
    job = _train(distill=calc.Distill(teacher=teacher))
    wide = calc.estimate(_llama(vocab=128), job, device="cpu")
    narrow = calc.estimate(TINY, job, device="cpu")
    expected = TEACHER_WEIGHTS + 2 * (4096 - 2048)
    assert wide.breakdown["teacher/weights"] == narrow.breakdown["teacher/weights"] == expected


def test_amp_bf16_kl_casts_to_fp32() -> None:
    # Under amp-bf16 the student's logits [8, 50] are bf16 (800 B -> 1024); kl_div casts its
    # input and target to fp32 (1600 B -> 2048 each) before the product, the xlogy and the
    # difference (fp32, 2048 each). So amp-bf16's distillation loss can never be cheaper than
    # its bf16 logits alone would make it: the forward phase holds at least one fp32 cast.
    job = _train(precision="amp-bf16", distill=calc.Distill(teacher=TEACHER))
    est = calc.estimate(TINY, job, device="cpu")
    assert est.breakdown["teacher/weights"] == TEACHER_WEIGHTS
    plain = calc.estimate(TINY, _train(precision="amp-bf16"), device="cpu")
    assert est.phases["step2/forward"] - plain.phases["step2/forward"] >= TEACHER_WEIGHTS + 2048
