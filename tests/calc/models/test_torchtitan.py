"""torchtitan's Llama 3 (`calc.models.torchtitan`): its buffer and its loss step by hand, and
what it refuses. The whole step is checked against the CPU tracker by the ``ttn-*`` and
``dist-torchtitan-*`` verify cases (torchtitan 0.2.2's model code, copied in
verify/models/torchtitan_llama.py and compared with the library in
tests/verify/models/test_torchtitan_llama.py)."""

from __future__ import annotations

import dataclasses

import pytest

import calc
from calc.models import reference, torchtitan
from calc.replay.tape import Tape
from calc.step.training import shape_for
from tests.specs import tiny_llama, tiny_llama64

JOB = {"micro_batch": 1, "seq_len": 8, "precision": "fp32", "implementation": "torchtitan",
       "loop": "del-logits"}  # fmt: skip


def _estimate(model: calc.ModelSpec | None = None, parallel: calc.Parallelism | None = None,
              **kw: object) -> calc.Estimate:  # fmt: skip
    job = calc.Training(**{**JOB, **kw})  # type: ignore[arg-type]
    return calc.estimate(model or tiny_llama(), job, parallel, device="cpu")


def _live(tape: Tape) -> list[int]:
    return [sum(key[3] * count for key, count in e.live) for e in tape.events]


def test_freqs_cis_is_complex64_over_the_training_sequence() -> None:
    # One complex64 freqs_cis [seq_len, head_dim / 2] on the root, its rows the training
    # sequence length (update_from_config): 8 x 4 x 8 B = 256 B -> one 512-B block; at 64
    # tokens 64 x 4 x 8 = 2,048 B. The tiny llama's max_positions (64) plays no part.
    assert _estimate().breakdown["buffers"] == 512
    assert _estimate(seq_len=64).breakdown["buffers"] == 2048


@pytest.mark.parametrize(("itemsize", "peak_over_base"), [(2, 9216), (4, 5632)])
def test_loss_upcasts_16_bit_logits_beside_the_log_probabilities(
    itemsize: int, peak_over_base: int
) -> None:
    # 16 rows x 64 classes. bf16 logits (2,048 B) and the 0-d count (512): the fp32 copy
    # (4,096) and the fp32 log-probabilities (4,096) live together, with nll_loss's two 0-d
    # outputs (512 each): 9,216 B over the base, the copy gone before the division. fp32
    # logits are their own ``.float()``: the log-probabilities and the 0-d loss, weight and
    # quotient (the loss dies after the division): 4,096 + 3 x 512 = 5,632 B.
    job = calc.Training(**{**JOB, "micro_batch": 2})  # type: ignore[arg-type]
    sh = dataclasses.replace(shape_for(tiny_llama(), job, "cpu", 2), b=2, s=8, V=64)
    tape = Tape()
    pred = tape.existing(16 * 64, itemsize, "pred", "act", leaf=True)  # needs grad
    count = tape.existing(1, 8, "count", "input")
    base = sum(st.size for st in tape.live.values())
    assert base == 16 * 64 * itemsize + 512
    torchtitan.trainer_loss(tape, sh, pred, count)
    assert max(_live(tape)) - base == peak_over_base


@pytest.mark.parametrize(
    ("change", "parallel", "words"),
    [
        ({"precision": "bf16"}, None, "MixedPrecisionPolicy"),
        ({"precision": "amp-bf16"}, calc.Parallelism(dp=2, fsdp=True), "autocast"),
        ({"loop": "drop-output"}, None, "loop='drop-output'"),
        ({"loss": "chunked-ce"}, None, "loss='chunked-ce'"),
        ({"recompute": "selective"}, None, "whole-block"),
        ({"recompute": "op", "precision": "amp-bf16"}, None, "not under autocast"),
        ({"lora": calc.LoRA(rank=4)}, None, "LoRA"),
        ({}, calc.Parallelism(dp=2, gradient_as_bucket_view=True), "dp_replicate"),
        ({}, calc.Parallelism(dp=2, zero=1), "dp_replicate"),
        ({}, calc.Parallelism(dp=2, zero=1, offload="optimizer"), "CPU offload"),
        ({}, calc.Parallelism(tp=2), "tensor parallelism"),
    ],
)
def test_refuses_what_torchtitan_does_not_run(
    change: dict, parallel: calc.Parallelism | None, words: str
) -> None:
    with pytest.raises(NotImplementedError, match=words):
        _estimate(parallel=parallel, **change)


def test_refuses_biases_and_tied_embeddings() -> None:
    with pytest.raises(NotImplementedError, match="no biases"):
        _estimate(tiny_llama(model_type="qwen2", qkv_bias=True))
    with pytest.raises(NotImplementedError, match="tied"):
        _estimate(tiny_llama(tied_embeddings=True))


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_ddp_holds_one_fp32_bucket_of_every_gradient_in_step_1(precision: str) -> None:
    # apply_ddp replicates the fp32 model (maybe_enable_amp's autocast, or fp32): the tiny
    # llama's parameters are 50 x 16 (embedding) + 2 x (4 x 16 x 16 + 3 x 16 x 24 + 2 x 16)
    # + 16 + 50 x 16 (output) = 6,032 fp32 elements, 24,128 B: one bucket of 48 blocks of
    # 512 B in step 1, beside .grad (gradient_as_bucket_view=False); under 100 MiB, one
    # bucket again after the rebuild.
    est = _estimate(parallel=calc.Parallelism(dp=2), precision=precision)
    assert est.breakdown["ddp/gradient_buckets"] == 48 * 512
    assert "DDP gradient buckets: 1 bucket in step 1, 1 after the rebuild (plus .grad)" in est.notes


def test_ddp_buckets_are_torchtitans_100_mib_unless_a_cap_is_given() -> None:
    # apply_ddp: replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100) (torchtitan 0.2.2,
    # models/llama3/infra/parallelize.py); PyTorch's own default is 25 MiB after a 1 MiB
    # first bucket. Llama-3.1-8B's w1, w2, w3 (224 MiB in fp32) each close a bucket at
    # either cap, but 25 MiB also splits the rest of every block: more buckets.
    assert torchtitan.ddp_parallel(calc.Parallelism(dp=8)).ddp_bucket_mib == 100
    assert torchtitan.ddp_parallel(calc.Parallelism(dp=8, ddp_bucket_mib=25)).ddp_bucket_mib == 25
    model = calc.load_card("llama-3.1-8b")
    job = calc.Training(**{**JOB, "seq_len": 1024})  # type: ignore[arg-type]

    def buckets(parallel: calc.Parallelism) -> str:
        notes = calc.estimate(model, job, parallel).notes
        return next(n for n in notes if n.startswith("DDP gradient buckets"))

    default = buckets(calc.Parallelism(dp=8))
    assert default == buckets(calc.Parallelism(dp=8, ddp_bucket_mib=100))
    assert default != buckets(calc.Parallelism(dp=8, ddp_bucket_mib=25))


def test_fsdp2_policy_runs_flash_and_fp32_alone_runs_math_on_cuda() -> None:
    # torchtitan allows cuDNN, flash and math (no memory-efficient kernel): an fp32 model
    # alone runs math, whose probabilities the estimate notes; under the bf16 policy, flash.
    job = calc.Training(**{**JOB, "seq_len": 64})  # type: ignore[arg-type]
    alone = calc.estimate(tiny_llama(n_kv_heads=2), job, calc.Parallelism(dp=2, fsdp=True))
    assert "attention kernel: math" in alone.notes
    mp = calc.Parallelism(dp=2, fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32")
    assert "attention kernel: flash" in calc.estimate(tiny_llama(), job, mp).notes


def test_op_policy_keeps_sdpa_and_every_other_mm() -> None:
    # A Llama 3 block runs seven mm in this order: wq, wk, wv, wo, w1, w3, w2. The policy
    # keeps the odd ones (wq, wv, w1, w2) and every fused SDPA call, recomputes the rest.
    block = ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    kept = [name for n, name in enumerate(block, 1) if torchtitan.op_policy("mm", n)]
    assert kept == ["wq", "wv", "w1", "w2"]
    assert torchtitan.op_policy("sdpa", 1) and torchtitan.op_policy("sdpa", 2)
    assert not torchtitan.op_policy("addmm", 1)


def _forward_end_bytes(recompute: str, attention: str = "sdpa", every: int = 1) -> int:
    fields = {**JOB, "recompute": recompute, "attention": attention, "recompute_every": every}
    job = calc.Training(**fields)  # type: ignore[arg-type]
    sh = dataclasses.replace(
        shape_for(tiny_llama64(n_layers=4), job, "cpu", 4),
        b=1, s=8, h=64, a=4, k=4, d=16, f=128, V=64,
    )  # fmt: skip
    tape = Tape()
    w = reference.Weights(tape, sh)
    freqs = torchtitan.buffers(tape, sh)
    ids = tape.existing(8, 8, "ids", "input")
    torchtitan.hidden(tape, sh, w, freqs, ids)
    return sum(st.size for st in tape.live.values())


@pytest.mark.parametrize(("attention", "kept_per_block"), [("sdpa", 10_240), ("flash", 12_800)])
def test_op_checkpointing_keeps_every_other_mm_and_the_fused_sdpa_outputs(
    attention: str, kept_per_block: int
) -> None:
    # tiny_llama64 (MHA), 1 x 8 tokens, fp32: per block the kept mm outputs are wq's [8, 64]
    # (2,048 B), wv's [8, 64] (2,048), w1's [8, 128] (4,096) and w2's [8, 64] (2,048):
    # 10,240 B. An fp32 torchtitan model runs SDPA's math kernel (a composite: nothing kept);
    # the flash kernel adds its output [8, 64] (2,048) and logsumexp [1, 4, 8] fp32 (128 B ->
    # 512): 12,800 B. Four blocks, beyond what whole-block checkpointing keeps.
    extra = _forward_end_bytes("op", attention) - _forward_end_bytes("full", attention)
    assert extra == 4 * kept_per_block


def test_layer_frequency_checkpoints_blocks_n_minus_1_2n_minus_1() -> None:
    # _apply_layer_sac counts the blocks from 1 and wraps those whose count is a multiple of
    # n: with n = 2 blocks 1 and 3 (from 0), with n = 3 block 2 of five.
    job = calc.Training(**{**JOB, "recompute": "full", "recompute_every": 2})  # type: ignore[arg-type]
    sh = shape_for(tiny_llama(), job, "cpu", 4)
    assert [torchtitan.layer_checkpointed(sh, j) for j in range(4)] == [False, True, False, True]
    every3 = dataclasses.replace(sh, recompute_every=3)
    assert [torchtitan.layer_checkpointed(every3, j) for j in range(5)] == [0, 0, 1, 0, 0]


def test_every_second_block_checkpointed_keeps_half_the_difference() -> None:
    # The blocks are alike: each block left whole keeps the same activations beyond the input
    # a checkpointed one keeps, so checkpointing two blocks of four keeps exactly half of what
    # no checkpointing keeps beyond full checkpointing.
    full, none = _forward_end_bytes("full"), _forward_end_bytes("none")
    assert none > full
    assert _forward_end_bytes("full", every=2) - full == (none - full) // 2
