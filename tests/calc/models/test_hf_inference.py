"""The HF prefill replay (`calc.models.hf_inference`) against transformers' own prefill.

The harness's prefill (`verify.run.step.prefill`: a ``StaticCache`` of ``context`` tokens,
``logits_to_keep=1``, ``torch.no_grad()``) on tiny llama/mistral/qwen2/qwen3 models: the replay's
allocations, with the live bytes after each, equal the CPU allocation trace exactly; the
symbolic replay evaluates to the numeric one; and `calc.estimate` equals the storage tracker's
peak, through the five-layer generalisation too.
"""

from __future__ import annotations

import dataclasses

import pytest

import calc
from calc.config.model_spec import ModelSpec
from calc.models import hf_inference
from calc.step.sizes import values_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.traces import (  # noqa: E402
    assert_symbolic_matches_numeric,
    measured_allocations,
    replayed_allocations,
)
from verify.measure.trace import AllocationTrace  # noqa: E402
from verify.measure.tracker import StorageTracker  # noqa: E402
from verify.models.build import build_model  # noqa: E402
from verify.run.step import pins_for, prefill  # noqa: E402

LLAMA = dict(
    name="tiny-llama", model_type="llama", hidden=64, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=16, ffn=96, vocab=300, max_positions=128, mlp="swiglu", norm="rmsnorm",
    qkv_bias=False, o_bias=False, mlp_bias=False, norm_bias=False, qk_norm=False,
    tied_embeddings=False, learned_positions=False, attention_dropout=0.0, hidden_dropout=0.0,
    embedding_dropout=0.0, norm_eps=1e-6, rope_theta=10000.0,
)  # fmt: skip
MHA = {**LLAMA, "name": "tiny-llama-mha", "n_kv_heads": 4}
QWEN2 = {**LLAMA, "name": "tiny-qwen2", "model_type": "qwen2", "qkv_bias": True,
         "tied_embeddings": True}  # fmt: skip
QWEN3 = {**LLAMA, "name": "tiny-qwen3", "model_type": "qwen3", "qk_norm": True, "n_kv_heads": 1}
# hf_config leaves mistral's sliding_window at its config default, 4096: every layer is a
# StaticSlidingWindowLayer and the mask comes from create_sliding_window_causal_mask
MISTRAL = {**LLAMA, "name": "tiny-mistral", "model_type": "mistral", "sliding_window": 4096,
           "n_kv_heads": 1}  # fmt: skip
GPT2 = {**LLAMA, "name": "tiny-gpt2", "model_type": "gpt2", "n_kv_heads": 4, "mlp": "gelu",
        "norm": "layernorm", "qkv_bias": True, "o_bias": True, "mlp_bias": True,
        "norm_bias": True, "tied_embeddings": True, "learned_positions": True,
        "ffn": 256}  # fmt: skip


def _job(batch: int, prompt: int | None, context: int, precision: str) -> calc.Inference:
    return calc.Inference(batch=batch, context=context, prompt=prompt, precision=precision,
                          implementation="hf")  # fmt: skip


def _model_and_ids(spec: ModelSpec, job: calc.Inference) -> tuple:
    model, _ = build_model(spec, job, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab, (job.batch, job.prompt_len), generator=gen)
    return model.eval(), ids


def _traced(spec: ModelSpec, job: calc.Inference) -> list[tuple]:
    """`verify.run.step.prefill`'s allocations. The cache's ``cumulative_length`` counters are
    made before the trace and ignored: ``torch.tensor()`` bypasses dispatch and the harness's
    storage tracker does not count them (the replay does not either, on CPU)."""
    model, ids = _model_and_ids(spec, job)
    pins = pins_for(spec, job, seed=0, device="cpu")
    cache = transformers.StaticCache(config=model.config, max_cache_len=job.context)
    tr = AllocationTrace()
    tr.ignore(*model.parameters(), *model.buffers(), ids,
              *[layer.cumulative_length for layer in cache.layers])  # fmt: skip
    from verify.run.step import forced_sdpa

    with torch.no_grad(), forced_sdpa(pins.sdpa_backend), tr:
        tr.mark("prefill")
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, cache=cache)
        assert out.logits.shape == (job.batch, 1, spec.vocab)
        del out, cache
    return measured_allocations(tr.events)


CASES = [
    ("llama-gqa-fp32", LLAMA, "fp32", 2, 32, 48),
    ("llama-gqa-full-context", LLAMA, "fp32", 2, None, 40),
    ("llama-mha-bf16", MHA, "bf16", 3, 24, 40),
    ("qwen2-bias-tied-bf16", QWEN2, "bf16", 2, 32, 48),
    ("qwen2-full-context-fp32", QWEN2, "fp32", 1, None, 24),
    ("qwen3-qk-norm-fp32", QWEN3, "fp32", 1, 20, 33),
    ("qwen3-fp16", QWEN3, "fp16", 2, 7, 7),
    ("mistral-sliding-bf16", MISTRAL, "bf16", 2, None, 64),
    ("mistral-sliding-prompt-fp32", MISTRAL, "fp32", 2, 17, 50),
]


@pytest.mark.parametrize(("spec", "precision", "batch", "prompt", "context"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])  # fmt: skip
def test_prefill_matches_the_trace(
    spec: dict, precision: str, batch: int, prompt: int | None, context: int
) -> None:
    model = ModelSpec(**spec)
    job = _job(batch, prompt, context, precision)
    sh, ctx = hf_inference.numeric_shape(model, job, "cpu")
    assert replayed_allocations(hf_inference.replay(sh, ctx)) == _traced(model, job)


def test_kv_cache_is_allocated_inside_its_layer() -> None:
    model = ModelSpec(**LLAMA)
    job = _job(2, 32, 48, "fp32")
    sh, ctx = hf_inference.numeric_shape(model, job, "cpu")
    events = hf_inference.replay(sh, ctx)
    made = [(e.segment, e.label) for e in events if e.label in ("+k_cache", "+v_cache")]
    assert made == [(0, "+k_cache"), (0, "+v_cache"), (1, "+k_cache"), (1, "+v_cache")]
    # 2 (K and V) * 2 layers * 2 heads * 16 dims * 48 tokens * 2 sequences * 4 bytes
    last = events[-1 - 4]  # before `del cache` frees the four tensors
    cache = sum(key[3] * n for key, n in last.live if key[0] == "kv_cache")
    assert cache == 2 * 2 * 2 * 16 * 48 * 2 * 4


def test_symbolic_replay_evaluates_to_the_numeric_one() -> None:
    model = ModelSpec(**{**QWEN2, "n_layers": 3})
    job = _job(3, 21, 50, "bf16")
    sym = hf_inference.replay_hf_prefill(model, job, "cpu", model.n_layers)
    vals = values_for(model, job)
    sh, ctx = hf_inference.numeric_shape(model, job, "cpu")
    num = hf_inference.replay(sh, ctx)
    assert_symbolic_matches_numeric(sym, num, vals)


def test_cuda_moves_the_length_counter_at_the_first_update() -> None:
    model = ModelSpec(**LLAMA)
    job = _job(2, 32, 48, "bf16")
    sh, ctx = hf_inference.numeric_shape(model, job, "cuda")
    labels = [e.label for e in hf_inference.replay(sh, ctx) if e.label.startswith("+")]
    i = labels.index("+k_cache")
    assert labels[i : i + 4] == ["+k_cache", "+v_cache", "+cache.length", "+cache.arange"]
    sh_cpu, _ = hf_inference.numeric_shape(model, job, "cpu")
    assert "+cache.length" not in [e.label for e in hf_inference.replay(sh_cpu, ctx)]


def _tracked_peak(spec: ModelSpec, job: calc.Inference) -> int:
    """The harness's measurement: storage tracker, model built inside it, `verify.run.step.prefill`."""
    from verify.models import hf as hf_model

    hf_model.build_hf_on_meta(spec)  # import the modeling module outside the tracker
    tr = StorageTracker(scan_baseline=False, count_late=False)
    with tr:
        model, ids = _model_and_ids(spec, job)
        tr.reset_peak()
        prefill(model, ids, job, pins_for(spec, job, seed=0, device="cpu"), tr)
    return tr.peak_bytes


@pytest.mark.parametrize(("spec", "precision", "layers", "prompt"), [
    (LLAMA, "fp32", 2, 32), (MISTRAL, "bf16", 7, None), (QWEN2, "bf16", 6, 32),
    (QWEN3, "fp32", 5, 16), (GPT2, "bf16", 6, 24),
], ids=["llama-2", "mistral-7", "qwen2-bf16-6", "qwen3-5", "gpt2-bf16-6"])  # fmt: skip
def test_estimate_equals_the_tracked_peak(
    spec: dict, precision: str, layers: int, prompt: int | None
) -> None:
    model = ModelSpec(**{**spec, "n_layers": layers})
    job = _job(2, prompt, 64, precision)
    est = calc.estimate(model, job, device="cpu")
    assert est.peak_phase == "prefill"
    assert est.peak_bytes == _tracked_peak(model, job)


@pytest.mark.parametrize(("spec", "job", "match"), [
    (GPT2, dataclasses.replace(_job(2, 32, 48, "fp32"), attention="eager"), "eager"),
    (LLAMA, dataclasses.replace(_job(2, 32, 48, "fp32"), attention="eager"), "eager"),
    ({**MISTRAL, "sliding_window": 48}, _job(2, 32, 48, "fp32"), "sliding window"),
    (LLAMA, _job(2, 1, 48, "fp32"), "one-token"),
], ids=["gpt2-eager", "eager", "window-not-longer-than-context",
        "one-token-prompt"])  # fmt: skip
def test_not_modelled(spec: dict, job: calc.Inference, match: str) -> None:
    with pytest.raises(NotImplementedError, match=match):
        hf_inference.numeric_shape(ModelSpec(**spec), job, "cpu")


def test_hf_decode_is_not_modelled() -> None:
    from calc.step.inference import replay_inference

    with pytest.raises(NotImplementedError, match="decode"):
        replay_inference(ModelSpec(**LLAMA), _job(2, 32, 48, "fp32"), "cpu", 2, decode=True)
