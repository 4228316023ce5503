"""Inference with a static KV cache for `verify.models.reference.ReferenceLM`, in plain PyTorch.

What `calc.step.inference` replays, line by line:

* ``new_cache``: per layer a K and a V tensor ``torch.zeros(b, kv_heads, context, head_dim)`` in
  the model's dtype, allocated up front (layer 0 K, layer 0 V, layer 1 K, ...), as a static
  cache (Hugging Face ``StaticCache``) does;
* ``prefill``: the model's forward over the prompt, each layer writing its (RoPE'd) k and the v
  into ``cache[:, :, :prompt]`` with ``copy_`` (no allocation) and attending over the filled part
  of the cache (SDPA, ``is_causal=True``); then the final norm over every position and the head
  on the last position only (``hidden[:, -1:]``), as generation does (``logits_to_keep=1``);
* ``decode_step``: one token at position ``pos``: its k/v written at ``cache[:, :, pos]``,
  attention of the one query over ``cache[:, :, :pos + 1]`` (no mask: the query is the last
  position), logits of that token.

Grad mode: ``torch.no_grad()``, as Hugging Face ``generate`` and `verify.run.step.prefill` run it.
``torch.inference_mode()`` would allocate exactly the same storages (neither saves anything for
backward; inference mode only drops version counters and view metadata), but would make the cache
inference tensors, which cannot be written in place outside inference mode afterwards.

The modules of the model are reused (``block._parts()``, the attention projections, the norms,
the MLP); only the attention forward is rewritten, to write into the cache. Dropout is off
(``model.eval()`` is the caller's; every dropout here is the eval-mode identity anyway).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verify.models.reference import Attention, Block, ReferenceLM, rotate_half

LayerCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's K and V tensors ``[batch, kv_heads, context, head_dim]`` (or `QuantKV`)."""
Cache = list[LayerCache]
"""Per layer, its `LayerCache`."""
Rope = tuple[torch.Tensor, torch.Tensor] | None
"""The rotary tables (cos, sin) for every position, or None (gpt2's learned positions)."""


class QuantKV:
    """One quantized K (or V) cache of a layer: ``int8`` values with one symmetric absmax
    scale per token and head (``[b, k, c, 1]`` in the model dtype), or ``fp8`` e4m3 values
    with one fp32 scale for the whole tensor (a calibrated per-layer scale, 1.0 here, as
    vLLM's ``k_scale``/``v_scale`` default)."""

    def __init__(self, shape: tuple[int, ...], kind: str, dtype: torch.dtype, device) -> None:
        self.kind = kind
        self.dtype = dtype
        if kind == "int8":
            self.values = torch.zeros(shape, dtype=torch.int8, device=device)
            self.scale = torch.zeros((*shape[:3], 1), dtype=dtype, device=device)
        else:
            self.values = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
            self.scale = torch.ones((), dtype=torch.float32, device=device)

    def write(self, x: torch.Tensor, start: int, end: int) -> None:
        """Quantize ``x`` ``[b, k, s, d]`` into positions ``start .. end``."""
        if self.kind == "int8":
            amax = x.abs().amax(-1, keepdim=True)
            amax.div_(127).clamp_min_(1e-8)
            q = (x / amax).round_().to(torch.int8)
            self.values[:, :, start:end] = q
            self.scale[:, :, start:end] = amax
            del q, amax
        else:
            self.values[:, :, start:end] = (x / self.scale).to(torch.float8_e4m3fn)

    def read(self, end: int) -> torch.Tensor:
        """Positions ``0 .. end`` dequantized to the model dtype (a new tensor)."""
        out = self.values[:, :, :end].to(self.dtype)
        out.mul_(self.scale[:, :, :end] if self.kind == "int8" else self.scale)
        return out


def new_cache(model: ReferenceLM, batch: int, context: int, kv_quant: str | None = None) -> Cache:
    """A zeroed static cache of ``context`` tokens per sequence, in the model's dtype, or
    quantized (`QuantKV`, per layer K then V) with ``kv_quant`` ``int8``/``fp8``."""
    spec = model.spec
    weight = model.head_weight()
    shape = (batch, spec.n_kv_heads, context, spec.head_dim)
    cache: Cache = []
    for _ in model.blocks:
        if kv_quant is not None:
            k = QuantKV(shape, kv_quant, weight.dtype, weight.device)
            v = QuantKV(shape, kv_quant, weight.dtype, weight.device)
            cache.append((k, v))  # type: ignore[arg-type]
            continue
        k = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        v = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        cache.append((k, v))
    return cache


def _attention(
    attn: Attention, x: torch.Tensor, rope: Rope, layer_cache: LayerCache, start: int
) -> torch.Tensor:
    """``Attention.forward`` for tokens ``start .. start + seq`` with k/v written to the cache.

    A prompt (``start == 0``) attends causally over itself; a single decoded token attends to
    every cached position up to and including its own."""
    spec = attn.spec
    bsz, seq, _ = x.shape
    a, kv, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
    end = start + seq
    if seq > 1 and start != 0:
        raise NotImplementedError("chunked prefill (a prompt after cached tokens) is not written")
    q, k, v = attn.heads(x)
    if rope is not None:
        cos, sin = rope[0][start:end].to(q.dtype), rope[1][start:end].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
    cache_k, cache_v = layer_cache
    if isinstance(cache_k, QuantKV):
        cache_k.write(k, start, end)
        cache_v.write(v, start, end)
        keys, values = cache_k.read(end), cache_v.read(end)
    else:
        cache_k[:, :, start:end] = k
        cache_v[:, :, start:end] = v
        keys, values = cache_k[:, :, :end], cache_v[:, :, :end]
    if seq > 1:
        out = attn.core(q, keys, values, 0.0)
    else:
        gqa = kv != a
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=False, enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(bsz, seq, a * hd)
    proj = attn.c_proj if spec.model_type == "gpt2" else attn.o_proj
    return proj(out)


def _block(
    block: Block, x: torch.Tensor, rope: Rope, layer_cache: LayerCache, start: int
) -> torch.Tensor:
    """``Block.forward`` (eval: no dropout) with the attention writing the cache. A function of
    its own, as the block is: the caller's ``x`` stays alive until the block returns."""
    norm1, attn, norm2, mlp = block._parts()
    x = x + _attention(attn, norm1(x), rope, layer_cache, start)
    return x + mlp(norm2(x))


def _forward(model: ReferenceLM, ids: torch.Tensor, cache: Cache, start: int) -> torch.Tensor:
    """Tokens ``ids`` at positions ``start ..`` through every layer (writing the cache); the
    logits of the last position ``[batch, 1, vocab]``."""
    spec = model.spec
    seq = ids.shape[1]
    if spec.model_type == "gpt2":
        pos = torch.arange(start, start + seq, device=ids.device)
        x = model.wte(ids) + model.wpe(pos)
        rope = None
    else:
        x = model.embed_tokens(ids)
        rope = (model.cos, model.sin)
    for block, layer_cache in zip(model.blocks, cache, strict=True):
        x = _block(block, x, rope, layer_cache, start)
    final = model.ln_f if spec.model_type == "gpt2" else model.norm
    hidden = final(x)
    del x
    return F.linear(hidden[:, -1:], model.head_weight())


@torch.no_grad()
def prefill(
    model: ReferenceLM, ids: torch.Tensor, context: int, kv_quant: str | None = None
) -> tuple[torch.Tensor, Cache]:
    """Prefill the prompt ``ids`` ``[batch, prompt]`` into a new cache of ``context`` tokens
    (quantized with ``kv_quant``: `QuantKV`).

    Returns the logits of the last prompt position ``[batch, 1, vocab]`` and the cache. RoPE
    models need ``model.set_rope(n)`` with ``n >= prompt`` (``context`` to decode afterwards).
    """
    if ids.shape[1] > context:
        raise ValueError(f"prompt of {ids.shape[1]} tokens does not fit a cache of {context}")
    cache = new_cache(model, ids.shape[0], context, kv_quant)
    logits = _forward(model, ids, cache, 0)
    return logits, cache


@torch.no_grad()
def decode_step(model: ReferenceLM, cache: Cache, next_id: torch.Tensor, pos: int) -> torch.Tensor:
    """One generated token ``next_id`` ``[batch, 1]`` at position ``pos`` (the number of tokens
    already cached): its k/v go to ``cache[:, :, pos]``; returns its logits ``[batch, 1, vocab]``."""
    first = cache[0][0]
    context = (first.values if isinstance(first, QuantKV) else first).shape[2]
    if not 0 < pos < context:
        raise ValueError(f"pos={pos} must be in [1, {context}) for a cache of {context} tokens")
    return _forward(model, next_id, cache, pos)
