"""Hugging Face transformers 5.24 ``GPT2LMHeadModel`` forward over a KV cache, no grad: the
prefill into a ``StaticCache`` (what `verify.run.step.prefill` runs for ``implementation="hf"``,
as `calc.models.hf_inference` for the llama family) and the forward `calc.models.hf_generate`
runs at each ``generate`` step.

``modeling_gpt2.py``: ``wte`` and ``wpe`` embeddings added; per block ``ln_1``, ``c_attn``
(``Conv1D``: ``addmm``), the split and head views, ``cache.update`` (a static layer's lazy
``zeros`` and in-place write, `calc.models.hf_inference.StaticLayer`; a dynamic layer's
``torch.cat``), SDPA with ``is_causal`` over the prompt and no mask (a static cache's decode step
passes a boolean mask), ``c_proj``, the residual, ``ln_2``, the MLP (`calc.models.hf_gpt2.mlp`),
the residual; ``ln_f``; ``lm_head`` on the last position (``logits_to_keep=1``). Eval mode: no
dropout. Checked against the CPU storage tracker by the ``infer-hf-gpt2-*`` and ``gen-*gpt2*``
verify cases (exact).
"""

from __future__ import annotations

from calc import symbols as S
from calc.config.jobs import Inference
from calc.config.model_spec import ModelSpec
from calc.models import hf, hf_gpt2
from calc.models import reference as R
from calc.models.hf_inference import (
    RESIDUAL,
    CacheLayer,
    Compress,
    StaticLayer,
    check,
    no_grad_tape,
    sdpa_bool_mask,
)
from calc.models.shape import shape_for_inference
from calc.replay import ops
from calc.replay.kinds import StorageKind
from calc.replay.tape import Event, Size, Tape, Tensor

INT64 = 8

__all__ = ["gpt2_attention", "gpt2_forward", "replay_prefill"]


def gpt2_attention(
    tape: Tape, sh: R.Shape, x: Tensor, lw: dict, layer: CacheLayer,
    mask_numel: Size | None = None,
) -> Tensor:  # fmt: skip
    """``GPT2Attention.forward`` over a cache, no grad (modeling_gpt2.py): ``c_attn``, the split
    and head views, ``cache.update`` (the cat copies, or a static layer's in-place write), SDPA
    (no mask at the prefill nor over a dynamic cache; a static cache's decode step passes the
    boolean mask of ``mask_numel``), ``c_proj``; the fused qkv output dies with the query view,
    after ``c_proj``."""
    n = sh.b * sh.s
    qkv = hf_gpt2.conv1d(tape, x, lw["qkv"], lw["qkv.b"], n, 3 * sh.h, "c_attn")
    q, k, v = tape.alias(qkv), tape.alias(qkv), tape.alias(qkv)  # split, view, transpose
    tape.drop(qkv)
    keys, values = layer.update(tape, sh, k, v)
    tape.drop(k, v)
    mask = None if mask_numel is None else sdpa_bool_mask(tape, mask_numel, q.itemsize)
    out = ops.sdpa_flash(tape, q, keys, values, sh.b * sh.a * sh.s, "attn")
    tape.drop(mask)
    o = tape.alias(out)  # the [b, s, a, d] kernel output: reshape and transpose are views
    tape.drop(out)
    y = hf_gpt2.conv1d(tape, o, lw["o"], lw["o.b"], n, sh.h, "attn.c_proj")
    tape.drop(o, q, keys, values)
    return y


def gpt2_forward(
    tape: Tape, sh: R.Shape, w: R.Weights, layers: list[CacheLayer], pos: Tensor | None,
    mask_numel: Size | None = None,
) -> Tensor:  # fmt: skip
    """``GPT2LMHeadModel.forward(input_ids, position_ids=pos, cache, logits_to_keep=1)``: the
    token and position embeddings (``pos``: ``[b, s]`` position ids from ``generate``; None:
    ``GPT2Model`` makes ``[1, s]`` from the cache position, freed after ``ln_f``), the blocks
    (`calc.models.hf_gpt2.block` with `gpt2_attention`), ``ln_f``, logits ``[b, V]``."""
    n = sh.b * sh.s
    tape.segment = "embed"
    tok = ops.embedding(tape, w.embed, n, sh.h, "wte_out")
    own = None
    if pos is None:  # position_ids = cache_position.unsqueeze(0): arange(s) + past (0)
        ar = ops.plain(tape, sh.s, INT64, "arange")
        own = pos = ops.plain(tape, sh.s, INT64, "position_ids")
        tape.drop(ar)
    rows = n if own is None else sh.s  # positions [b, s] from generate, [1, s] here
    assert w.wpe is not None  # GPT-2's learned positions
    pe = ops.embedding(tape, w.wpe, rows, sh.h, "wpe_out", indices=pos)
    x = ops.add_cast_in_formula(tape, tok, pe, "embed_out")
    for j, (lw, layer) in enumerate(zip(w.layers, layers, strict=True)):
        tape.segment = j

        def attend(tape: Tape, sh: R.Shape, x: Tensor, lw: dict, layer: CacheLayer = layer):
            return gpt2_attention(tape, sh, x, lw, layer, mask_numel)

        x_next, _ = hf_gpt2.block(tape, sh, x, lw, None, True, attend)
        x_next.storage.tag = RESIDUAL
        tape.drop(x)
        x = x_next
    tape.segment = "head"
    hid = ops.layer_norm(tape, x, w.norm, w.norm_b, n)
    tape.drop(x, own, tok, pe)
    last = tape.alias(hid, numel=sh.b * sh.h)  # hidden_states[:, -1:, :]
    logits = hf.linear(tape, last, w.head, None, sh.b, sh.V, "logits")
    tape.drop(last, hid)
    return logits


def replay_prefill(
    model: ModelSpec, job: Inference, device: str, n_layers: int, compress: Compress | None = None
) -> list[Event]:
    """The HF prefill of ``job`` for GPT-2 (`calc.models.hf_inference.replay_hf_prefill`'s
    protocol): a ``StaticCache`` of ``context`` tokens, ``logits_to_keep=1``, then ``del out,
    cache``; sizes in ``b, s, c``."""
    sh = shape_for_inference(model, job, device, n_layers)
    check(model, job, sh)
    if job.kv_quant is not None:
        raise NotImplementedError("a quantized KV cache with implementation='hf' is not modelled")
    tape, w = no_grad_tape(sh, job.quant, job.precision, compress)
    tape.existing(sh.b * sh.s, INT64, "input_ids", StorageKind.INPUT)
    tape.phase = "prefill"
    layers = []
    for j in range(sh.n_layers):  # StaticCache(config, max_cache_len=context)
        tape.segment = j
        layers.append(StaticLayer(tape, j, S.c, sh.device))
    logits = gpt2_forward(tape, sh, w, list(layers), None)
    tape.drop(logits)  # del out
    tape.segment = "head"
    for layer in layers:  # del cache
        layer.free(tape)
    return tape.events
