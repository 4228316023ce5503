"""The CUDA side of every CPU/CUDA difference in the replay, pinned to PyTorch's source.

No GPU runs here: each expected value is derived by hand from the source named in the test
(pytorch/pytorch as read through the stored index; the 2.13 wheel's Python files), so a
change in calc's CUDA semantics has to go through one of these derivations.
"""

from __future__ import annotations

import dataclasses

import pytest

import calc
from calc.models import attention_core as AC
from calc.models.attention import attention_kernel, flash_head_pad, kernel_for
from calc.replay import ops
from calc.replay.tape import Tape, Tensor
from calc.step.training import shape_for
from tests.specs import modelled_cards

BF16 = 2
FP32 = 4

GPT2XL = calc.load_card("gpt2-xl")  # attn_pdrop 0.1, 25 heads of 64


# ------------------------------------------------------------------------- kernel choice
@pytest.mark.parametrize(
    ("precision", "cuda_kernel"), [("amp-bf16", "flash"), ("bf16", "flash"), ("fp32", "efficient")]
)
def test_dropout_keeps_the_fused_kernels_on_cuda_and_sends_cpu_to_math(
    precision: str, cuda_kernel: str
) -> None:
    # sdp_utils.cpp (pytorch/pytorch@001f694), select_sdp_backend walks flash, efficient, math;
    # can_use_flash_attention's constraints (check_runtime_disabled_flash ... check_dtypes_flash_
    # attention) never read params.dropout (only the sm86/89/120 head dim (224, 256] rule does),
    # nor do can_use_mem_efficient_attention's. Flash wants fp16/bf16 (autocast hands SDPA bf16),
    # efficient also fp32. CPU: sdp_utils_cpp.h, "Both fused kernels do not support non-zero
    # dropout" -> math.
    job = calc.Training(micro_batch=1, seq_len=64, precision=precision)
    assert GPT2XL.attention_dropout > 0
    assert kernel_for(GPT2XL, job, "cuda", GPT2XL.attention_dropout) == cuda_kernel
    assert kernel_for(GPT2XL, job, "cpu", GPT2XL.attention_dropout) == "math"
    assert kernel_for(GPT2XL, job, "cpu", 0.0) == "flash"
    assert attention_kernel(GPT2XL, job) == cuda_kernel


# ------------------------------------------------------------------------- flash tensors
@pytest.mark.parametrize(
    ("head_dim", "pad"),
    # mha_bwd: head_size = round_multiple(d, 8); head_size_rounded = round_multiple(head_size,
    # head_size <= 128 ? 32 : 64). 64 -> 64; 80 -> 96; 100 -> 104 -> 128; 128 -> 128;
    # 160 -> 192; 200 -> 256; 256 -> 256.
    [(64, 0), (80, 16), (100, 28), (128, 0), (160, 32), (200, 56), (256, 0)],
)
def test_flash_head_pad(head_dim: int, pad: int) -> None:
    assert flash_head_pad(head_dim) == pad


def _live(tape: Tape) -> int:
    return sum(st.size for st in tape.live.values())


def _qkv(tape: Tape, b: int, a: int, k: int, s: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    q = tape.existing(b * s * a * d, BF16, "q", "weight", leaf=True)
    kk = tape.existing(b * s * k * d, BF16, "k", "weight", leaf=True)
    v = tape.existing(b * s * k * d, BF16, "v", "weight", leaf=True)
    return q, kk, v


@pytest.mark.parametrize("dropout", [False, True])
def test_cuda_flash_forward_saves_two_rng_blocks(dropout: bool) -> None:
    # b=1, a=2, k=1 (GQA), s=100, d=64, bf16: out = 12800 * 2 B = 25600 B (50 blocks);
    # softmax_lse [1, 2, 100] fp32 = 800 B -> 1024; mha_fwd then rng_state uint64[2] (16 B ->
    # 512) and _unused uint64[] (8 B -> 512), both returned and saved (philox_seed/offset of the
    # backward); with dropout rng_state = at::empty({2}) again: +512, then the first freed.
    tape = Tape()
    q, k, v = _qkv(tape, 1, 2, 1, 100, 64)
    base = _live(tape)
    cuda = ops.CudaFlash(dropout=dropout, backward_temps=())
    out = ops.sdpa_flash(tape, q, k, v, 1 * 2 * 100, "attn", cuda)
    trace = [(e.label, sum(key[3] * c for key, c in e.live) - base) for e in tape.events]
    expected = [("+attn", 25600), ("+attn.lse", 26624), ("+attn.rng_state", 27136)]
    expected.append(("+attn.rng_unused", 27648))
    if dropout:
        expected += [("+attn.rng_state", 28160), ("-attn.rng_state", 27648)]
    assert trace == expected
    tape.drop(out)  # the output's Python reference dies; the node still saves it
    assert _live(tape) - base == 27648


def test_cuda_flash_backward_temporaries_of_mha_bwd() -> None:
    # Same sizes. mha_bwd: dq (25600 B), dk, dv (12800 B each), softmax_d [1, 2, 128] fp32 =
    # 1024 B, dq_accum [1, 128, 2, 64] fp32 = 65536 B, GQA: dk_expanded, dv_expanded [1, 100, 2,
    # 64] bf16 = 25600 B each; all temporaries freed before the gradients are returned.
    tape = Tape()
    q, k, v = _qkv(tape, 1, 2, 1, 100, 64)
    temps = ((1 * 2 * 128, FP32), (1 * 128 * 2 * 64, FP32), (12800, BF16), (12800, BF16))
    out = ops.sdpa_flash(tape, q, k, v, 200, "attn", ops.CudaFlash(False, temps))
    tape.phase = "backward"
    before = len(tape.events)
    tape.backward(out)
    lives = [sum(key[3] * c for key, c in e.live) for e in tape.events[before:]]
    labels = [e.label for e in tape.events[before:]]
    start = lives[labels.index("+dq")] - 25600  # live bytes just before the rule ran
    assert max(lives) - start == 25600 + 2 * 12800 + 1024 + 65536 + 2 * 25600
    assert labels.count("+attn.bwd_tmp") == 4 and labels.count("-attn.bwd_tmp") == 4


@pytest.mark.parametrize(("device", "lse_bytes"), [("cuda", 2048), ("cpu", 1536)])
def test_efficient_logsumexp_is_padded_to_32_on_cuda(device: str, lse_bytes: int) -> None:
    # _efficient_attention_forward / meta__scaled_dot_product_efficient_attention (2.13 wheel):
    # logsumexp [B, H, ceil(M/32)*32] fp32 when compute_log_sumexp (grad needed). b=1, a=8,
    # s=33: CUDA 8 * 64 * 4 = 2048 B; the CPU flash kernel's [1, 8, 33] fp32 = 1056 B -> 1536.
    # fp32 training picks efficient on CUDA (flash wants 16-bit) for a model without grouped
    # key/value heads (with them, efficient is excluded: test_gqa_fp32_training_runs_math_on_cuda).
    model = calc.load_card("llama-2-7b")
    job = calc.Training(micro_batch=1, seq_len=33, precision="fp32")
    sh = shape_for(model, job, device, 1)
    assert sh.attention == ("efficient" if device == "cuda" else "flash")
    sh = dataclasses.replace(sh, b=1, s=33, a=8, k=8, d=8)
    tape = Tape()
    q = tape.existing(33 * 8 * 8, FP32, "q", "weight", leaf=True)
    k = tape.existing(33 * 8 * 8, FP32, "k", "weight", leaf=True)
    v = tape.existing(33 * 8 * 8, FP32, "v", "weight", leaf=True)
    AC.fused(tape, sh, q, k, v, "attn")
    sizes = {e.label: [key[3] for key, _ in e.live if key[1] == "attn.lse"] for e in tape.events}
    assert sizes["+attn.lse"] == [lse_bytes]


# ------------------------------------------------------------------------- dropout masks
def test_cuda_dropout_mask_is_one_byte_and_made_after_the_output() -> None:
    # aten/src/ATen/native/cuda/Dropout.cu, dropout_cuda: ret = at::empty_like(self) then
    # mask = at::empty_like(self, kBool) (native_dropout, is_fused_kernel_acceptable for CUDA,
    # 0 < p < 1); the mask is saved for native_dropout_backward. x: 1000 fp32 = 4000 B -> 4096;
    # mask 1000 B -> 1024.
    tape = Tape()
    x = tape.existing(1000, FP32, "x", "weight", leaf=True)
    base = _live(tape)
    out = ops.dropout(tape, x, "drop", "cuda")
    trace = [(e.label, sum(key[3] * c for key, c in e.live) - base) for e in tape.events]
    assert trace == [("+drop", 4096), ("+drop.mask", 5120)]
    assert out.itemsize == FP32


# ------------------------------------------------------------------------- whole cards
def _sdpa_or_reference(model: calc.ModelSpec, **kw: object) -> calc.Training:
    """A training job with attention dropout 0.1 that calc replays for ``model``: Hugging
    Face's implementation refuses dropout except GPT-2's, so llama-family cards run the
    reference implementation."""
    job = calc.Training(micro_batch=1, seq_len=1024, precision="bf16", dropout=0.1, **kw)  # type: ignore[arg-type]
    if model.model_type != "gpt2":
        job = calc.Training(
            micro_batch=1, seq_len=1024, precision="bf16", dropout=0.1,
            implementation="reference", **kw,  # type: ignore[arg-type]
        )  # fmt: skip
    return job


def test_gpt2_xl_at_4x1024_is_linear_in_the_sequence_on_cuda() -> None:
    # The case: gpt2-xl, micro-batch 4, 1024 tokens, its own dropout 0.1, amp-bf16.
    # With the fused kernel the s^2 term is gone: the step-2 backward peak grows by the same
    # amount per doubling of tokens (d(2048) = 2 * d(1024), up to the 128-token rounding of
    # flash's backward temporaries), and the CPU tracker's math kernel (s x s probabilities
    # saved, 25 heads * 4 * 1024^2 * 4 B = 400 MiB a layer) is far above.
    def peak(s: int, device: str) -> int:
        job = calc.Training(micro_batch=4, seq_len=s, precision="amp-bf16")
        return calc.estimate(GPT2XL, job, device=device).phases["step2/backward"]

    p1, p2, p4 = (peak(s, "cuda") for s in (1024, 2048, 4096))
    assert abs((p4 - p2) - 2 * (p2 - p1)) <= 0.001 * (p4 - p2)
    assert peak(1024, "cpu") - p1 > 48 * 400 * 2**20  # 48 layers of the probabilities at least


@pytest.mark.parametrize("card", modelled_cards())
def test_cuda_sdpa_training_is_linear_in_s_with_dropout_and_below_eager(card: str) -> None:
    model = calc.load_card(card)
    job = _sdpa_or_reference(model)

    def fwd(s: int, attention: str = "sdpa") -> int:
        est = calc.estimate(
            model, dataclasses.replace(job, seq_len=s, attention=attention), device="cuda"
        )  # type: ignore[arg-type]
        return est.phases["step2/forward"]  # the end of the forward holds every saved tensor

    p1, p2, p4 = fwd(512), fwd(1024), fwd(2048)
    # linear: the second difference vanishes (a quadratic term would make it 2 * (p2 - p1)
    # or more: c*s^2 gives 3cs^2 then 12cs^2)
    assert abs((p4 - p2) - 2 * (p2 - p1)) <= 0.01 * (p4 - p2)
    assert fwd(1024, "eager") > p2


# ------------------------------------------------------------------------- autocast lists
@pytest.mark.parametrize(("device", "held_bytes"), [("cpu", 8192), ("cuda", 18432)])
def test_gpt2_gelu_new_under_autocast_runs_pow_in_fp32_on_cuda_only(
    device: str, held_bytes: int
) -> None:
    # autocast_mode.cpp: pow is on the CUDA key's fp32 list, not on the CPU key's (torch.amp's
    # "autocast op reference"). x: 1024 bf16 (2048 B), fp32 tensors 4096 B.
    # CPU: 0.5*x (2048, kept for the last mul), pow(x) saves x (pre-existing), tanh saves its
    # output (2048), 1+tanh (2048, saved by mul), the result (2048): 8192 B held after.
    # CUDA: x.to(float) (4096, saved by pow), then pow and everything after it in fp32: tanh's
    # output 4096, 1+tanh 4096, the result 4096 (bf16 * fp32), plus 0.5*x 2048: 18432 B.
    from calc.models import hf_gpt2

    tape = Tape()
    tape.autocast_enter(BF16)
    x = tape.existing(1024, BF16, "x", "weight", leaf=True)
    base = _live(tape)
    sh = shape_for(GPT2XL, calc.Training(micro_batch=1, seq_len=8), device, 1)
    out = hf_gpt2.new_gelu(tape, sh, x)
    assert _live(tape) - base == held_bytes
    assert out.itemsize == (FP32 if device == "cuda" else BF16)


def test_gqa_fp32_training_runs_math_on_cuda() -> None:
    # sdp_utils.cpp, can_use_mem_efficient_attention: check_batch_size_and_num_heads_dense<false>
    # (no grouped-query attention); flash is excluded by fp32; so math. Measured on an H200
    # (verify/measurements/): forcing efficient there raised "No available kernel".
    gqa = calc.load_card("qwen2.5-0.5b")  # 14 query heads, 2 key/value heads
    fp32 = calc.Training(micro_batch=1, seq_len=64, precision="fp32", implementation="reference")
    assert attention_kernel(gqa, fp32) == "math"
    assert attention_kernel(gqa, dataclasses.replace(fp32, precision="bf16")) == "flash"
    # torchtune expands k/v before SDPA: same-width heads, efficient stays available
    assert (
        attention_kernel(gqa, dataclasses.replace(fp32, implementation="torchtune")) == "efficient"
    )
    mha = calc.load_card("llama-2-7b")
    assert attention_kernel(mha, fp32) == "efficient"


def test_fsdp_bf16_policy_runs_flash_on_an_fp32_model() -> None:
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16) all-gathers bf16 parameters, so an fp32
    # model's forward (torchtitan's recipe) hands SDPA bf16 query, key and value: flash
    # (check_dtypes_flash_attention accepts them), which saves out and a logsumexp, never the
    # s x s probabilities math saves ([14 heads, 4096, 4096] bf16 = 448 MiB a layer here).
    gqa = calc.load_card("qwen2.5-0.5b")
    job = calc.Training(micro_batch=1, seq_len=4096, precision="fp32", implementation="hf")
    assert attention_kernel(gqa, job, compute_16bit=True) == "flash"
    policy = calc.Parallelism(dp=2, fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32")
    plain = calc.estimate(gqa, job, calc.Parallelism(dp=2, fsdp=True))
    mixed = calc.estimate(gqa, job, policy)
    assert "attention kernel: math" in plain.notes and "attention kernel: flash" in mixed.notes
    assert plain.breakdown["activations/layers/attn.probs"] > 0
    assert "activations/layers/attn.probs" not in mixed.breakdown


def test_kernels_cuda_cannot_run_are_refused_with_the_field() -> None:
    gqa = calc.load_card("qwen2.5-0.5b")
    with pytest.raises(ValueError, match="attention='flash' with precision='fp32'"):
        calc.estimate(gqa, calc.Training(micro_batch=1, seq_len=64, attention="flash",
                                         precision="fp32", implementation="reference"), device="cuda")  # fmt: skip
    with pytest.raises(ValueError, match="attention='efficient' with 14 query and 2"):
        calc.estimate(gqa, calc.Training(micro_batch=1, seq_len=64, attention="efficient",
                                         implementation="reference"), device="cuda")  # fmt: skip
    with pytest.raises(NotImplementedError, match="math prefill is not modelled"):
        calc.estimate(gqa, calc.Inference(batch=1, context=64, precision="fp32",
                                          implementation="reference"), device="cuda")  # fmt: skip
