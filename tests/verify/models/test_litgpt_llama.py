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
from tests.verify.models.iterations import (  # noqa: E402
    assert_same_bytes_and_gradients,
    two_iterations,
)
from verify.cases.scale import scaled_spec  # noqa: E402
from verify.models import litgpt_llama  # noqa: E402

SEQ = 32


def _pair(kv_heads: int, dtype: torch.dtype, seq: int = SEQ, card: str = "llama-3.1-8b"):
    spec = scaled_spec(card, kv_heads=kv_heads, layers=2)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    job = Training(micro_batch=2, seq_len=seq, precision=precision, implementation="litgpt")
    torch.manual_seed(0)
    ours = litgpt_llama.build(spec, job, dtype)
    config = lit_config.Config(
        name="copy", block_size=spec.max_positions, vocab_size=spec.vocab,
        padded_vocab_size=spec.vocab, n_layer=spec.n_layers, n_head=spec.n_heads,
        n_embd=spec.hidden, n_query_groups=spec.n_kv_heads, head_size=spec.head_dim,
        rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        norm_eps=spec.norm_eps, mlp_class_name="LLaMAMLP", intermediate_size=spec.ffn,
        rope_base=int(spec.rope_theta or 10000), sliding_window_size=spec.sliding_window,
    )  # fmt: skip
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


def test_tables_stay_in_the_model_dtype_at_the_full_block_size() -> None:
    # max_seq_length == block_size: the setter keeps the converted bf16 tables
    spec = scaled_spec("llama-3.1-8b", kv_heads=1, layers=1)
    _, ours, theirs = _pair(1, torch.bfloat16, seq=spec.max_positions)
    assert ours.cos.dtype == theirs.cos.dtype == torch.bfloat16
    assert ours.cos.shape == theirs.cos.shape == (spec.max_positions, spec.head_dim)
