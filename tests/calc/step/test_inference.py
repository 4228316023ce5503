"""The inference replay (`calc.step.inference`) against the traced prefill of `verify.models.reference_inference`.

Every allocation of a prefill into a static KV cache (and of one decode step after it) on tiny
models: the replay's sequence of allocations, with the live bytes after each, equals the CPU
allocation trace exactly. Then the KV cache's size, derived by hand, and `calc.estimate`'s peak
against the storage tracker's.
"""

from __future__ import annotations

import pytest
import sympy as sp

import calc
from calc import symbols as S
from calc.config.model_spec import ModelSpec
from calc.step import inference
from calc.step.sizes import values_for

torch = pytest.importorskip("torch")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from tests.specs import TINY_LLAMA_FIELDS  # noqa: E402
from tests.traces import (  # noqa: E402
    assert_symbolic_matches_numeric,
    measured_allocations,
    replayed_allocations,
)
from verify.measure.trace import AllocationTrace  # noqa: E402
from verify.measure.tracker import StorageTracker  # noqa: E402
from verify.models.reference import ReferenceLM  # noqa: E402
from verify.models.reference_inference import decode_step, new_cache, prefill  # noqa: E402

LLAMA = {**TINY_LLAMA_FIELDS, "hidden": 64, "n_heads": 4, "head_dim": 16, "ffn": 96,
         "vocab": 300, "max_positions": 128}  # fmt: skip
QWEN2 = {**LLAMA, "name": "tiny-qwen2", "model_type": "qwen2", "qkv_bias": True,
         "tied_embeddings": True}  # fmt: skip
QWEN3 = {**LLAMA, "name": "tiny-qwen3", "model_type": "qwen3", "qk_norm": True}
GPT2 = {**LLAMA, "name": "tiny-gpt2", "model_type": "gpt2", "n_kv_heads": 4, "mlp": "gelu",
        "norm": "layernorm", "qkv_bias": True, "o_bias": True, "mlp_bias": True,
        "norm_bias": True, "tied_embeddings": True, "learned_positions": True,
        "ffn": 256}  # fmt: skip


def _build(spec: ModelSpec, precision: str, context: int) -> ReferenceLM:
    torch.manual_seed(0)
    model = ReferenceLM(spec).eval()
    if precision != "fp32":
        model = model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[precision])
    if spec.model_type != "gpt2":
        model.set_rope(context)
    return model


def _traced(spec: ModelSpec, job: calc.Inference, decode: bool) -> list[tuple]:
    model = _build(spec, job.precision, job.context)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab, (job.batch, job.prompt_len), generator=gen)
    next_id = torch.randint(0, spec.vocab, (job.batch, 1), generator=gen)
    tr = AllocationTrace()
    tr.ignore(*model.parameters(), *model.buffers(), ids, next_id)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), tr:
        tr.mark("prefill")
        logits, cache = prefill(model, ids, job.context)
        assert logits.shape == (job.batch, 1, spec.vocab)
        del logits
        if decode:
            tr.mark("decode")
            logits = decode_step(model, cache, next_id, job.prompt_len)
            del logits
        del cache
    return measured_allocations(tr.events)


CASES = [
    ("llama-gqa", LLAMA, "fp32", 2, 32, 48),
    ("qwen2-bias-tied", QWEN2, "fp32", 2, 32, 48),
    ("qwen3-qk-norm", QWEN3, "fp32", 1, 20, 33),
    ("gpt2", GPT2, "fp32", 2, 32, 48),
    ("llama-bf16", LLAMA, "bf16", 3, 24, 40),
    ("gpt2-bf16", GPT2, "bf16", 1, 17, 30),
]


@pytest.mark.parametrize(("spec", "precision", "batch", "prompt", "context"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])  # fmt: skip
def test_prefill_and_decode_match_the_trace(
    spec: dict, precision: str, batch: int, prompt: int, context: int
) -> None:
    model = ModelSpec(**spec)
    job = calc.Inference(batch=batch, context=context, prompt=prompt, precision=precision,
                         implementation="reference")  # fmt: skip
    sh, ctx = inference.numeric_shape(model, job, "cpu")
    replayed = replayed_allocations(inference.replay(sh, ctx, decode=True))
    assert replayed == _traced(model, job, decode=True)


def test_prompt_filling_the_whole_context_matches_the_trace() -> None:
    model = ModelSpec(**LLAMA)
    job = calc.Inference(batch=2, context=40, precision="fp32", implementation="reference")
    sh, ctx = inference.numeric_shape(model, job, "cpu")
    assert replayed_allocations(inference.replay(sh, ctx)) == _traced(model, job, decode=False)


def test_symbolic_replay_evaluates_to_the_numeric_one() -> None:
    model = ModelSpec(**{**LLAMA, "n_layers": 3})
    job = calc.Inference(batch=3, context=50, prompt=21, precision="bf16",
                         implementation="reference")  # fmt: skip
    sym = inference.replay_inference(model, job, "cpu", model.n_layers, decode=True)
    vals = values_for(model, job)
    sh, ctx = inference.numeric_shape(model, job, "cpu")
    num = inference.replay(sh, ctx, decode=True)
    assert_symbolic_matches_numeric(sym, num, vals)


def test_kv_cache_size_by_hand() -> None:
    # 2 layers, 2 kv heads of 16, context 48, batch 2, fp32:
    # 2 (K and V) * 2 layers * 2 heads * 16 dims * 48 tokens * 2 sequences * 4 bytes = 49152
    expected = 2 * 2 * 2 * 16 * 48 * 2 * 4
    assert expected == 49152
    model = ModelSpec(**LLAMA)
    job = calc.Inference(batch=2, context=48, prompt=32, precision="fp32",
                         implementation="reference")  # fmt: skip
    sh, ctx = inference.numeric_shape(model, job, "cpu")
    events = inference.replay(sh, ctx)
    first_act = next(i for i, e in enumerate(events) if e.label == "+embed_out")
    cache = {key: n for key, n in events[first_act - 1].live if key[0] == "kv_cache"}
    assert sum(key[3] * n for key, n in cache.items()) == expected
    assert sorted(key[2] for key, n in cache.items() for _ in range(n)) == [0, 0, 1, 1]
    real = new_cache(_build(model, "fp32", 48), batch=2, context=48)
    assert sum(t.nbytes for kv in real for t in kv) == expected
    # symbolically: 2 L tensors of b * k * c * d elements
    sym = inference.replay_inference(model, job, "cpu", 2)
    sizes = [key[3] for e in sym[:4] for key, _ in e.live if key[0] == "kv_cache"]
    assert sizes[-1] == 512 * sp.ceiling(S.b * S.k * S.c * S.d * 4 / 512)


def _tracked_peak(spec: ModelSpec, job: calc.Inference) -> int:
    """``peak_bytes`` of the storage tracker over the prefill (model built inside it)."""
    tr = StorageTracker(scan_baseline=False, count_late=False)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), tr:
        model = _build(spec, job.precision, job.context)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, spec.vocab, (job.batch, job.prompt_len), generator=gen)
        tr.reset_peak()
        tr.mark("prefill")
        logits, cache = prefill(model, ids, job.context)
        del logits, cache
    return tr.peak_bytes


@pytest.mark.parametrize(("spec", "precision", "layers"), [
    (LLAMA, "fp32", 2), (LLAMA, "fp32", 7), (QWEN2, "bf16", 6), (GPT2, "fp32", 5),
], ids=["llama-2", "llama-7", "qwen2-bf16-6", "gpt2-5"])  # fmt: skip
def test_estimate_equals_the_tracked_peak(spec: dict, precision: str, layers: int) -> None:
    model = ModelSpec(**{**spec, "n_layers": layers})
    job = calc.Inference(batch=2, context=64, prompt=32, precision=precision,
                         implementation="reference")  # fmt: skip
    est = calc.estimate(model, job, device="cpu")
    assert est.peak_phase == "prefill"
    assert est.peak_bytes == _tracked_peak(model, job)
