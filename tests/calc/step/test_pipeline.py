"""Pipeline parallelism (`calc.step.pipeline`): schedules, stage ownership, receive buffers.

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
from calc.config.parallelism import Parallelism
from calc.estimate import core
from calc.estimate.stages import stage_results
from calc.step import pipeline
from tests.specs import tiny_llama64, tiny_training


def _llama(**changes: object) -> calc.ModelSpec:
    return tiny_llama64(**{"name": "tiny-pp", **changes})


def _job(**changes: object) -> calc.Training:
    return tiny_training(**{"micro_batch": 4, **changes})


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
    res = stage_results(_llama(), _job(), Parallelism(pp=2, pp_microbatches=2), "cpu")
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
        res = stage_results(model, _job(micro_batch=m, seq_len=64), par, "cpu")
        peaks[m] = res[0][1].phases["step2/optimizer"]
    assert peaks[4] - peaks[2] == 32768 + 2048


def test_microbatches_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="pp_microbatches=3"):
        calc.estimate(_llama(), _job(), Parallelism(pp=2, pp_microbatches=3), device="cpu")
    # more micro-batches than sequences: named as such, not as a micro-batch of 0 sequences
    with pytest.raises(ValueError, match="pp_microbatches=4 must divide micro_batch=1"):
        par = Parallelism(pp=2, pp_microbatches=4)
        calc.estimate(_llama(), _job(micro_batch=1), par, device="cpu")


def _iplan(rank: int, pp: int, v: int, m: int) -> pipeline.StagePlan:
    return pipeline.StagePlan(stage=rank, stages=pp, n_layers=v, microbatches=m,
                              schedule="interleaved-1f1b", virtual=v)  # fmt: skip


def test_interleaved_order_pp2_v2_m4() -> None:
    """Derived by hand from torch 2.13 ``ScheduleInterleaved1F1B`` (``_get_warmup_ops``,
    ``_get_1f1b_rank_ops``): rounds = max(1, 4 // 2) = 2, 2 micro-batches per round.
    Rank 0: warm-up (2 - 1) * 2 + 2 * (2 - 1 - 0) = 4 forwards, chunk (op // 2) % 2 =
    0, 0, 1, 1; ops 4..7 a forward (chunks 0, 0, 1, 1) then a backward (chunk
    1 - ((op - 4) // 2) % 2 = 1, 1, 0, 0); cooldown ops 8..11 backwards on chunks 1, 1, 0, 0.
    Rank 1: warm-up 2 forwards (chunk 0), ops 2..7 forward chunks 1, 1, 0, 0, 1, 1 and backward
    chunks 1, 1, 0, 0, 1, 1, cooldown 2 backwards on chunk 0. Tuples: (kind, micro-batch of
    that chunk, local chunk)."""
    assert pipeline.interleaved_actions(_iplan(0, 2, 2, 4)) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
        ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1),
        ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0),
        ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0),
    ]  # fmt: skip
    assert pipeline.interleaved_actions(_iplan(1, 2, 2, 4)) == [
        ("F", 0, 0), ("F", 1, 0),
        ("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1),
        ("F", 2, 0), ("B", 0, 0), ("F", 3, 0), ("B", 1, 0),
        ("F", 2, 1), ("B", 2, 1), ("F", 3, 1), ("B", 3, 1),
        ("B", 2, 0), ("B", 3, 0),
    ]  # fmt: skip


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("rounds", [2, 4])
def test_interleaved_in_flight_matches_published_factor(pp: int, v: int, rounds: int) -> None:
    """Narayanan et al. 2021 §2.2 / Korthikanti et al. 2022 §4.2.3 (memory-facts.md §2.5):
    interleaving multiplies the first stage's activation memory of 1F1B (pp micro-batches of
    its L/pp layers) by 1 + (pp - 1) / (pp v). In chunk micro-batches (each L/(pp v) layers):
    pp v (1 + (pp - 1) / (pp v)) = pp v + pp - 1. Applies when the warm-up is not capped
    (m a multiple of pp, m >= 2 pp)."""
    plan = _iplan(0, pp, v, rounds * pp)
    assert pipeline.in_flight(plan) == pp * v + pp - 1


def test_interleaved_each_chunk_runs_every_micro_batch_once() -> None:
    for rank in range(4):
        acts = pipeline.interleaved_actions(_iplan(rank, 4, 2, 8))
        for kind in "FB":
            for k in range(2):
                assert [i for x, i, c in acts if x == kind and c == k] == list(range(8))
        # a backward never runs before its forward
        seen = set()
        for x, i, c in acts:
            if x == "F":
                seen.add((i, c))
            else:
                assert (i, c) in seen


def test_interleaved_chunk_ownership() -> None:
    """Loop placement: rank r holds stages r, r + pp; the embedding and one layer on rank 0
    (stage 0) and one layer (stage 2): 16384 + 2 * 164864 = 346112 B; rank 1 (stages 1, 3) two
    layers, the final norm and the head: 2 * 164864 + 512 + 16384 = 346624 B."""
    par = Parallelism(pp=2, pp_microbatches=2, pp_schedule="interleaved-1f1b",
                      pp_virtual_stages=2)  # fmt: skip
    res = stage_results(_llama(n_layers=4), _job(), par, "cpu")
    assert [est.breakdown["weights"] for _, est in res] == [346112, 346624]
    plan = pipeline.stage_plans(_llama(n_layers=4), _job(), par)[1]
    assert [plan.chunk_index(k) for k in range(2)] == [1, 3]
    assert plan.chunk_last(1) and not plan.chunk_first(0)


def test_interleaved_layers_must_divide_by_chunks() -> None:
    par = Parallelism(pp=2, pp_microbatches=2, pp_schedule="interleaved-1f1b",
                      pp_virtual_stages=2)  # fmt: skip
    with pytest.raises(ValueError, match="n_layers=6 must be a multiple of"):
        calc.estimate(_llama(n_layers=6), _job(), par, device="cpu")


def test_interleaved_microbatches_multiple_of_pp() -> None:
    with pytest.raises(ValueError, match="pp_microbatches=3"):
        par = Parallelism(pp=2, pp_microbatches=3, pp_schedule="interleaved-1f1b",
                          pp_virtual_stages=2)  # fmt: skip
        calc.estimate(_llama(n_layers=4), _job(micro_batch=3), par, device="cpu")


def test_interleaved_more_in_flight_than_1f1b() -> None:
    """Same model, pp=2, m=4: interleaving (v=2) keeps 5 chunk micro-batches of 1 layer on
    rank 0 where 1F1B keeps 2 micro-batches of 2 layers (4 layers' worth), and every sent
    tensor is held to the end of the step: rank 0 peaks higher."""
    model, job = _llama(n_layers=4), _job(seq_len=64)
    one = calc.estimate(model, job, Parallelism(pp=2, pp_microbatches=4), device="cpu")
    inter = calc.estimate(model, job, Parallelism(pp=2, pp_microbatches=4, pp_virtual_stages=2,
                                                  pp_schedule="interleaved-1f1b"), device="cpu")  # fmt: skip
    assert inter.rank_peaks[0] > one.rank_peaks[0]


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


@pytest.mark.parametrize(
    ("stage", "stages", "m", "schedule", "held"),
    [
        (0, 2, 4, "1f1b", 0),  # w = 2: the send of micro-batch 0 is the last one fired
        (1, 2, 4, "1f1b", None),  # the last stage sends no activation
        (0, 4, 4, "1f1b", 2),  # w = 4: sends of 0, 1, 2 fired, the Work of 2 kept
        (2, 4, 4, "1f1b", 0),
        (0, 4, 1, "1f1b", None),  # w = 1: the warm-up fires no send
        (0, 2, 4, "gpipe", None),
    ],
)
def test_warmup_send_kept_by_its_work(
    stage: int, stages: int, m: int, schedule: str, held: int | None
) -> None:
    # Schedule1F1B._step_microbatches (torch 2.13): warm-up forward k fires its send unless
    # k == w - 1, and send_work is replaced only after the 1B1F loop, so the Work of forward
    # w - 2 is the one still referenced.
    assert pipeline._warmup_send(_plan(stage, stages, m, schedule)) == held


def test_warmup_send_costs_one_stage_output_on_the_first_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # pp=2, m=4, stage 0: micro-batch 0's output [b/m, s, h] = [1, 64, 64] fp32 = 16384 B is
    # still held by the warm-up's Work while micro-batch 2 runs its forward after B0.
    par = Parallelism(pp=2, pp_schedule="1f1b", pp_microbatches=4)
    job = _job(micro_batch=4, seq_len=64, optimizer="sgd")
    held = stage_results(_llama(), job, par, "cpu")[0][1].phases["step2/forward"]
    monkeypatch.setattr(pipeline, "_warmup_send", lambda plan: None)
    core._compile.cache_clear()  # replay again without the kept Work
    core.compiled_for.cache_clear()
    try:
        free = stage_results(_llama(), job, par, "cpu")[0][1].phases["step2/forward"]
    finally:
        core._compile.cache_clear()
        core.compiled_for.cache_clear()
    assert held - free == 1 * 64 * 64 * 4


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputation_inside_stages_lowers_the_forward_peak(recompute: str) -> None:
    par = Parallelism(pp=2, pp_schedule="gpipe", pp_microbatches=4)
    job = _job(micro_batch=4, seq_len=64, optimizer="sgd", attention="eager")
    plain = stage_results(_llama(), job, par, "cpu")[0][1].phases["step2/forward"]
    again = stage_results(
        _llama(),
        _job(micro_batch=4, seq_len=64, optimizer="sgd", attention="eager", recompute=recompute),
        par,
        "cpu",
    )
    assert again[0][1].phases["step2/forward"] < plain


def test_amp_fp16_under_pipeline_is_refused_by_name() -> None:
    par = Parallelism(pp=2, pp_microbatches=2)
    with pytest.raises(NotImplementedError, match="amp-fp16"):
        stage_results(_llama(), _job(precision="amp-fp16"), par, "cpu")


def test_ddp_around_each_stage_adds_one_flat_bucket_of_its_gradients() -> None:
    # Stage 0 holds the embedding [64, 64] and one layer (4 x [64, 64] + 3 x [128, 64] + two
    # norms [64]): 4096 + 41088 = 45184 fp32 gradients = 180736 B, all below DDP's 1 MiB
    # first-bucket cap: one bucket in step 1 and one after the rebuild.
    job = _job(micro_batch=4, seq_len=64, optimizer="sgd")
    alone = calc.estimate(_llama(), job, Parallelism(pp=2, pp_microbatches=2))
    ddp = calc.estimate(_llama(), job, Parallelism(pp=2, dp=2, pp_microbatches=2))
    assert set(ddp.rank_peaks) == {0, 1, 2, 3}  # mesh [dp, pp]: stage 0 on ranks 0 and 2
    assert ddp.rank_peaks[0] == ddp.rank_peaks[2]
    assert ddp.rank_peaks[0] - alone.rank_peaks[0] == 180736


def test_ddp_stages_refuse_what_is_not_replayed() -> None:
    job = _job(micro_batch=4)
    for par in (
        Parallelism(pp=2, dp=2, pp_microbatches=2, gradient_as_bucket_view=True),
        Parallelism(pp=2, dp=2, tp=2, pp_microbatches=2),
        Parallelism(pp=2, dp=2, pp_schedule="interleaved-1f1b", pp_microbatches=2,
                    pp_virtual_stages=2),
    ):  # fmt: skip
        with pytest.raises(NotImplementedError):
            calc.estimate(_llama(n_layers=4), job, par)
