"""Tensor parallelism (`calc.parallel.tensor`): what one rank holds, on tiny dims by hand.

Model (llama, fp32, untied): h=64, L=2, a=4 heads, k=2 kv heads, d=16, f=128, V=64. Every
storage is charged ``max(512, ceil(n/512)*512)`` bytes; all tensors below are multiples of 512
except the norms (64 elements = 256 B -> 512).

tp=1, per layer: q [64, 64] 16384 B, k and v [32, 64] 8192 B each, o [64, 64] 16384 B,
gate/up/down [128, 64] 32768 B each, two norms 512 each: 16384 + 2*8192 + 16384 + 3*32768 +
1024 = 148480. Whole model: embed 16384 + head 16384 + final norm 512 + 2 layers = 330240.

tp=2 (Megatron-LM column/row split, Shoeybi et al. 2019 §3: q/k/v/gate/up split by output
rows, o/down by input columns; norms, embedding and head replicated): per layer q 8192,
k and v 4096, o 8192, gate/up/down 16384 each, norms 1024: 74752. Whole rank: 32768 + 512 +
2*74752 = 182784: the split part of a layer (147456 B) halves, the rest does not.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import calc
from calc.parallel.tensor import rank_model
from tests.specs import tiny_llama64, tiny_training

W_TP1 = 330240
W_TP2 = 182784


def _llama(**changes: object) -> calc.ModelSpec:
    return tiny_llama64(**{"name": "tiny-tp", "n_kv_heads": 2, **changes})


def _job(**changes: object) -> calc.Training:
    return tiny_training(**changes)


def test_rank_model_divides_heads_kv_heads_and_ffn() -> None:
    local = rank_model(_llama(), calc.Parallelism(tp=2))
    assert (local.n_heads, local.n_kv_heads, local.ffn) == (2, 1, 64)
    assert (local.hidden, local.head_dim, local.vocab, local.n_layers) == (64, 16, 64, 2)


@pytest.mark.parametrize(("tp", "weights"), [(1, W_TP1), (2, W_TP2)])
def test_rank_weights_by_hand(tp: int, weights: int) -> None:
    est = calc.estimate(_llama(), _job(), calc.Parallelism(tp=tp), device="cpu")
    assert est.breakdown["weights"] == weights


def test_vocab_parallel_splits_embedding_and_head() -> None:
    # vocab_parallel: embedding and head [V/tp, h] = [32, 64] fp32 = 8192 B each instead of
    # 16384: W_TP2 - 2 * 8192 = 166400.
    par = calc.Parallelism(tp=2, vocab_parallel=True)
    est = calc.estimate(_llama(), _job(), par, device="cpu")
    assert est.breakdown["weights"] == W_TP2 - 2 * 8192


def test_vocab_parallel_needs_tp_to_divide_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="vocab=66"):
        rank_model(_llama(vocab=66, n_kv_heads=4), calc.Parallelism(tp=4, vocab_parallel=True))


def test_rank_optimizer_states_follow_the_split() -> None:
    # AdamW: exp_avg and exp_avg_sq like each parameter: W_TP2 each on a tp=2 rank.
    est = calc.estimate(_llama(), _job(), calc.Parallelism(tp=2), device="cpu")
    assert est.peak_phase.endswith("/optimizer")
    assert est.breakdown["optimizer/exp_avg"] == W_TP2
    assert est.breakdown["optimizer/exp_avg_sq"] == W_TP2


def test_every_rank_is_alike() -> None:
    est = calc.estimate(_llama(), _job(), calc.Parallelism(tp=2), device="cpu")
    assert est.rank_peaks == {0: est.peak_bytes, 1: est.peak_bytes}


def test_saved_activations_are_affine_in_one_over_tp() -> None:
    """Korthikanti et al. 2022, Table 2 ("tensor parallel" row): per layer
    ``sbh(10 + 24/t + 5as/(ht))``: a replicated part plus a part divided by t. So with
    A(t) the layers' saved activations, A(1) - A(2) = 2 (A(2) - A(4)). Sizes are multiples of
    512 B at every t here (s=128, h=64: one head of 16 x 128 x 4 B = 8192 B, the fp32
    logsumexp of one head 128 x 4 B = 512 B)."""
    model = _llama(n_kv_heads=4, vocab=1024)
    job = _job(optimizer="sgd", seq_len=128)
    acts = {}
    for tp in (1, 2, 4):
        est = calc.estimate(model, job, calc.Parallelism(tp=tp), device="cpu")
        assert est.peak_event == "dlogits"  # the same moment: the loss's gradient
        acts[tp] = est.breakdown["activations/layers"]
    assert acts[1] - acts[2] == 2 * (acts[2] - acts[4])
    assert acts[4] < acts[2] < acts[1]


@pytest.mark.parametrize(("field", "changes"), [("n_heads", {"n_heads": 6, "n_kv_heads": 6}),
                                                ("n_kv_heads", {"n_kv_heads": 1}),
                                                ("ffn", {"ffn": 90, "n_kv_heads": 4})])  # fmt: skip
def test_divisibility_errors_name_the_field(field: str, changes: dict) -> None:
    tp = 4 if field != "n_kv_heads" else 2
    with pytest.raises(ValueError, match=f"{field}="):
        rank_model(_llama(**changes), calc.Parallelism(tp=tp))


def test_model_states_shrink_as_tp_grows() -> None:
    """Weights, gradients and optimizer states of a rank never grow with tp (Megatron-LM's
    theoretical memory: the split parameters are divided by tp, the rest replicated)."""
    model = _llama(n_kv_heads=4)
    prev = None
    for tp in (1, 2, 4):
        est = calc.estimate(model, _job(), calc.Parallelism(tp=tp), device="cpu")
        states = sum(est.breakdown.get(k, 0) for k in ("weights", "gradients", "optimizer"))
        if prev is not None:
            assert states < prev
        prev = states


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 4), s=st.sampled_from([8, 16, 32, 64, 128]),
       optimizer=st.sampled_from(["sgd", "adamw"]))  # fmt: skip
def test_peak_never_grows_with_tp(b: int, s: int, optimizer: str) -> None:
    """On this model the split part of every layer outweighs what tensor parallelism adds
    (one all-reduced [b*s, h] copy at a time), so the rank's peak falls as tp grows."""
    model = _llama(n_kv_heads=4)
    job = _job(micro_batch=b, seq_len=s, optimizer=optimizer)
    peaks = [calc.estimate(model, job, calc.Parallelism(tp=tp), device="cpu").peak_bytes
             for tp in (1, 2, 4)]  # fmt: skip
    assert peaks[0] >= peaks[1] >= peaks[2]
