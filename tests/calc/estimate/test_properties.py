"""Properties of `calc.estimate` that hold for every size, checked with hypothesis.

Each new *structure* (precision, optimizer, kernel, recompute, implementation, layer-count
branch, ...) is replayed and compiled once and cached, so the strategies draw sizes (batch,
sequence, model widths) over a handful of fixed structures.
"""

from __future__ import annotations

import pytest
import sympy as sp
from hypothesis import example, given, settings
from hypothesis import strategies as st

import calc
from calc.config.jobs import ATTENTIONS, IMPLEMENTATIONS, OPTIMIZERS, PRECISIONS, RECOMPUTES
from tests.specs import tiny_llama

FEW = settings(max_examples=15, deadline=None)
SOME = settings(max_examples=25, deadline=None)


def _llama(**changes: object) -> calc.ModelSpec:
    return tiny_llama(**{"max_positions": 4096, **changes})


@st.composite
def models(draw: st.DrawFn, layers: tuple[int, ...] = (2, 6)) -> calc.ModelSpec:
    """Tiny llamas with a = k = 2 heads spanning the hidden size (one structure per branch of
    the layer count: exact replay for 2, the five-layer generalisation for 6)."""
    d = draw(st.sampled_from((8, 16, 24)))
    return _llama(
        hidden=2 * d,
        head_dim=d,
        n_layers=draw(st.sampled_from(layers)),
        ffn=draw(st.integers(4, 96)),
        vocab=draw(st.integers(8, 600)),
    )


JOB_STRUCTURES = (
    dict(precision="fp32", optimizer="adamw", implementation="reference"),
    dict(precision="amp-bf16", optimizer="sgd", implementation="reference"),
    dict(precision="bf16", optimizer="adamw", implementation="hf"),
)


@st.composite
def jobs(draw: st.DrawFn) -> calc.Training | calc.Inference:
    if draw(st.integers(0, 3)) == 3:
        context = draw(st.integers(1, 96))
        return calc.Inference(
            batch=draw(st.integers(1, 4)),
            context=context,
            prompt=draw(st.integers(1, context)),
            implementation="reference",
        )
    return calc.Training(
        micro_batch=draw(st.integers(1, 4)),
        seq_len=draw(st.integers(1, 96)),
        **draw(st.sampled_from(JOB_STRUCTURES)),  # type: ignore[arg-type]
    )


DEVICES = st.sampled_from(("cpu", "cuda"))


# ------------------------------------------------------------------------------ consistency


@SOME
@given(model=models(), job=jobs(), device=DEVICES)
def test_peak_is_the_max_of_the_phases(model, job, device) -> None:
    est = calc.estimate(model, job, device=device)
    assert all(est.peak_bytes >= v for v in est.phases.values())
    assert est.peak_bytes == max(est.phases.values())
    assert est.phases[est.peak_phase] == est.peak_bytes


def _children(bd: dict[str, int], parent: str) -> list[int]:
    depth = parent.count("/") + 1
    return [v for k, v in bd.items() if k.startswith(parent + "/") and k.count("/") == depth]


@SOME
@given(model=models(), job=jobs(), device=DEVICES)
def test_breakdown_is_a_tree_summing_to_the_peak(model, job, device) -> None:
    est = calc.estimate(model, job, device=device)
    bd = dict(est.breakdown)
    assert bd["total"] == est.peak_bytes
    top = [v for k, v in bd.items() if k != "total" and "/" not in k]
    assert sum(top) == bd["total"]
    for key, value in bd.items():
        kids = _children(bd, key)
        if kids:
            assert sum(kids) == value, key
    assert all(v > 0 for v in bd.values())


@settings(max_examples=6, deadline=None)
@given(model=models(), job=jobs(), device=DEVICES)
def test_compiled_equals_symbolic(model, job, device) -> None:
    est = calc.estimate(model, job, device=device)
    # xreplace, not subs: the same substitution, but subs re-derives assumptions inside the
    # Max of ceilings and takes minutes on these expressions (~37 s at L=2, ~4 min at L=6).
    value = est.expression.xreplace({sym: sp.Integer(v) for sym, v in est.values.items()})
    assert value.is_number
    assert int(value) == est.peak_bytes
    assert isinstance(est.latex(), str)


# ------------------------------------------------------------------------------ monotonicity


@SOME
@given(
    model=models(),
    structure=st.sampled_from(JOB_STRUCTURES),
    b=st.integers(1, 6),
    s=st.integers(1, 128),
    db=st.integers(1, 3),
    ds=st.integers(1, 64),
)
def test_peak_never_decreases_with_micro_batch_or_seq_len(model, structure, b, s, db, ds) -> None:
    def peak(mb: int, sl: int) -> int:
        job = calc.Training(micro_batch=mb, seq_len=sl, **structure)
        return calc.estimate(model, job, device="cpu").peak_bytes

    base = peak(b, s)
    assert peak(b + db, s) >= base
    assert peak(b, s + ds) >= base


@FEW
@given(
    model=models(),
    batch=st.integers(1, 6),
    context=st.integers(1, 128),
    db=st.integers(1, 3),
    dc=st.integers(1, 64),
)
def test_inference_peak_never_decreases_with_batch_or_context(model, batch, context, db, dc):
    def peak(bb: int, cc: int) -> int:
        job = calc.Inference(batch=bb, context=cc, implementation="reference")
        return calc.estimate(model, job, device="cpu").peak_bytes

    base = peak(batch, context)
    assert peak(batch + db, context) >= base
    assert peak(batch, context + dc) >= base


@FEW
@given(model=models(), b=st.integers(1, 4), k=st.integers(2, 3))
def test_forward_activations_are_linear_in_micro_batch(model, b, k) -> None:
    # fp32, s = 128: every activation the forward makes is b*s*(something) elements of >= 4 B,
    # a multiple of 128*4 = 512 B, so no rounding; cos/sin [s, d] and the weights do not
    # depend on b (subtracted), the inputs are b*s*8 B (kept: linear too). The only tensors
    # of fixed size are the 0-d loss and total_weight (512 B each), so with
    # f(b) = forward peak - weights - buffers, the forward peak at k*b satisfies
    # k*f(b) - (k-1)*1024 <= f(k*b) <= k*f(b).
    def f(mb: int) -> int:
        job = calc.Training(
            micro_batch=mb, seq_len=128, precision="fp32", optimizer="sgd",
            implementation="reference",
        )  # fmt: skip
        est = calc.estimate(model, job, device="cpu")
        assert est.peak_phase.endswith(("forward", "backward"))
        # weights and buffers are alive in every phase: read them off the breakdown
        bd = est.breakdown
        return est.phases["step1/forward"] - bd["weights"] - bd["buffers"]

    one, many = f(b), f(k * b)
    assert k * one - (k - 1) * 1024 <= many <= k * one


RECOMPUTE_SIZES = dict(
    model=models(),
    precision=st.sampled_from(("fp32", "amp-bf16")),
    b=st.integers(1, 4),
    s=st.integers(1, 160),
)


def _by_recompute(model: calc.ModelSpec, precision: str, b: int, s: int) -> dict:
    """The estimates for recompute none/selective/full of one job. SGD (no states) so that
    activations, not the optimizer step, make the peak."""
    out = {}
    for recompute in ("none", "selective", "full"):
        job = calc.Training(
            micro_batch=b, seq_len=s, precision=precision, optimizer="sgd",
            recompute=recompute, implementation="reference",
        )  # fmt: skip
        out[recompute] = calc.estimate(model, job, device="cpu")
    return out


@FEW
@given(**RECOMPUTE_SIZES)
def test_recomputation_never_costs_more_than_none(model, precision, b, s) -> None:
    est = _by_recompute(model, precision, b, s)
    assert est["full"].peak_bytes <= est["none"].peak_bytes
    assert est["selective"].peak_bytes <= est["none"].peak_bytes
    fwd = {rc: e.phases["step1/forward"] for rc, e in est.items()}
    assert fwd["full"] <= fwd["selective"] <= fwd["none"]


@pytest.mark.xfail(
    strict=True,
    reason="fails: when the peak is in the backward of the last layer processed (gradients "
    "outweigh activations), full recompute holds that layer's recomputed attention core "
    "(q, k, v, out, lse) while selective has not recomputed it yet; see the example",
)
@FEW
@given(**RECOMPUTE_SIZES)
@example(model=_llama(ffn=25, vocab=8), precision="fp32", b=1, s=6)  # full 54784 > sel. 54272
def test_full_recomputation_never_costs_more_than_selective(model, precision, b, s) -> None:
    est = _by_recompute(model, precision, b, s)
    assert est["full"].peak_bytes <= est["selective"].peak_bytes <= est["none"].peak_bytes


@FEW
@given(
    model=models(),
    structure=st.sampled_from(JOB_STRUCTURES[:2]),
    b=st.integers(1, 4),
    s=st.integers(1, 96),
    accum=st.integers(2, 3),
)
def test_gradient_accumulation_never_lowers_the_peak(model, structure, b, s, accum) -> None:
    def peak(grad_accum: int) -> int:
        job = calc.Training(micro_batch=b, seq_len=s, grad_accum=grad_accum, **structure)
        return calc.estimate(model, job, device="cpu").peak_bytes

    assert peak(accum) >= peak(1)


# ------------------------------------------------------------------------------ validation


@FEW
@given(field=st.sampled_from(("micro_batch", "seq_len", "grad_accum")), v=st.integers(-5, 0))
def test_training_sizes_below_one_are_rejected(field, v) -> None:
    job = dict(micro_batch=1, seq_len=8)
    job[field] = v
    with pytest.raises(ValueError, match=field):
        calc.Training(**job)  # type: ignore[arg-type]


CHOICES = {
    "precision": PRECISIONS,
    "optimizer": OPTIMIZERS,
    "recompute": RECOMPUTES,
    "attention": ATTENTIONS,
    "implementation": IMPLEMENTATIONS,
}


@FEW
@given(field=st.sampled_from(sorted(CHOICES)), value=st.text(min_size=0, max_size=8))
def test_unknown_choices_are_rejected_naming_the_field(field, value) -> None:
    if value in CHOICES[field]:
        return
    with pytest.raises(ValueError, match=field):
        calc.Training(micro_batch=1, seq_len=8, **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(micro_batch=0, seq_len=8), "micro_batch"),
        (dict(micro_batch=1, seq_len=0), "seq_len"),
        (dict(micro_batch=True, seq_len=8), "micro_batch"),
        (dict(micro_batch=1.5, seq_len=8), "micro_batch"),
        (dict(micro_batch=1, seq_len=8, precision="fp8"), "precision"),
        (dict(micro_batch=1, seq_len=8, optimizer="rmsprop"), "optimizer"),
        (dict(micro_batch=1, seq_len=8, optimizer_impl="cuda"), "optimizer_impl"),
        (dict(micro_batch=1, seq_len=8, recompute="half"), "recompute"),
        (dict(micro_batch=1, seq_len=8, attention="flash2"), "attention"),
        (dict(micro_batch=1, seq_len=8, implementation="jax"), "implementation"),
        (dict(micro_batch=1, seq_len=8, zero_grad="never"), "zero_grad"),
        (dict(micro_batch=1, seq_len=8, weight_decay=-0.1), "weight_decay"),
        (dict(micro_batch=1, seq_len=8, dropout=1.0), "dropout"),
        (dict(micro_batch=1, seq_len=8, recompute="full", recompute_every=0), "recompute_every"),
        (dict(micro_batch=1, seq_len=8, recompute_every=2), "recompute_every"),
        (dict(micro_batch=1, seq_len=8, recompute="full", recompute_every=1.5), "recompute_every"),
    ],
)
def test_training_invalid_field_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        calc.Training(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(batch=0, context=8), "batch"),
        (dict(batch=1, context=0), "context"),
        (dict(batch=1, context=8, prompt=9), "prompt"),
        (dict(batch=1, context=8, precision="fp64"), "precision"),
        (dict(batch=1, context=8, attention="paged"), "attention"),
        (dict(batch=1, context=8, implementation="vllm"), "implementation"),
    ],
)
def test_inference_invalid_field_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        calc.Inference(**kwargs)


def test_unknown_device_is_rejected() -> None:
    with pytest.raises(ValueError, match="device"):
        calc.estimate(_llama(), calc.Training(micro_batch=1, seq_len=8), device="tpu")


def test_estimate_rejects_non_spec_arguments() -> None:
    with pytest.raises(ValueError, match="model"):
        calc.estimate("llama", calc.Training(micro_batch=1, seq_len=8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="job"):
        calc.estimate(_llama(), {"micro_batch": 1})  # type: ignore[arg-type]
