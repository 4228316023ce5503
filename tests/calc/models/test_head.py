"""The loop around the model and the loss (`calc.models.head`): by hand on the tiny llama, and
against the CPU tracker on tiny scaled cards (the expected peak is the tracker's measurement of
``verify/models/loops.py``, not a number calc made)."""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama

JOB = {"micro_batch": 1, "seq_len": 8, "precision": "fp32", "implementation": "reference"}


def _phases(**kw: object) -> dict[str, int]:
    return dict(calc.estimate(tiny_llama(), calc.Training(**{**JOB, **kw}), device="cpu").phases)


def test_hold_output_keeps_logits_through_the_optimizer_step() -> None:
    # One sequence of 8 tokens, vocab 50: the reference model's logits [8, 50] fp32 = 1,600 B
    # -> 2,048 in 512-B blocks, alive through the whole first optimizer step, on top of what
    # the plain loop holds there (the reference model returns bare tensors: no object holds
    # the loss).
    drop, hold = _phases(), _phases(loop="hold-output")
    assert hold["step1/optimizer"] - drop["step1/optimizer"] == 2048
    # the first forward is the same: nothing is held yet
    assert hold["step1/forward"] == drop["step1/forward"]


def test_no_optimizer_is_the_first_step_without_states() -> None:
    # Without an optimizer every step is step 1's forward and backward: no states, nothing
    # persists (zero_grad after each step), so step 2 peaks as step 1 does.
    none, adamw = _phases(optimizer=None), _phases()
    assert none["step1/backward"] == adamw["step1/backward"]
    assert none["step2/backward"] == none["step1/backward"]
    assert none["step2/forward"] == none["step1/forward"]
    assert adamw["step2/forward"] > none["step2/forward"]  # AdamW's states live on


def test_del_logits_with_the_reference_cross_entropy_is_the_plain_step() -> None:
    # The reference model's own loss drops its logits before backward too.
    assert _phases(loop="del-logits") == _phases()


def test_optimizer_in_backward_never_holds_every_gradient() -> None:
    # tiny llama, fp32: each gradient is stepped and dropped as soon as it is ready, so at
    # the peak (a step inside the backward) one gradient is alive, the head's or the
    # embedding's: 50x16 fp32 = 3,200 B -> 3,584 in 512-B blocks. The plain loop's peak (its
    # first optimizer step) holds all of them.
    job = calc.Training(**JOB, optimizer_in_backward=True)
    inbwd = calc.estimate(tiny_llama(), job, device="cpu")
    plain = calc.estimate(tiny_llama(), calc.Training(**JOB), device="cpu")
    assert inbwd.peak_phase.endswith("/backward")
    assert inbwd.breakdown["gradients"] == 3584
    assert inbwd.peak_bytes < plain.peak_bytes


def test_refusals_and_validation() -> None:
    with pytest.raises(ValueError, match="optimizer_in_backward=True needs an optimizer"):
        calc.Training(**JOB, optimizer_in_backward=True, optimizer=None)
    with pytest.raises(NotImplementedError, match="with grad_accum=1"):
        calc.estimate(tiny_llama(), calc.Training(**JOB, optimizer_in_backward=True, grad_accum=2))
    with pytest.raises(ValueError, match="loop="):
        calc.Training(**JOB, loop="keep")
    with pytest.raises(ValueError, match="loss_chunks=0"):
        calc.Training(**JOB, loss="chunked-ce", loss_chunks=0)
    with pytest.raises(ValueError, match="optimizer=None with precision='bf16-master'"):
        calc.Training(**{**JOB, "precision": "bf16-master"}, optimizer=None)
    with pytest.raises(ValueError, match="loss_chunks=3 must divide"):
        calc.estimate(tiny_llama(), calc.Training(**JOB, loss="chunked-ce", loss_chunks=3))
    with pytest.raises(NotImplementedError, match="loss='sum' under autocast"):
        calc.estimate(tiny_llama(), calc.Training(**{**JOB, "precision": "amp-bf16"}, loss="sum"))
    # under tp: torchtitan's loop (del-logits, the cross-entropy) alone or in FSDP2's 2-D mesh
    for loop, par in (("hold-output", TP2), ("del-logits", calc.Parallelism(dp=2, tp=2))):
        with pytest.raises(NotImplementedError, match="with tp: tensor parallelism"):
            calc.estimate(tiny_llama(n_heads=2), calc.Training(**JOB, loop=loop), par)
    # under dp the loops are verified on Hugging Face models: verify's reference loops call the
    # model's submodules around the wrapper, and the chunked loss calls the base model
    with pytest.raises(NotImplementedError, match="implementation='hf'"):
        calc.estimate(tiny_llama(), calc.Training(**JOB, loop="hold-output"), DDP2)
    with pytest.raises(NotImplementedError, match="'cross-entropy' or 'sum'"):
        calc.estimate(tiny_llama(), calc.Training(**HF_JOB, loss="chunked-ce"), FSDP2)


DDP2 = calc.Parallelism(dp=2)
TP2 = calc.Parallelism(tp=2)
FSDP2 = calc.Parallelism(dp=2, fsdp=True)
HF_JOB = {**JOB, "implementation": "hf"}


@pytest.mark.parametrize(
    "parallel", [calc.Parallelism(), DDP2, calc.Parallelism(dp=2, zero=1), FSDP2],
    ids=["one-gpu", "ddp", "zero1", "fsdp2"],
)  # fmt: skip
def test_the_held_output_costs_the_same_under_data_parallelism(parallel) -> None:
    # Hugging Face tiny llama, one sequence of 8 tokens, fp32: the held output keeps through
    # the optimizer step the logits [8, 50] (1,600 B -> 2,048), the DynamicCache's k and v of
    # both layers ([2 heads, 8, 8] fp32 = 512 B each, 2,048) and out.loss (0-d, 512): 4,608 B
    # more than the Trainer loop, whatever wraps the model (DDP's buckets, ZeRO's states and
    # FSDP2's shards are there in both loops).
    def phases(**kw: object) -> dict[str, int]:
        job = calc.Training(**HF_JOB, **kw)
        return dict(calc.estimate(tiny_llama(), job, parallel, device="cpu").phases)

    drop, hold = phases(), phases(loop="hold-output")
    assert hold["step1/optimizer"] - drop["step1/optimizer"] == 4608
    assert hold["step2/forward"] - drop["step2/forward"] == 4608
    assert hold["step1/forward"] == drop["step1/forward"]


def test_fsdp2_root_hooks_run_where_the_model_returns() -> None:
    # FSDP2 (2 ranks, reshard_after_forward) on the Hugging Face tiny llama: with the model's
    # own loss, the root's post-forward runs after the loss: it reshards the root (frees its
    # gathered embedding, head and norm) and frees the last all-gather output (the last
    # layer's). Under del-logits the loop's loss runs after the model returned, so both are
    # gone while the fp32 log-probabilities exist: with the forward peak at the loss, it is
    # lower by the [50, 16] fp32 embedding and head (3,200 B -> 3,584 each), the norm (64 B ->
    # 512) and the last layer's flat all-gather output (4x16x16 + 3x16x24 + 2x16 = 2,208 fp32
    # parameters, 8,832 B -> 9,216): 16,896 B.
    def forward_peak(loop: str) -> int:
        job = calc.Training(**{**HF_JOB, "micro_batch": 8, "seq_len": 32}, loop=loop)
        return dict(calc.estimate(tiny_llama(), job, FSDP2, device="cpu").phases)["step1/forward"]

    assert forward_peak("drop-output") - forward_peak("del-logits") == 16896


@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_torchtitan_loop_under_tensor_parallelism(vocab_parallel: bool) -> None:
    # The reference model on tp=2 (tiny llama, 2 heads): its own loss runs the head and the
    # cross-entropy (loss_parallel's on vocabulary shards) in the order the loop does, so
    # del-logits is the plain step. In FSDP2's 2-D mesh (dp=2) the loop's loss runs after the
    # root's post-forward, which frees the root's gathered embedding, head and norm and the last
    # layer's all-gather output: a forward peak at the loss lower by those. Per tp rank, fp32:
    # embedding and head [50, 16] (3,200 B -> 3,584 each; vocabulary-parallel [25, 16], 1,600 B
    # -> 2,048), the norm (64 B -> 512), the layer's q, k, v, o [8, 16] and gate, up, down
    # [12, 16] with its 2 norms (512 + 576 + 32 = 1,120 parameters, 4,480 B -> 4,608).
    def forward_peak(loop: str, parallel: calc.Parallelism) -> int:
        job = calc.Training(**{**JOB, "micro_batch": 8, "seq_len": 32}, loop=loop)
        phases = calc.estimate(tiny_llama(n_heads=2), job, parallel, device="cpu").phases
        return dict(phases)["step1/forward"]

    tp = calc.Parallelism(tp=2, vocab_parallel=vocab_parallel)
    assert forward_peak("del-logits", tp) == forward_peak("drop-output", tp)
    two_d = calc.Parallelism(dp=2, tp=2, fsdp=True, vocab_parallel=vocab_parallel)
    root = 2 * (2048 if vocab_parallel else 3584) + 512
    assert forward_peak("drop-output", two_d) - forward_peak("del-logits", two_d) == root + 4608


torch = pytest.importorskip("torch")

from verify.cases.case import Case, training_job  # noqa: E402
from verify.run.runner import run_case  # noqa: E402

# llama-2-7b / qwen2.5-0.5b / gpt2 scaled to 1 layer, vocab 512: the logits weigh
SCALE = (("layers", 1), ("vocab", 512))
MEASURED = {
    "ref-hold-llama": ("llama-2-7b", {"loop": "hold-output"}),
    "ref-sum-bf16-llama": ("llama-2-7b", {"loss": "sum", "precision": "bf16"}),
    "ref-chunked-bf16-qwen2": ("qwen2.5-0.5b", {"loss": "chunked-ce", "precision": "bf16"}),
    "ref-noopt-gpt2": ("gpt2", {"optimizer": None, "dropout": 0.0}),
    "hf-hold-amp-qwen2": ("qwen2.5-0.5b", {"loop": "hold-output", "precision": "amp-bf16"}),
    "hf-del-logits-llama": ("llama-2-7b", {"loop": "del-logits", "precision": "bf16"}),
    "ref-opt-in-bwd-llama": ("llama-2-7b", {"optimizer_in_backward": True}),
    "hf-opt-in-bwd-bf16-qwen2": ("qwen2.5-0.5b", {"optimizer_in_backward": True,
                                                  "precision": "bf16"}),
    "hf-chunked-hold-gpt2": (
        "gpt2", {"loss": "chunked-ce", "loop": "hold-output", "loss_chunks": 4, "dropout": 0.0}
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_replay_equals_the_cpu_tracker(name: str) -> None:
    card, kw = MEASURED[name]
    impl = "hf" if name.startswith("hf") else "reference"
    job = training_job(impl, micro_batch=2, seq_len=16, **kw)
    case = Case(name=name, card=card, job=job, impl=impl, tolerance_pct=1.0, scale=SCALE)
    rec = run_case(case)
    assert rec.status == "ok", rec.message
    assert rec.predicted_peak == rec.measured_peak
    # without an optimizer step (none, or stepped in the backward) the optimizer phase only
    # frees: no allocation event, hence no predicted phase peak; every phase that allocates
    # agrees to the byte
    no_step = kw.get("optimizer", "") is None or kw.get("optimizer_in_backward", False)
    assert rec.predicted_phases == {
        p: b for p, b in rec.measured_phases.items() if not (no_step and p.endswith("optimizer"))
    }
