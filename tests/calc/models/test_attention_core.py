"""`calc.models.attention_core` against verify/models/reference.py, allocation by allocation.

A tiny reference model (hidden 64, 4 heads of 16, 2 kv heads or 4, ffn 96, vocab 300; batch 2,
sequence 32; one or two layers) runs one forward and backward under `verify.measure.trace.
AllocationTrace` with SDPA forced to the math backend, or with the eager attention core. The
replay of the same step (`calc.models.reference`, whose attention core is `attention_core`)
must give the same live total
after every allocation: llama-style GQA and MHA, fp32 and bf16, attention dropout 0 and 0.1,
and gpt2 (no RoPE, fused qkv split into views).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import calc  # noqa: E402
from calc import symbols as Sy  # noqa: E402
from calc.config.model_spec import ModelSpec  # noqa: E402
from calc.models import attention_core as AC  # noqa: E402
from calc.models import reference as R  # noqa: E402
from calc.models.attention import attention_kernel  # noqa: E402
from calc.replay import ops  # noqa: E402
from calc.replay.tape import Tape  # noqa: E402
from calc.step.sizes import values_for  # noqa: E402
from calc.step.training import shape_for  # noqa: E402
from verify.measure.trace import AllocationTrace  # noqa: E402
from verify.models.reference import ReferenceLM  # noqa: E402

B, S = 2, 32

LLAMA = dict(
    name="tiny", model_type="llama", hidden=64, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=16, ffn=96, vocab=300, max_positions=128, mlp="swiglu", norm="rmsnorm",
    qkv_bias=False, o_bias=False, mlp_bias=False, norm_bias=False, qk_norm=False,
    tied_embeddings=False, learned_positions=False, attention_dropout=0.0, hidden_dropout=0.0,
    embedding_dropout=0.0, norm_eps=1e-6, rope_theta=10000.0,
)  # fmt: skip
GPT2 = dict(
    model_type="gpt2", n_kv_heads=4, mlp="gelu", norm="layernorm", qkv_bias=True, o_bias=True,
    mlp_bias=True, norm_bias=True, tied_embeddings=True, learned_positions=True, ffn=256,
)  # fmt: skip


# -- measuring and replaying one step -----------------------------------------------------------
def _configs(overrides: dict, gpt2: bool, precision: str, attention: str):
    spec = dict(LLAMA)
    if gpt2:
        spec.update(GPT2)
    spec.update(overrides)
    job = calc.Training(
        micro_batch=B, seq_len=S, precision=precision, implementation="reference",
        attention=attention,
    )  # fmt: skip
    return ModelSpec(**spec), job


def _measure(spec: ModelSpec, job: calc.Training) -> list[int]:
    """The live total after each allocation of ``loss = model(ids, tg); loss.backward()``."""
    torch.manual_seed(0)
    eager = job.attention == "eager"
    model = ReferenceLM(spec, attention="eager" if eager else "sdpa")
    if job.precision == "bf16":
        model = model.to(torch.bfloat16)
    fused = attention_kernel(spec, job) in ("flash", "efficient")
    backend = SDPBackend.FLASH_ATTENTION if fused else SDPBackend.MATH
    if spec.model_type != "gpt2":
        model.set_rope(S)
    ids = torch.randint(0, spec.vocab, (B, S))
    tg = torch.randint(0, spec.vocab, (B, S))
    trace = AllocationTrace()
    trace.ignore(*model.parameters(), *model.buffers(), ids, tg)
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if job.precision == "amp-bf16"
        else contextlib.nullcontext()
    )
    with sdpa_kernel(backend), trace:
        with autocast:
            loss = model(ids, tg)
        loss.backward()
        del loss
    return [e.live_bytes for e in trace.events if e.delta_bytes > 0]


def _replay(spec: ModelSpec, job: calc.Training) -> list[tuple[str, int]]:
    sh = shape_for(spec, job, "cpu", spec.n_layers)
    vals = values_for(spec, job)
    sh = dataclasses.replace(
        sh, b=vals[Sy.b], s=vals[Sy.s], h=vals[Sy.h], a=vals[Sy.a], k=vals[Sy.k],
        d=vals[Sy.d], f=vals[Sy.f], V=vals[Sy.V], P=vals[Sy.P],
    )  # fmt: skip
    tape = Tape(inplace_accumulate=False)
    w = R.Weights(tape, sh)
    cos = tape.existing(sh.s * sh.d, sh.weight_itemsize, "cos", "buffer")
    sin = tape.existing(sh.s * sh.d, sh.weight_itemsize, "sin", "buffer")
    base = sum(st.size for st in tape.live.values())
    if sh.autocast_itemsize:
        tape.autocast_enter(sh.autocast_itemsize)
    loss = R.forward(tape, sh, w, cos, sin)
    tape.autocast_exit()
    tape.backward(loss)
    tape.drop(loss)
    return [
        (e.label, sum(size * c for (_, _, _, size), c in e.live) - base)
        for e in tape.events
        if e.label.startswith("+")
    ]


CASES = {
    "math-gqa-fp32": ({}, False, "fp32", "math"),
    "math-mha-fp32": ({"n_kv_heads": 4}, False, "fp32", "math"),
    "math-gqa-bf16": ({}, False, "bf16", "math"),
    "math-mha-bf16": ({"n_kv_heads": 4}, False, "bf16", "math"),
    "math-gqa-drop": ({"attention_dropout": 0.1}, False, "fp32", "math"),
    "math-mha-bf16-drop": ({"n_kv_heads": 4, "attention_dropout": 0.1}, False, "bf16", "math"),
    "math-qknorm": ({"qk_norm": True}, False, "fp32", "math"),
    "math-gpt2": ({}, True, "fp32", "math"),
    "math-gpt2-bf16-drop": ({"attention_dropout": 0.1}, True, "bf16", "math"),
    "math-gqa-amp": ({}, False, "amp-bf16", "math"),
    "math-gpt2-amp": ({}, True, "amp-bf16", "math"),
    "flash-gqa-fp32": ({}, False, "fp32", "sdpa"),
    "flash-mqa-bf16": ({"n_kv_heads": 1}, False, "bf16", "sdpa"),
    "flash-gpt2": ({}, True, "fp32", "sdpa"),
    "eager-gqa-fp32": ({}, False, "fp32", "eager"),
    "eager-mha-fp32": ({"n_kv_heads": 4}, False, "fp32", "eager"),
    "eager-gqa-bf16": ({}, False, "bf16", "eager"),
    "eager-mha-bf16": ({"n_kv_heads": 4}, False, "bf16", "eager"),
    "eager-gqa-drop": ({"attention_dropout": 0.1}, False, "fp32", "eager"),
    "eager-mha-bf16-drop": ({"n_kv_heads": 4, "attention_dropout": 0.1}, False, "bf16", "eager"),
    "eager-mqa-drop": ({"n_kv_heads": 1, "attention_dropout": 0.1}, False, "fp32", "eager"),
    "eager-gpt2": ({}, True, "fp32", "eager"),
    "eager-gpt2-drop": ({"attention_dropout": 0.1, "hidden_dropout": 0.1}, True, "fp32", "eager"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_matches_trace(case: str) -> None:
    overrides, gpt2, precision, attention = CASES[case]
    spec, job = _configs(overrides, gpt2, precision, attention)
    measured = _measure(spec, job)
    replayed = _replay(spec, job)
    for i, (m, (label, r)) in enumerate(zip(measured, replayed, strict=False)):
        assert m == r, f"allocation {i} ({label}): measured {m}, replayed {r}"
    assert len(measured) == len(replayed)


@dataclasses.dataclass(frozen=True)
class _CoreShape:
    b: object
    s: object
    a: object
    k: object
    d: object
    attention: str
    attn_dropout: float = 0.1
    device: str = "cpu"


def _core_totals(sh: _CoreShape, gqa: bool | None, itemsize: int) -> list:
    """Live bytes after each event of one core (q, k, v leaves), its head merge and backward."""
    tape = Tape(inplace_accumulate=False)
    q = tape.existing(sh.b * sh.a * sh.s * sh.d, itemsize, "q", "act", leaf=True)
    k = tape.existing(sh.b * sh.k * sh.s * sh.d, itemsize, "k", "act", leaf=True)
    v = tape.existing(sh.b * sh.k * sh.s * sh.d, itemsize, "v", "act", leaf=True)
    if gqa is None:  # the shape decides, through the dispatcher
        out = AC.core(tape, sh, q, k, v, "attn")
    else:
        fn = AC.eager if sh.attention == "eager" else AC.math_sdpa
        out = fn(tape, sh, q, k, v, "attn", gqa=gqa)
    o = AC.merge_heads(tape, sh, out)
    tape.drop(out)
    loss = ops.mean_last(tape, o, 1, "loss")
    tape.drop(o)
    tape.backward(loss)
    tape.drop(loss)
    assert len(tape.grads) == 3
    return [sum(size * c for (_, _, _, size), c in e.live) for e in tape.events]


@pytest.mark.parametrize("attention", ["math", "eager"])
@pytest.mark.parametrize("gqa", [False, True])
def test_symbolic_sizes(attention: str, gqa: bool) -> None:
    """The cores replay on sympy sizes: each event's formula, evaluated, is the numeric replay."""
    import sympy as sp

    b, s, a, k, d = sp.symbols("b s a k d", positive=True, integer=True)
    nums = {b: 2, s: 32, a: 4, k: 2 if gqa else 4, d: 16}
    symbolic = _core_totals(_CoreShape(b, s, a, k, d, attention), gqa, 2)
    numeric = _core_totals(_CoreShape(*nums.values(), attention), None, 2)
    assert len(symbolic) == len(numeric)
    assert any(isinstance(t, sp.Expr) and t.free_symbols for t in symbolic)
    for f, n in zip(symbolic, numeric, strict=True):
        assert sp.sympify(f).subs(nums) == n


def test_gqa_needs_a_flag_on_symbols() -> None:
    import sympy as sp

    b, s, a, k, d = sp.symbols("b s a k d", positive=True, integer=True)
    with pytest.raises(ValueError, match="gqa"):
        _core_totals(_CoreShape(b, s, a, k, d, "math"), None, 4)
