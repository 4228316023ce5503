"""`calc.models.hf` against Hugging Face transformers, allocation by allocation.

For each config a tiny model (hidden 64, 2 layers, 4 heads, 2 kv heads, ffn 96, vocab 300;
batch 2, sequence 32) runs ``loss = model(input_ids=ids, labels=ids).loss; loss.backward();
del loss`` under `verify.measure.trace.AllocationTrace` (parameters, buffers and the ids ignored), with
SDPA forced to the flash kernel (and eager attention, or SDPA's math backend, for some). Not covered (the replay refuses):
eager attention under autocast or with a sliding-window cache (mistral's default config). The replay of the same step must give the same live total at
every allocation (hence the same peak). Sizes are the CUDA allocator's 512-byte blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from calc.models import hf  # noqa: E402
from calc.replay.tape import Tape  # noqa: E402
from verify.measure.trace import AllocationTrace  # noqa: E402

B, S = 2, 32

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def _model(family: str, tied: bool, dtype: torch.dtype | None, attn: str = "sdpa"):
    cfg_name, cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=300,
        max_position_embeddings=128,
        attn_implementation=attn,
        tie_word_embeddings=tied,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg)
    model.train()
    if dtype is not None:
        model.to(dtype)
    return model


def _measured(model, amp: bool, math: bool = False) -> list[int]:
    ids = torch.randint(0, model.config.vocab_size, (B, S))
    tr = AllocationTrace()
    tr.ignore(*model.parameters(), *model.buffers(), ids)
    ac = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    backend = SDPBackend.MATH if math else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel(backend), tr:
        with ac:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
    return [e.live_bytes for e in tr.events if e.delta_bytes > 0]


def _replayed(model, weight_itemsize: int, amp: bool, math: bool = False) -> list[int]:
    sh = hf.shape_from_config(
        model.config, B, S, weight_itemsize=weight_itemsize, autocast_itemsize=2 if amp else 0
    )
    if math:
        sh = dataclasses.replace(sh, attention="math")
    tape = Tape(inplace_accumulate=False)  # the trace is a Python dispatch mode
    w = hf.Weights(tape, sh)
    base = sum(st.size for st in tape.live.values())
    loss = hf.forward(tape, sh, w, **hf.step_options(model.config))
    tape.backward(loss)
    tape.drop(loss)
    out = []
    for e in tape.events:
        if e.label.startswith("+"):
            out.append(sum(size * c for (_, _, _, size), c in e.live) - base)
    return out


CASES = [
    # family, tied, precision
    ("llama", False, "fp32"),
    ("llama", True, "fp32"),
    ("mistral", False, "fp32"),
    ("qwen2", True, "fp32"),
    ("qwen2", False, "fp32"),
    ("qwen3", False, "fp32"),
    ("llama", False, "bf16"),
    ("qwen2", True, "bf16"),
    ("qwen3", False, "bf16"),
    ("mistral", False, "bf16"),
    ("llama", False, "amp"),
    ("llama", True, "amp"),
    ("qwen2", True, "amp"),
    ("qwen3", False, "amp"),
    ("mistral", False, "amp"),
]
EAGER = [
    ("llama", False, "fp32"),
    ("qwen2", True, "fp32"),
    ("qwen3", False, "fp32"),
    ("llama", False, "bf16"),
    ("qwen2", True, "bf16"),
    ("qwen3", False, "bf16"),
]


MATH = [
    ("llama", False, "fp32"),
    ("qwen2", True, "fp32"),
    ("qwen3", False, "bf16"),
    ("mistral", False, "fp32"),
    ("llama", False, "amp"),
]
"""SDPA's math backend (what CUDA runs for fp32 with grouped k/v, enable_gqa excluding the
efficient kernel): the model built for sdpa, the backend forced to MATH."""


@pytest.mark.parametrize(
    ("family", "tied", "precision", "attn"),
    [(*c, "sdpa") for c in CASES] + [(*c, "eager") for c in EAGER]
    + [(*c, "math") for c in MATH],
)  # fmt: skip
def test_hf_replay_matches_trace(family: str, tied: bool, precision: str, attn: str) -> None:
    dtype = torch.bfloat16 if precision == "bf16" else None
    amp = precision == "amp"
    math = attn == "math"
    model = _model(family, tied, dtype, "sdpa" if math else attn)
    measured = _measured(model, amp, math)
    replayed = _replayed(model, 2 if precision == "bf16" else 4, amp, math)
    assert max(replayed) == max(measured)
    first_diff = next(
        (i for i, (m, r) in enumerate(zip(measured, replayed, strict=False)) if m != r), None
    )
    assert first_diff is None, f"live totals part at allocation {first_diff}"
    assert len(replayed) == len(measured)


def test_shape_from_config_reads_the_structure() -> None:
    sh = hf.shape_from_config(_model("qwen2", True, None).config, B, S)
    assert (sh.qkv_bias, sh.o_bias, sh.qk_norm, sh.tied, sh.d) == (True, False, False, True, 16)
    sh3 = hf.shape_from_config(_model("qwen3", False, None).config, B, S)
    assert (sh3.qkv_bias, sh3.qk_norm, sh3.tied) == (False, True, False)
    assert hf.step_options(_model("mistral", False, None).config)["sliding_layers"] == 2
    assert hf.step_options(_model("llama", False, None).config)["sliding_layers"] == 0


def test_unmodelled_combinations_refuse() -> None:
    cfg = _model("mistral", False, None, "eager").config
    tape = Tape(inplace_accumulate=False)
    sh = hf.shape_from_config(cfg, B, S)
    with pytest.raises(NotImplementedError):
        hf.forward(tape, sh, hf.Weights(tape, sh), **hf.step_options(cfg))
