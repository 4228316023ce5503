"""KV-cache quantization for inference: the stored cache and what writing and reading it makes.

Two layouts (``calc.Inference.kv_quant``), as verify's ``reference_inference.QuantKV`` stores
them, per layer K then V:

* ``int8``: int8 values ``[b, k, c, d]`` plus one symmetric absmax scale per token and head
  ``[b, k, c, 1]`` in the model dtype (per-token quantization as in KIVI, Liu et al. 2024,
  arXiv 2402.02750, and Hugging Face's ``QuantizedCache``, without their full-precision
  residual window): ``d + itemsize`` bytes per token, head and tensor;
* ``fp8``: e4m3 values ``[b, k, c, d]`` plus one fp32 scale per tensor (vLLM's per-layer
  ``k_scale``/``v_scale``): ``d`` bytes per token and head, 1 byte per element
  (memory-facts §2.8: "fp8 KV -> 1 byte").

Writing a token quantizes it (int8: ``abs``, ``amax``, ``x / scale``, ``to(int8)``; fp8:
``x / scale``, ``to(fp8)``; temporaries of the new tokens only). Reading dequantizes the filled
part to the model dtype (``values[:, :, :end].to(dtype)``, ``mul_`` by the scales in place):
one dense K and one dense V of ``end`` tokens are alive while the layer attends.
"""

from __future__ import annotations

import sympy as sp

from calc.replay.tape import Size, Tape, Tensor

FP8_SCALE_BYTES = 4
"""One fp32 scale per K (or V) tensor of a layer."""


def bytes_per_token(kind: str | None, kv_heads: int, head_dim: int, itemsize: int) -> sp.Integer:
    """KV-cache bytes per token per layer (K and V together), scales included: ``None``
    ``2*k*d*itemsize``; ``int8`` ``2*k*(d + itemsize)``; ``fp8`` ``2*k*d`` (plus 8 bytes of
    per-layer scales, not per token)."""
    if kind is None:
        return sp.Integer(2 * kv_heads * head_dim * itemsize)
    if kind == "int8":
        return sp.Integer(2 * kv_heads * (head_dim + itemsize))
    if kind == "fp8":
        return sp.Integer(2 * kv_heads * head_dim)
    raise ValueError(f"kv_quant={kind!r} must be one of ('int8', 'fp8') or None")


def cache(
    tape: Tape, kind: str, b: Size, k: Size, d: Size, context: Size, itemsize: int, n_layers: int
) -> None:
    """``new_cache(..., kv_quant)``: per layer K values, K scale, V values, V scale."""
    numel = b * k * context * d
    for j in range(n_layers):
        tape.segment = j
        for name in ("k_cache", "v_cache"):
            tape.new(numel, 1, name, kind="kv_cache", tag=j)
            if kind == "int8":
                tape.new(b * k * context, itemsize, f"{name}.scale", kind="kv_cache", tag=j)
            else:
                tape.new(1, FP8_SCALE_BYTES, f"{name}.scale", kind="kv_cache", tag=j)


def attend_hook(kind: str, end_tokens: Size, per_token_numel: Size, head_dim: Size):
    """The hook `calc.models.reference.attention` calls with the layer's new (RoPE'd) ``k``
    and ``v``: writes both into the quantized cache, then reads ``end_tokens`` of each back
    dequantized. ``per_token_numel`` is ``b * k * d``. Returns the dense keys and values."""

    def hook(tape: Tape, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        for x in (k, v):
            _write(tape, kind, x, head_dim)
        numel = per_token_numel * end_tokens
        keys = tape.new(numel, k.itemsize, "kv.read_k")
        values = tape.new(numel, v.itemsize, "kv.read_v")
        return keys, values

    return hook


def _write(tape: Tape, kind: str, x: Tensor, head_dim: Size) -> None:
    """``QuantKV.write(x, ...)``: the temporaries of quantizing the new tokens."""
    if kind == "int8":
        absx = tape.new(x.numel, x.itemsize, "kv.abs")
        amax = tape.new(sp.sympify(x.numel) / head_dim, x.itemsize, "kv.amax")
        tape.drop(absx)
        div = tape.new(x.numel, x.itemsize, "kv.div")
        q = tape.new(x.numel, 1, "kv.q")
        tape.drop(div, q, amax)
    else:
        div = tape.new(x.numel, x.itemsize, "kv.div")
        q = tape.new(x.numel, 1, "kv.q")
        tape.drop(div, q)
