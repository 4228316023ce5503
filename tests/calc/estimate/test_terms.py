"""`calc.estimate`, one memory term per test, on tiny models with the bytes derived by hand.

Every storage is charged ``r(n) = max(512, ceil(n/512)*512)`` bytes (``r(0) = 0``). fp32 is 4 B
per element, bf16 2 B, token ids int64 8 B.

TINY (llama, h=16, L=2, a=k=2, d=8, f=24, V=50), parameter tensors in fp32:

=======================  ===========  =========  ===========
tensor                   elements     bytes      r(bytes)
=======================  ===========  =========  ===========
embed_tokens [50, 16]    800          3200       3584
q, k, v, o [16, 16]      256 each     1024       1024 each
gate, up [24, 16]        384 each     1536       1536 each
down [16, 24]            384          1536       1536
2 layer norms [16]       16 each      64         512 each
final norm [16]          16           64         512
lm_head [50, 16]         800          3200       3584
=======================  ===========  =========  ===========

One layer: 4*1024 + 3*1536 + 2*512 = 9728; W = 3584 + 2*9728 + 512 + 3584 = 27136 B.

A reference-implementation training job of b=1, s=8 also holds, for the whole step, its inputs
``input_ids`` and ``targets`` (b*s*8 = 64 B -> 512 each) and the RoPE tables ``cos``/``sin``
[s, d] in the weights' dtype (8*8*4 = 256 B -> 512 each): BASE = 2048 B. The ``hf`` step also
holds ``input_ids`` and ``labels`` (512 each) but builds its RoPE tables inside the forward;
instead it holds ``LlamaRotaryEmbedding``'s ``inv_freq`` and ``original_inv_freq`` buffers,
fp32 [d/2] = 16 B -> 512 each: 2048 B as well.
"""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama

MIB = 1 << 20


_llama = tiny_llama


TINY = _llama()
W_TINY = 27136  # module docstring
BASE_REFERENCE = 2048  # ids 512 + targets 512 + cos 512 + sin 512
BASE_HF = 2048  # ids 512 + labels 512 + inv_freq 512 + original_inv_freq 512
N_TENSORS_TINY = 1 + 2 * 9 + 1 + 1  # embed, 9 per layer, final norm, lm_head


def _train(**changes: object) -> calc.Training:
    job = dict(micro_batch=1, seq_len=8, precision="fp32", implementation="reference")
    job.update(changes)
    return calc.Training(**job)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ weights


def test_weights_are_the_sum_of_rounded_param_tensors() -> None:
    est = calc.estimate(TINY, _train(), device="cpu")
    bd = est.breakdown
    assert bd["weights"] == W_TINY
    assert bd["weights/embedding"] == 3584
    assert bd["weights/layers"] == 2 * 9728
    assert bd["weights/head"] == 512 + 3584  # final norm + lm_head


def test_weights_in_bf16_round_each_tensor() -> None:
    # bf16: embed 1600 B -> 2048; q,k,v,o 512 each; gate/up/down 768 -> 1024 each;
    # norms 32 B -> 512 each. Layer: 4*512 + 3*1024 + 2*512 = 6144.
    # W = 2048 + 2*6144 + 512 + 2048 = 16896.
    est = calc.estimate(TINY, _train(precision="bf16"), device="cpu")
    assert est.breakdown["weights"] == 16896


def test_tied_embeddings_hold_one_matrix() -> None:
    # No lm_head: W = 3584 + 2*9728 + 512 = 23552.
    est = calc.estimate(_llama(tied_embeddings=True), _train(), device="cpu")
    assert est.breakdown["weights"] == 23552
    assert est.breakdown["weights/head"] == 512


def test_qkv_bias_adds_three_rounded_tensors_per_layer() -> None:
    # q/k/v biases [16] fp32: 64 B -> 512 each, 3 per layer, 2 layers: +3072 over TINY.
    est = calc.estimate(_llama(qkv_bias=True), _train(), device="cpu")
    assert est.breakdown["weights"] == W_TINY + 3072


# ------------------------------------------------------------------------------ optimizer


@pytest.mark.parametrize(
    ("implementation", "base"), [("reference", BASE_REFERENCE), ("hf", BASE_HF)]
)
def test_adamw_foreach_first_step_peak(implementation: str, base: int) -> None:
    # At the first optimizer step AdamW (foreach, fp32) holds: weights W, grads W (each
    # rounded like its param), exp_avg W, exp_avg_sq W, and the _foreach_sqrt(exp_avg_sqs)
    # temporary W: 5W + the inputs.
    est = calc.estimate(
        TINY, _train(optimizer="adamw", implementation=implementation), device="cpu"
    )
    assert est.phases["step1/optimizer"] == 5 * W_TINY + base  # 137728 for reference
    assert est.peak_bytes == est.phases["step1/optimizer"]
    bd = est.breakdown
    assert bd["gradients"] == W_TINY
    assert bd["optimizer/exp_avg"] == W_TINY
    assert bd["optimizer/exp_avg_sq"] == W_TINY
    assert bd["temporaries/adam_sqrt"] == W_TINY


def test_adamw_states_of_bf16_params_are_bf16() -> None:
    # A model whose every tensor is a multiple of 256 elements (512 B in bf16): no rounding.
    # llama h=256, L=1, a=k=2, d=128, f=256, V=256: embed, lm_head, q, k, v, o, gate, up, down
    # are 65536 elements each (9 * 65536 = 589824) plus three norms of 256: 590592 params.
    # bf16: W = 2 * 590592 = 1181184 B; exp_avg and exp_avg_sq 2 B/param each, like W.
    # fp32: everything 4 B/param.
    model = _llama(hidden=256, n_layers=1, head_dim=128, ffn=256, vocab=256)
    params = 9 * 65536 + 3 * 256
    for precision, itemsize in (("bf16", 2), ("fp32", 4)):
        est = calc.estimate(model, _train(precision=precision), device="cpu")
        bd = est.breakdown
        assert bd["weights"] == itemsize * params
        assert bd["optimizer/exp_avg"] == itemsize * params
        assert bd["optimizer/exp_avg_sq"] == itemsize * params
        # inputs: ids, targets 512 each; cos/sin [8, 128] * itemsize: 2048 (bf16), 4096 (fp32)
        base = 1024 + 2 * max(512, 8 * 128 * itemsize)
        assert est.phases["step1/optimizer"] == 5 * itemsize * params + base


def test_adamw_fused_has_no_sqrt_temporary_but_device_steps() -> None:
    # fused: _fused_adamw_ updates in place; each param gets a 0-d fp32 device `step` (512 B):
    # 4W + 21 * 512 + BASE = 108544 + 10752 + 2048 = 121344.
    est = calc.estimate(TINY, _train(optimizer_impl="fused"), device="cpu")
    assert est.phases["step1/optimizer"] == 4 * W_TINY + N_TENSORS_TINY * 512 + BASE_REFERENCE
    assert not any(key.startswith("temporaries/adam_sqrt") for key in est.breakdown)


def test_adamw_for_loop_holds_one_denominator_pair() -> None:
    # _single_tensor_adam, per param i: sqrt_i (r_i), denom_i (r_i), then sqrt_i and
    # denom_{i-1} freed. Peak at denom_i: 4W + r_{i-1} + 2 r_i, largest at the last param
    # (lm_head 3584 after the final norm 512): 512 + 2*3584 = 7680 (the embedding, first,
    # gives 2*3584 = 7168). 4W + 7680 + BASE = 108544 + 7680 + 2048 = 118272.
    est = calc.estimate(TINY, _train(optimizer_impl="for-loop"), device="cpu")
    assert est.phases["step1/optimizer"] == 4 * W_TINY + 7680 + BASE_REFERENCE


@pytest.mark.parametrize(
    ("optimizer", "state_bytes"),
    [
        ("sgd", 0),  # no state
        ("sgd-momentum", W_TINY),  # momentum_buffer
        ("lion", W_TINY),  # exp_avg
        ("adam", 2 * W_TINY),  # exp_avg, exp_avg_sq
        ("adamw", 2 * W_TINY),
        # bitsandbytes keeps fp32 state1/state2 for params under 4096 elements (all of TINY's:
        # the largest, embed/lm_head, has 800), each r(4n) like the fp32 param: 2W.
        ("adam8bit", 2 * W_TINY),
    ],
)
def test_persistent_states_are_alive_through_the_second_forward(
    optimizer: str, state_bytes: int
) -> None:
    # Grads are freed by zero_grad after each step, so the second forward is the first one
    # plus the states the first step created, byte for byte.
    est = calc.estimate(TINY, _train(optimizer=optimizer), device="cpu")
    assert est.phases["step2/forward"] - est.phases["step1/forward"] == state_bytes


def test_sgd_without_momentum_has_no_states() -> None:
    est = calc.estimate(TINY, _train(optimizer="sgd"), device="cpu")
    assert not any(key.startswith("optimizer") for key in est.breakdown)
    # Nothing is allocated at the step: it cannot be the peak.
    assert est.phases.get("step1/optimizer", 0) <= est.phases["step1/backward"]
    assert est.peak_phase.endswith("/backward") or est.peak_phase.endswith("/forward")


# ------------------------------------------------------------------------------ KV cache


# GQA llama: h=32, L=3, a=4, k=2, d=8, f=48, V=64.
KV_MODEL = _llama(hidden=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, ffn=48, vocab=64)


@pytest.mark.parametrize(
    ("batch", "context", "prompt", "precision", "expected"),
    [
        # per tensor b*k*c*d*itemsize = 2*2*16*8*2 = 1024 B (no rounding); 2 tensors * 3 layers
        (2, 16, None, "bf16", 2 * 3 * 1024),
        # the cache is sized by the context, not the prompt
        (2, 16, 4, "bf16", 2 * 3 * 1024),
        # 1*2*5*8*2 = 160 B -> 512 per tensor
        (1, 5, None, "bf16", 2 * 3 * 512),
        # fp32: 3*2*7*8*4 = 1344 B -> 1536 per tensor
        (3, 7, None, "fp32", 2 * 3 * 1536),
    ],
)
def test_kv_cache_is_two_rounded_tensors_per_layer(
    batch: int, context: int, prompt: int | None, precision: str, expected: int
) -> None:
    job = calc.Inference(
        batch=batch, context=context, prompt=prompt, precision=precision,
        implementation="reference",
    )  # fmt: skip
    est = calc.estimate(KV_MODEL, job, device="cpu")
    assert est.breakdown["kv_cache"] == expected
    assert est.peak_phase == "prefill"


def test_kv_cache_grows_by_exact_bytes_with_context() -> None:
    # Doubling c from 16 to 32 at b=2 adds 2*L*b*k*16*d*2 = 2*3*2*2*16*8*2 = 6144 B of cache
    # (each of the 6 tensors goes from 1024 to 2048 B).
    short = calc.Inference(batch=2, context=16, prompt=4, implementation="reference")
    long = calc.Inference(batch=2, context=32, prompt=4, implementation="reference")
    a = calc.estimate(KV_MODEL, short, device="cpu").breakdown["kv_cache"]
    b = calc.estimate(KV_MODEL, long, device="cpu").breakdown["kv_cache"]
    assert b - a == 6144


# ------------------------------------------------------------------------------ logits


def _logits_model(vocab: int) -> calc.ModelSpec:
    return _llama(hidden=16, n_layers=1, ffn=16, vocab=vocab)


def test_logits_backward_peak_holds_three_fp32_vocab_tensors() -> None:
    # b=2, s=32: N = 64 rows, V = 4096: one fp32 [N, V] tensor is 64*4096*4 = 1 MiB (no
    # rounding). In backward, NllLossBackward allocates its [N, V] gradient (dlogp) while the
    # log-softmax output (saved) is alive; then LogSoftmaxBackward allocates dlogits: 3 MiB.
    # SGD (no states) keeps the optimizer step small, so that is the peak.
    job = _train(micro_batch=2, seq_len=32, optimizer="sgd")
    est = calc.estimate(_logits_model(4096), job, device="cpu")
    assert est.peak_phase == "step1/backward"
    assert est.peak_event == "dlogits"
    bd = est.breakdown
    assert bd["activations/head/logp"] == MIB
    assert bd["temporaries/dlogp"] == MIB
    assert bd["temporaries/dlogits"] == MIB


@pytest.mark.parametrize(
    ("precision", "per_4096_vocab"),
    [
        # fp32: embed and lm_head [V, 16] fp32 (+262144 B each per 4096 rows) and the three
        # fp32 [N, V] tensors (+1 MiB each): 2*262144 + 3*1048576 = 3670016.
        ("fp32", 2 * 262144 + 3 * MIB),
        # amp-bf16: the same, plus lm_head's bf16 cast saved by its matmul (+131072 B); the
        # bf16 logits themselves died in the forward (their fp32 copy feeds cross_entropy).
        ("amp-bf16", 2 * 262144 + 131072 + 3 * MIB),
    ],
)
def test_logits_term_grows_with_vocab_as_derived(precision: str, per_4096_vocab: int) -> None:
    # The backward peak as V goes 4096 -> 8192 at N = 64, h = 16: every other live tensor
    # (layer activations, inputs, norms, the seed and the loss) does not depend on V.
    job = _train(micro_batch=2, seq_len=32, optimizer="sgd", precision=precision)
    small = calc.estimate(_logits_model(4096), job, device="cpu")
    large = calc.estimate(_logits_model(8192), job, device="cpu")
    assert small.peak_event == large.peak_event == "dlogits"
    assert large.peak_bytes - small.peak_bytes == per_4096_vocab


# ------------------------------------------------------------------------------ device


def test_cuda_adds_two_cublas_workspaces_for_training() -> None:
    # Forward (Python thread) and backward (autograd thread): 2 * 32 MiB. AdamW's step is the
    # peak (no gradient accumulation there, where CPU and CUDA replays differ).
    job = _train()
    cpu = calc.estimate(TINY, job, device="cpu")
    cuda = calc.estimate(TINY, job, device="cuda")
    assert cuda.peak_bytes - cpu.peak_bytes == 2 * 32 * MIB
    assert cuda.breakdown["cuda/cublas_workspace"] == 2 * 32 * MIB
    assert "cuda/cublas_workspace" not in cpu.breakdown
    for phase in ("step1/forward", "step1/optimizer", "step2/optimizer"):
        assert cuda.phases[phase] - cpu.phases[phase] == 2 * 32 * MIB


def test_cuda_adds_one_cublas_workspace_for_inference() -> None:
    job = calc.Inference(batch=2, context=16, implementation="reference")
    cpu = calc.estimate(KV_MODEL, job, device="cpu")
    cuda = calc.estimate(KV_MODEL, job, device="cuda")
    assert cuda.peak_bytes - cpu.peak_bytes == 32 * MIB
