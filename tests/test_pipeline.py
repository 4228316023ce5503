"""Pipeline parallelism (`calc.pipeline`): schedules, stage ownership, receive buffers.

Model (llama, fp32, untied): h=64, L=2, a=k=4, d=16, f=128, V=64. Parameter bytes, each a
multiple of 512 except the 64-element norms (256 B -> 512):
q/k/v/o [64, 64] 16384 each, gate/up/down [128, 64] 32768 each, two norms 1024:
one layer = 4*16384 + 3*32768 + 1024 = 164864; embed = head = 16384; final norm 512.
On pp=2 each stage holds one layer: stage 0 (embedding) 16384 + 164864 = 181248;
stage 1 (loss) 164864 + 512 + 16384 = 181760.
"""

from __future__ import annotations

import pytest

import calc
from calc import pipeline
from calc.parallel import Parallelism


def _llama(**changes: object) -> calc.ModelSpec:
    base = dict(
        name="tiny-pp", model_type="llama", hidden=64, n_layers=2, n_heads=4, n_kv_heads=4,
        head_dim=16, ffn=128, vocab=64, max_positions=64, mlp="swiglu", norm="rmsnorm",
        qkv_bias=False, o_bias=False, mlp_bias=False, norm_bias=False, qk_norm=False,
        tied_embeddings=False, learned_positions=False, attention_dropout=0.0,
        hidden_dropout=0.0, embedding_dropout=0.0, norm_eps=1e-6, rope_theta=10000.0,
    )  # fmt: skip
    base.update(changes)
    return calc.ModelSpec(**base)  # type: ignore[arg-type]


def _job(**changes: object) -> calc.Training:
    job = dict(micro_batch=4, seq_len=8, precision="fp32", optimizer="adamw",
               optimizer_impl="for-loop", implementation="reference")  # fmt: skip
    job.update(changes)
    return calc.Training(**job)  # type: ignore[arg-type]


def _plan(stage: int, stages: int, m: int, schedule: str) -> pipeline.StagePlan:
    return pipeline.StagePlan(stage=stage, stages=stages, n_layers=1, microbatches=m,
                              schedule=schedule)  # fmt: skip


def test_gpipe_runs_all_forwards_first() -> None:
    # Huang et al. 2019 (GPipe): every micro-batch's forward, then every backward.
    assert pipeline.schedule_actions(_plan(0, 2, 3, "gpipe")) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2),
    ]  # fmt: skip


def test_1f1b_order_of_the_first_stage() -> None:
    # Narayanan et al. 2021 §2.2 (PipeDream-Flush): stage 0 of 2 warms up with 2 forwards,
    # then alternates backward and forward, then drains.
    assert pipeline.schedule_actions(_plan(0, 2, 4, "1f1b")) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3),
    ]  # fmt: skip


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_micro_batches_in_flight(stage: int) -> None:
    # 1F1B: stage r of p holds at most p - r micro-batches; GPipe all m (Narayanan et al.
    # 2021 §2.2: "the first stage stashes p micro-batches").
    assert pipeline.in_flight(_plan(stage, 4, 8, "1f1b")) == 4 - stage
    assert pipeline.in_flight(_plan(stage, 4, 8, "gpipe")) == 8


def test_each_parameter_on_one_stage() -> None:
    res = pipeline.stage_results(_llama(), _job(), Parallelism(pp=2, pp_microbatches=2), "cpu")
    weights = [est.breakdown["weights"] for _, est in res]
    assert weights == [181248, 181760]


def test_first_stage_is_most_loaded_under_1f1b() -> None:
    """Four stages of one layer each, 1F1B with m = 4: stage 0 holds 4 micro-batches of
    activations, stage 3 one; with a small vocabulary (16) the loss stage's logits do not
    make up the difference (Narayanan et al. 2021 §2.2)."""
    model = _llama(n_layers=4, vocab=16)
    par = Parallelism(pp=4, pp_microbatches=4, pp_schedule="1f1b")
    est = calc.estimate(model, _job(seq_len=64), par, device="cpu")
    assert est.rank == 0
    peaks = [est.rank_peaks[r] for r in range(4)]
    assert peaks[0] > peaks[1] > peaks[2]


def test_receive_buffers_grow_with_micro_batches() -> None:
    """``PipelineStage`` allocates a receive buffer per micro-batch (``stage.py``,
    ``_prepare_forward_infra``/``_prepare_backward_infra``): with the micro-batch fixed at one
    sequence, m = 4 instead of m = 2 adds two gradient receive buffers [1, s, h] fp32 to the
    first stage, kept for the run: 2 * 64 * 64 * 4 = 32768 B in the optimizer step, where no
    activation is left. (The token ids and targets, 4 x 64 x 8 B = 2048 B instead of 1024 B,
    add 2 x 1024 B more.)"""
    model = _llama()
    peaks = {}
    for m in (2, 4):
        par = Parallelism(pp=2, pp_microbatches=m, pp_schedule="1f1b")
        res = pipeline.stage_results(model, _job(micro_batch=m, seq_len=64), par, "cpu")
        peaks[m] = res[0][1].phases["step2/optimizer"]
    assert peaks[4] - peaks[2] == 32768 + 2048


def test_microbatches_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="pp_microbatches=3"):
        calc.estimate(_llama(), _job(), Parallelism(pp=2, pp_microbatches=3), device="cpu")


def test_interleaved_is_named_not_modelled() -> None:
    par = Parallelism(pp=2, pp_microbatches=2, pp_schedule="interleaved-1f1b",
                      pp_virtual_stages=2)  # fmt: skip
    with pytest.raises(NotImplementedError, match="interleaved"):
        calc.estimate(_llama(n_layers=4), _job(), par, device="cpu")


@pytest.mark.parametrize("m", [2, 4])
def test_1f1b_never_above_gpipe(m: int) -> None:
    """Narayanan et al. 2021 §2.2: 1F1B stashes at most pp - r micro-batches where GPipe
    stashes all m; everything else a stage holds is the same, so no stage peaks higher."""
    model = _llama(n_layers=4)
    job = _job(micro_batch=m, seq_len=32)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        par = Parallelism(pp=2, pp_microbatches=m, pp_schedule=schedule)
        peaks[schedule] = calc.estimate(model, job, par, device="cpu").rank_peaks
    for rank in (0, 1):
        assert peaks["1f1b"][rank] <= peaks["gpipe"][rank]
    if m > 2:  # more micro-batches than stages: 1F1B strictly lighter on the first stage
        assert peaks["1f1b"][0] < peaks["gpipe"][0]
