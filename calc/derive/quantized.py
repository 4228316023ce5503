"""The weight-only quantized linear the recording (and verify's runs) put in a model.

A plain-PyTorch stand-in for bitsandbytes' ``Linear4bit``/``Linear8bitLt`` and the int4/fp8
weight-only linears, whose memory `calc.compress.quant` replays op by op:

* `quant_linear_class` makes ``QuantLinear``, which holds a decoder linear's weight as integer
  (or fp8) tensors with their scales, as buffers: ``int8`` (int8, or uint8 with a zero point)
  ``[out, in]``; ``int4`` two values a byte, uint8 ``[out, in/2]``; ``nf4`` as bitsandbytes
  stores ``Params4bit``: the flattened weight packed two a byte ``[out*in/2]``, one absmax per
  block (fp32, or with double quantization a uint8 code per block, an fp32 absmax per 256
  blocks and an fp32 offset) and the 16-entry NF4 table; ``fp8`` e4m3 ``[out, in]`` with an
  fp32 scale per tensor or per row.
* Its forward and backward go through ``QuantMatmul``, a custom autograd Function that keeps
  only a reference to the module (no saved activations: the packed weight is all it needs) and
  dequantizes the weight to the compute dtype in forward and again in backward (the dense
  weight is a transient of one matmul, as bitsandbytes' ``MatMul4Bit`` does).

The NF4 table is the QLoRA paper's (Dettmers et al. 2023, Appendix E; bitsandbytes
``get_4bit_type``); the double-quantized absmax map is arithmetic (``q/127.5 - 1``), so no table.
verify's runs (``verify/models/compress.py``) and the derived recording (`calc.derive.record`)
build the same module, as both run transformers' modeling code. torch is imported only inside
`quant_linear_class`: ``calc`` imports without it.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from calc.derive.linears import SITES, parent_of

if TYPE_CHECKING:
    from calc.config.compression import Quant

NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
"""The 16 NormalFloat-4 levels (QLoRA paper, Appendix E; bitsandbytes ``get_4bit_type``)."""
NESTED_BLOCK = 256
"""Blocks of absmax values sharing one fp32 second-level absmax (double quantization)."""
SCALE_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _scale_dtype(name: str) -> Any:
    import torch

    return getattr(torch, SCALE_DTYPES[name])


def _quantize_int(mod: Any, w: Any, quant: Quant) -> None:
    """int8 / int4 per group of ``quant.group`` inputs (the whole row without one), symmetric or
    with a zero point: ``packed``, ``scale`` (and ``zero``) buffers on ``mod``."""
    import torch

    out_f, in_f = w.shape
    g = quant.group or in_f
    if in_f % g:
        raise ValueError(f"group_size={g} does not divide in_features={in_f}")
    bits = 8 if quant.method == "int8" else 4
    sdt = _scale_dtype(quant.scale_dtype or ("fp32" if bits == 8 else "fp16"))
    wg = w.view(out_f, in_f // g, g)
    if quant.has_zero_point:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
        zero = torch.round(-lo / scale)
        q = torch.clamp(torch.round(wg / scale[..., None]) + zero[..., None], 0, 2**bits - 1)
        mod.register_buffer("zero", zero.to(sdt))
    else:
        scale = (wg.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp_min(1e-8)
        q = torch.round(wg / scale[..., None]).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        mod.zero = None
    mod.register_buffer("scale", scale.to(sdt))
    q = q.view(out_f, in_f)
    if bits == 8:
        packed = q.to(torch.uint8 if quant.has_zero_point else torch.int8)
    else:
        u = (q if quant.has_zero_point else q + 8).to(torch.uint8).view(out_f, in_f // 2, 2)
        packed = u[..., 0] | (u[..., 1] << 4)
    mod.register_buffer("packed", packed.contiguous())
    mod.group = g
    mod.symmetric4 = bits == 4 and not quant.has_zero_point


def _quantize_nf4(mod: Any, w: Any, quant: Quant) -> None:
    """NF4 per block of ``quant.group`` elements of the flattened weight, as bitsandbytes'
    ``Params4bit`` (double quantization: the absmax as uint8 codes, an fp32 absmax per
    `NESTED_BLOCK` blocks and an fp32 offset)."""
    import torch
    import torch.nn.functional as F

    block = quant.group
    flat = w.reshape(-1)
    if flat.numel() % block:
        raise ValueError(f"group_size={block} does not divide the weight's {flat.numel()}")
    blocks = flat.view(-1, block)
    absmax = blocks.abs().amax(-1).clamp_min(1e-8)
    # torch.tensor(list) allocates outside the dispatcher, where the CPU tracker cannot see
    # it; the clone is an op (the table is a real per-tensor buffer either way). On another
    # device the table moves there (a no-op on the CPU).
    code = torch.tensor(NF4_CODE).clone().to(w.device)
    idx = (blocks / absmax[:, None]).unsqueeze(-1).sub(code).abs().argmin(-1)
    idx = idx.to(torch.uint8).view(-1, 2)
    mod.register_buffer("packed", (idx[:, 0] << 4) | idx[:, 1])  # bnb: first in high nibble
    mod.register_buffer("code", code)
    mod.block = block
    mod.double_quant = quant.double_quant
    if not quant.double_quant:
        mod.register_buffer("absmax", absmax)
        return
    offset = absmax.mean()
    centred = absmax - offset
    n_nested = math.ceil(centred.numel() / NESTED_BLOCK)
    padded = F.pad(centred, (0, n_nested * NESTED_BLOCK - centred.numel()))
    absmax2 = padded.view(n_nested, NESTED_BLOCK).abs().amax(-1).clamp_min(1e-12)
    scaled = (padded.view(n_nested, NESTED_BLOCK) / absmax2[:, None]).reshape(-1)
    qa = torch.round((scaled[: centred.numel()] + 1) * 127.5).clamp(0, 255)
    mod.register_buffer("qabsmax", qa.to(torch.uint8))
    mod.register_buffer("absmax2", absmax2)
    mod.register_buffer("offset", offset.reshape(()))


def _quantize_fp8(mod: Any, w: Any, quant: Quant) -> None:
    """fp8 e4m3 with an fp32 scale per tensor or per row."""
    import torch

    fmax = torch.finfo(torch.float8_e4m3fn).max
    if quant.fp8_scaling == "row":
        scale = (w.abs().amax(-1) / fmax).clamp_min(1e-12)
        q = (w / scale[:, None]).to(torch.float8_e4m3fn)
    else:
        scale = (w.abs().amax() / fmax).clamp_min(1e-12).reshape(1)
        q = (w / scale).to(torch.float8_e4m3fn)
    mod.register_buffer("packed", q)
    mod.register_buffer("scale", scale.float())
    mod.row = quant.fp8_scaling == "row"


def dequantize(mod: Any, dtype: Any) -> Any:
    """The dense ``[out, in]`` weight of ``mod`` in ``dtype`` (allocations as
    ``calc.compress.quant`` lists)."""
    import torch

    out_f, in_f = mod.out_features, mod.in_features
    if mod.method == "nf4":
        return _dequantize_nf4(mod, dtype)
    if mod.method == "fp8":
        w = mod.packed.to(dtype)
        s = mod.scale.to(dtype)
        w.mul_(s[:, None] if mod.row else s)
        del s
        return w
    if mod.method == "int8":
        w = mod.packed.to(dtype)
    else:
        lo = mod.packed & 15
        hi = mod.packed >> 4
        q = torch.stack((lo, hi), dim=-1)
        del lo, hi
        w = q.view(out_f, in_f).to(dtype)
        del q
        if mod.symmetric4:
            w.sub_(8)
    wg = w.view(out_f, in_f // mod.group, mod.group)
    if mod.zero is not None:
        z = mod.zero.to(dtype)
        wg.sub_(z[..., None])
        del z
    s = mod.scale.to(dtype)
    wg.mul_(s[..., None])
    del s, wg
    return w


def _dequantize_nf4(mod: Any, dtype: Any) -> Any:
    import torch

    if mod.double_quant:
        qa = mod.qabsmax.to(torch.float32)
        qa.div_(127.5).sub_(1)
        s2 = mod.absmax2.repeat_interleave(NESTED_BLOCK)
        qa.mul_(s2[: qa.numel()])
        del s2
        qa.add_(mod.offset)
        absmax = qa.to(dtype)
        del qa
    else:
        absmax = mod.absmax.to(dtype)
    hi = mod.packed >> 4
    lo = mod.packed & 15
    idx = torch.stack((hi, lo), dim=-1)
    del hi, lo
    idx32 = idx.view(-1).to(torch.int32)
    del idx
    code = mod.code.to(dtype)
    w = code[idx32]
    del idx32, code
    w.view(-1, mod.block).mul_(absmax[:, None])
    del absmax
    return w.view(mod.out_features, mod.in_features)


_QUANTIZE = {"int8": _quantize_int, "int4": _quantize_int, "nf4": _quantize_nf4,
             "fp8": _quantize_fp8}  # fmt: skip


@lru_cache(maxsize=1)
def quant_linear_class() -> Any:
    """``QuantLinear(linear, quant)``: the class (made on first use; it subclasses
    ``torch.nn.Module``), whose matmul is ``QuantMatmul``: ``x @ dequant(W).T + b`` keeping only
    a reference to the module for the backward, which dequantizes again."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class QuantMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, module: Any) -> Any:
            ctx.module = module  # a reference, not a saved tensor: nothing new is kept
            w = dequantize(module, x.dtype)
            out = F.linear(x, w, module.bias)
            del w
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
            if not ctx.needs_input_grad[0]:
                return None, None
            w = dequantize(ctx.module, grad.dtype)
            gx = grad.matmul(w)
            del w
            return gx, None

    class QuantLinear(nn.Module):
        """A frozen linear whose weight is stored quantized (see the module docstring)."""

        def __init__(self, linear: Any, quant: Quant) -> None:
            super().__init__()
            out_f, in_f = linear.weight.shape
            self.out_features, self.in_features = out_f, in_f
            self.method = quant.method
            _QUANTIZE[quant.method](self, linear.weight.detach().float(), quant)
            bias = linear.bias
            self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

        def forward(self, x: Any) -> Any:
            return QuantMatmul.apply(x, self)

    return QuantLinear


def quantize_head(model: Any, quant: Quant) -> None:
    """Replace the output linear of the Hugging Face ``model`` with a ``QuantLinear`` of
    ``quant`` (a tied head gets its own quantized copy; the embedding keeps its matrix);
    ``NotImplementedError`` for a model without an ``nn.Linear`` head behind
    ``get_output_embeddings``."""
    import torch

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if not isinstance(head, torch.nn.Linear):
        raise NotImplementedError(
            f"a quantized LM head of {type(head).__name__} (Hugging Face nn.Linear heads only)"
        )
    model.set_output_embeddings(quant_linear_class()(head, quant))


def apply(model: Any, layers: Any, quant: Quant) -> None:
    """Replace every decoder linear of ``layers`` (`calc.derive.linears.SITES`: the
    llama-family projections, Phi-3's fused ones, latent attention's, shared experts'; routed
    MoE experts are not ``nn.Linear``s and stay dense) with a ``QuantLinear``, in place
    (verify's ``compress.apply`` does the same);
    with ``lm_head`` left out of ``keep_16bit``, ``model``'s output linear too (Lightning's
    bitsandbytes plugin replaces every ``nn.Linear``; a tied head gets its own quantized copy,
    the embedding keeps the 16-bit matrix). Embeddings are ``nn.Embedding``, never quantized
    there: ``keep_16bit`` without ``embed`` is refused."""
    import torch

    if "embed" not in quant.keep_16bit:
        raise NotImplementedError(
            "quantized embeddings are not recorded (bitsandbytes quantizes nn.Linear layers)"
        )
    cls = quant_linear_class()
    if "lm_head" not in quant.keep_16bit:
        quantize_head(model, quant)
    for layer in layers:
        for _, path in SITES:
            parent = parent_of(layer, path)
            found = getattr(parent, path[-1], None)
            if isinstance(found, torch.nn.Linear):
                setattr(parent, path[-1], cls(found, quant))
