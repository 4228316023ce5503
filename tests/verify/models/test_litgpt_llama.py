"""verify's copy of LitGPT's Llama against litgpt 0.5.12 itself (skipped where litgpt does not
import: its package imports Lightning, which the project does not need), called as
``finetune/full.py`` calls it: through Fabric's wrapper (``fabric.setup_module``, lightning
2.5), whose ``bf16-true`` precision hands back fp32 logits. Same weights: same parameters in
the same order, same logits, loss and gradients, and the same bytes on the CPU tracker through
two iterations of its fine-tuning loop (the logits and the loss kept until the next iteration
replaces them)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
lit_model = pytest.importorskip("litgpt.model")
lit_config = pytest.importorskip("litgpt.config")
lit_utils = pytest.importorskip("litgpt.utils")
fabric_mod = pytest.importorskip("lightning.fabric")

from calc.config.jobs import Training  # noqa: E402
from calc.config.model_spec import ModelSpec  # noqa: E402
from calc.models import litgpt_arch  # noqa: E402
from calc.models.litgpt_arch import arch_of  # noqa: E402
from tests.verify.models.iterations import (  # noqa: E402
    assert_same_bytes_and_gradients,
    two_iterations,
)
from verify.cases.scale import scaled_spec  # noqa: E402
from verify.models import litgpt_llama  # noqa: E402

SEQ = 32


def config_fields(spec) -> dict:
    """litgpt ``Config`` fields for ``spec`` (`calc.models.litgpt_arch`'s fields spelled out)."""
    arch = arch_of(spec)
    mlp = "GptNeoxMLP" if spec.mlp == "gelu" else "GemmaMLP" if arch.gemma else "LLaMAMLP"
    return dict(
        name="Gemma-copy" if arch.gemma else "copy",  # RMSNorm's unit offset: "Gemma" in name
        scale_embeddings=arch.gemma, block_size=spec.max_positions, vocab_size=spec.vocab,
        padded_vocab_size=spec.vocab, n_layer=spec.n_layers, n_head=spec.n_heads,
        n_embd=spec.hidden, n_query_groups=spec.n_kv_heads, head_size=spec.head_dim,
        rotary_percentage=float(arch.rope_fraction), parallel_residual=arch.parallel_residual,
        shared_attention_norm=arch.shared_attention_norm, bias=spec.o_bias,
        attn_bias=spec.qkv_bias and not spec.o_bias,
        lm_head_bias=arch.head_bias,
        norm_class_name="LayerNorm" if spec.norm == "layernorm" else "RMSNorm",
        norm_eps=spec.norm_eps, mlp_class_name=mlp,
        gelu_approximate=arch.gelu_approximate, intermediate_size=spec.ffn,
        rope_base=int(spec.rope_theta or 10000), sliding_window_size=spec.sliding_window,
        norm_qk=spec.qk_norm,
    )  # fmt: skip


def _pair(kv_heads: int, dtype: torch.dtype, seq: int = SEQ, card: str = "llama-3.1-8b",
          spec=None):  # fmt: skip
    spec = spec or scaled_spec(card, kv_heads=kv_heads, layers=2)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    job = Training(micro_batch=2, seq_len=seq, precision=precision, implementation="litgpt")
    torch.manual_seed(0)
    ours = litgpt_llama.build(spec, job, dtype)
    config = lit_config.Config(**config_fields(spec))
    fabric = fabric_mod.Fabric(
        accelerator="cpu", devices=1, precision={"fp32": "32-true", "bf16": "bf16-true"}[precision]
    )
    with fabric.init_module(empty_init=False):
        theirs = lit_model.GPT(config)
    # setup_module converts the model, buffers included, and wraps it (_FabricModule)
    theirs = fabric.setup_module(theirs)
    theirs.max_seq_length = seq  # finetune/full.py's fit: the longest training sequence
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        q.data.copy_(p.data)
    return spec, ours, theirs


def _their_step(model, accumulation: int):
    state: dict = {}

    def step(ids, targets):
        state["logits"] = model(ids)
        state["loss"] = lit_utils.chunked_cross_entropy(
            state["logits"][..., :-1, :], targets[..., 1:]
        )
        return state["loss"] / accumulation

    return step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 4])
def test_copy_matches_litgpt(kv_heads: int, dtype: torch.dtype) -> None:
    # bf16-true and 32-true; grouped (1 key/value head) and multi-head (4) attention
    spec, ours, theirs = _pair(kv_heads, dtype)
    names = [n for n, _ in theirs.module.named_parameters()]  # the wrapped model's
    assert [n for n, _ in ours.named_parameters()] == names
    assert names[:2] == ["lm_head.weight", "transformer.wte.weight"]
    assert ours.cos.dtype == theirs.cos.dtype == torch.float32  # rebuilt at SEQ < block_size
    torch.testing.assert_close(ours.cos, theirs.cos, rtol=0, atol=0)
    ids = torch.randint(0, spec.vocab, (2, SEQ))
    wrapped = litgpt_llama.fabric_output(ours(ids), dtype != torch.float32)
    assert wrapped.dtype == theirs(ids).dtype == torch.float32  # bf16-true: fp32 logits
    torch.testing.assert_close(wrapped, theirs(ids), rtol=0, atol=0)
    mine = litgpt_llama.FineTuneLoss(ours, accumulation=1)
    peaks = [two_iterations(s, m, ids) for s, m in ((mine, ours), (_their_step(theirs, 1), theirs))]
    assert peaks[0] == peaks[1]
    torch.testing.assert_close(mine(ids, ids), _their_step(theirs, 1)(ids, ids), rtol=0, atol=0)


@pytest.mark.parametrize(("batch", "seq"), [(1, 129), (2, 200), (1, 256)])
def test_chunked_loss_matches_litgpt_over_several_chunks(batch: int, seq: int) -> None:
    # 128, 398 and 255 rows: one whole chunk; three and 14 rows; one and 127 rows (the last
    # at the block size, its tables left in bf16)
    spec, ours, theirs = _pair(1, torch.bfloat16, seq=seq)
    ids = torch.randint(0, spec.vocab, (batch, seq))
    mine = litgpt_llama.FineTuneLoss(ours, accumulation=1)
    assert_same_bytes_and_gradients(mine, _their_step(theirs, 1), (ours, theirs), ids)


@pytest.mark.parametrize(("dtype", "seq"), [(torch.bfloat16, SEQ), (torch.float32, 129)])
def test_sliding_window_mask_matches_litgpt(dtype: torch.dtype, seq: int) -> None:
    # Mistral-7B-v0.1's litgpt configuration has sliding_window_size=4096: every block builds
    # its additive mask and hands it to SDPA (is_causal=False), whatever the length
    spec, ours, theirs = _pair(1, dtype, seq=seq, card="mistral-7b-v0.1")
    assert spec.sliding_window is not None
    assert all(block.attn.apply_sliding_window_attention for block in theirs.module.transformer.h)
    ids = torch.randint(0, spec.vocab, (2, seq))
    mine = litgpt_llama.FineTuneLoss(ours, accumulation=1)
    assert_same_bytes_and_gradients(mine, _their_step(theirs, 1), (ours, theirs), ids)


PHI = {
    "model_type": "phi", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 256, "vocab_size": 512,
    "max_position_embeddings": 256, "partial_rotary_factor": 0.5, "hidden_act": "gelu_new",
    "layer_norm_eps": 1e-5, "qk_layernorm": False, "tie_word_embeddings": False,
}  # fmt: skip
"""microsoft/phi-2's config.json keys at a small width (RoPE on half of each head)."""
NEOX = {
    "model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 512,
    "max_position_embeddings": 256, "rotary_pct": 0.25, "hidden_act": "gelu",
    "use_parallel_residual": True, "tie_word_embeddings": False,
}  # fmt: skip
"""stabilityai/stablelm-base-alpha-3b's config.json keys at a small width."""
FALCON = {
    "model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "vocab_size": 512, "max_position_embeddings": 256, "multi_query": True,
    "new_decoder_architecture": False, "parallel_attn": True, "bias": False, "alibi": False,
    "tie_word_embeddings": False,
}  # fmt: skip
"""tiiuae/falcon-7b's config.json keys at a small width (multi-query, no biases)."""
GEMMA = {
    "model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 256, "vocab_size": 512,
    "max_position_embeddings": 256, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}  # fmt: skip
"""google/gemma-2b's config.json keys at a small width (one key/value head, heads wider than
hidden / heads, as Gemma-7B's)."""


def family_spec(config: dict):
    return litgpt_arch.as_built(ModelSpec.from_hf_config(config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "config", [PHI, NEOX, FALCON, GEMMA], ids=["phi", "gpt_neox", "falcon", "gemma"]
)
def test_each_family_matches_litgpt(config: dict, dtype: torch.dtype) -> None:
    # phi-2 (norm_1 shared, biases on the head too, RoPE on half a head), GPT-NeoX (its own
    # norm_2, RoPE on a quarter), Falcon (multi-query, no biases): LayerNorm, GptNeoxMLP; Gemma
    # (GemmaMLP, scaled embeddings, RMSNorm's unit offset); same parameters, bytes, gradients
    spec, ours, theirs = _pair(4, dtype, seq=40, spec=family_spec(config))
    assert spec.n_kv_heads == (1 if config in (FALCON, GEMMA) else 4)
    names = [n for n, _ in theirs.module.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == names
    assert ("lm_head.bias" in names) == (config is PHI)
    assert ("transformer.h.0.norm_2.weight" in names) == (config in (NEOX, GEMMA))  # not shared
    ids = torch.randint(0, spec.vocab, (2, 40))
    mine = litgpt_llama.FineTuneLoss(ours, accumulation=1)
    assert_same_bytes_and_gradients(mine, _their_step(theirs, 1), (ours, theirs), ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen2_attention_bias_matches_litgpt(dtype: torch.dtype) -> None:
    # litgpt's Qwen2.5 configurations: attn_bias (the qkv's alone), untied head
    spec = litgpt_arch.as_built(scaled_spec("qwen2.5-0.5b", kv_heads=2, layers=2))
    spec, ours, theirs = _pair(2, dtype, seq=40, spec=spec)
    names = [n for n, _ in theirs.module.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == names
    assert (
        "transformer.h.0.attn.qkv.bias" in names and "transformer.h.0.attn.proj.bias" not in names
    )
    ids = torch.randint(0, spec.vocab, (2, 40))
    mine = litgpt_llama.FineTuneLoss(ours, accumulation=1)
    assert_same_bytes_and_gradients(mine, _their_step(theirs, 1), (ours, theirs), ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_qwen3_head_norms_match_litgpt(dtype: torch.dtype, kv_heads: int) -> None:
    # litgpt's Qwen3 configurations: norm_qk (an RMSNorm of head_size on each head of q and
    # k, after the transpose), registered after attn.proj; untied head
    spec = litgpt_arch.as_built(scaled_spec("qwen3-8b", kv_heads=kv_heads, layers=2))
    spec, ours, theirs = _pair(kv_heads, dtype, seq=40, spec=spec)
    names = [n for n, _ in theirs.module.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == names
    assert names[3:7] == [
        "transformer.h.0.attn.qkv.weight", "transformer.h.0.attn.proj.weight",
        "transformer.h.0.attn.norm_q.weight", "transformer.h.0.attn.norm_k.weight",
    ]  # fmt: skip
    ids = torch.randint(0, spec.vocab, (2, 40))
    mine = litgpt_llama.FineTuneLoss(ours, accumulation=1)
    assert_same_bytes_and_gradients(mine, _their_step(theirs, 1), (ours, theirs), ids)


def test_tables_stay_in_the_model_dtype_at_the_full_block_size() -> None:
    # max_seq_length == block_size: the setter keeps the converted bf16 tables
    spec = scaled_spec("llama-3.1-8b", kv_heads=1, layers=1)
    _, ours, theirs = _pair(1, torch.bfloat16, seq=spec.max_positions)
    assert ours.cos.dtype == theirs.cos.dtype == torch.bfloat16
    assert ours.cos.shape == theirs.cos.shape == (spec.max_positions, spec.head_dim)
