"""The Serve page under ``AppTest``: its metrics are ``calc.serve`` called here on the same
inputs (built from keyword arguments, not through the page), every widget reaches the
``calc.Serving`` field it names, and a GPU without a published CUDA total asks for one."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import calc

APP = str(Path(__file__).resolve().parents[2] / "app.py")
CARD = "qwen2.5-0.5b"
GIB = 2**30


def _serve_page(gpu: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params.update({"card": CARD, "gpu": gpu})
    at.run()
    at.switch_page("webapp/pages/serve.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _metric(at: AppTest, label: str) -> str:
    values = [m.value for m in at.metric if m.label == label]
    assert values, f"no metric {label!r}: {[m.label for m in at.metric]}"
    return values[0]


def test_defaults_are_calc_serve() -> None:
    at = _serve_page("a100-80gb")
    model = calc.load_card(CARD)
    want = calc.serve(model, calc.Serving(max_model_len=8192), gpu="a100-80gb")
    assert _metric(at, "GPU KV cache size") == f"{want.kv_cache_tokens:,} tokens"
    assert _metric(at, "available KV cache memory") == f"{want.kv_cache_bytes / GIB:.2f} GiB"
    assert len(at.get("vega_lite_chart")) == 2  # the stacked bar and the concurrency curve


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("serve.version", "0.10.1", {"vllm_version": "0.10.1"}),
        ("serve.util", 0.8, {"gpu_memory_utilization": 0.8}),
        ("serve.max_len", 4096, {"max_model_len": 4096}),
        ("serve.entrypoint", "llm", {"entrypoint": "llm"}),
        ("serve.seqs", 64, {"max_num_seqs": 64}),
        ("serve.batched", 4096, {"max_num_batched_tokens": 4096}),
        ("serve.tp", 2, {"tensor_parallel": 2}),
        ("serve.pp", 2, {"pipeline_parallel": 2}),
        ("serve.dtype", "fp16", {"dtype": "fp16"}),
        ("serve.kv_dtype", "fp8", {"kv_cache_dtype": "fp8"}),
        ("serve.quant", "w4a16", {"quant": "w4a16"}),
        ("serve.block", 32, {"block_size": 32}),
        ("serve.eager", True, {"enforce_eager": True}),
    ],
)
def test_each_widget_sets_its_field(key: str, value: object, field: dict) -> None:
    at = _serve_page("a100-80gb")
    widget = next(w for w in at.main if getattr(w, "key", None) == key)
    widget.set_value(value).run()
    assert not at.exception, [e.value for e in at.exception]
    serving = calc.Serving(**{"max_model_len": 8192, **field})
    want = calc.serve(calc.load_card(CARD), serving, gpu="a100-80gb")
    assert _metric(at, "GPU KV cache size") == f"{want.kv_cache_tokens:,} tokens"


def test_a_gpu_without_a_cuda_total_asks_for_it() -> None:
    # the H200's CUDA total is measured now (hardware/gpus.json); the MI300X has none
    at = _serve_page("mi300x-192gb")
    at.number_input(key="serve.total_gib").set_value(180.0).run()
    assert not at.exception, [e.value for e in at.exception]
    want = calc.serve(calc.load_card(CARD), calc.Serving(max_model_len=8192), total_bytes=180 * GIB)
    assert _metric(at, "GPU KV cache size") == f"{want.kv_cache_tokens:,} tokens"


def test_a_server_that_cannot_start_says_why() -> None:
    assert not _serve_page("a100-80gb").error
    # Mixtral-8x7B: 46.7 B parameters (Mistral AI's model card), 87 GiB in bf16: more than an
    # 80 GB A100 holds
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params.update({"card": "mixtral-8x7b", "gpu": "a100-80gb"})
    at.run()
    at.switch_page("webapp/pages/serve.py").run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert any("vLLM does not start: CUDA out of memory while loading" in e for e in errors)
