"""Weight-only quantized linears and LoRA adapters in plain PyTorch (no bitsandbytes, no peft).

What ``calc.compress.quant`` and ``calc.compress.lora`` replay, line by line:

* `QuantLinear` holds a decoder linear's weight as integer (or fp8) tensors with their scales,
  as buffers: ``int8`` (int8, or uint8 with a zero point) ``[out, in]``; ``int4`` two values a
  byte, uint8 ``[out, in/2]``; ``nf4`` as bitsandbytes stores ``Params4bit``: the flattened
  weight packed two a byte ``[out*in/2]``, one absmax per block (fp32, or with double
  quantization a uint8 code per block, an fp32 absmax per 256 blocks and an fp32 offset) and
  the 16-entry NF4 table; ``fp8`` e4m3 ``[out, in]`` with an fp32 scale per tensor or per row.
  The forward and backward go through `QuantMatmul`, a custom autograd Function that keeps only
  a reference to the module (no saved activations: the packed weight is all it needs) and
  dequantizes the weight to the compute dtype in forward and again in backward (the dense
  weight is a transient of one matmul, as bitsandbytes' ``MatMul4Bit`` does).
* `LoRALinear` wraps a frozen linear: ``base(x) + B(A(x)) * (alpha / r)`` with ``A`` ``[r, in]``
  and ``B`` ``[out, r]`` trainable (Hu et al. 2021), written like peft's ``lora.Linear.forward``
  (result first; ``x`` cast to the adapters' dtype; ``result = result + lora_B(lora_A(x)) *
  scaling``; the sum cast back to the result's dtype: casts that are no-ops for one dtype).

`apply(model, job)` swaps the chosen linears of every decoder layer in place and freezes the
rest. The NF4 table (QLoRA, Dettmers et al. 2023, Appendix E) and a 256-entry signed map for
the double-quantized absmax: the 16-entry table is a buffer of every nf4 linear (bitsandbytes
keeps a ``code`` tensor in each ``QuantState``); the absmax map is arithmetic (``q/127.5 - 1``),
so no table.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from calc.config.compression import LoRA, Quant

NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
"""The 16 NormalFloat-4 levels (QLoRA paper, Appendix E; bitsandbytes ``get_4bit_type``)."""
NESTED_BLOCK = 256
"""Blocks of absmax values sharing one fp32 second-level absmax (double quantization)."""
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LLAMA_LINEARS = {
    "q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"), "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}  # fmt: skip
"""LoRA/Quant module name -> (submodule, attribute) in a llama-family decoder layer."""
FUSED_LINEARS = {
    ("q", "k", "v"): ("self_attn", "qkv_proj"),
    ("gate", "up"): ("mlp", "gate_up_proj"),
}
"""LoRA/Quant module names -> the one linear computing them all (Phi-3's fused projections):
an adapter on it when all its names are chosen (peft adapts a linear whole)."""


class QuantMatmul(torch.autograd.Function):
    """``x @ dequant(W).T + b`` with only the packed weight kept for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: QuantLinear) -> torch.Tensor:  # type: ignore[override]
        ctx.module = module  # a reference, not a saved tensor: nothing new is kept
        w = module.dequantize(x.dtype)
        out = F.linear(x, w, module.bias)
        del w
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None
        w = ctx.module.dequantize(grad.dtype)
        gx = grad.matmul(w)
        del w
        return gx, None


class QuantLinear(nn.Module):
    """A frozen linear whose weight is stored quantized (see the module docstring)."""

    def __init__(self, linear: nn.Linear, quant: Quant) -> None:
        super().__init__()
        out_f, in_f = linear.weight.shape
        self.out_features, self.in_features = out_f, in_f
        self.method = quant.method
        w = linear.weight.detach().float()
        if quant.method in ("int8", "int4"):
            self._quantize_int(w, quant)
        elif quant.method == "nf4":
            self._quantize_nf4(w, quant)
        else:
            self._quantize_fp8(w, quant)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def _quantize_int(self, w: torch.Tensor, quant: Quant) -> None:
        out_f, in_f = w.shape
        g = quant.group or in_f
        if in_f % g:
            raise ValueError(f"group_size={g} does not divide in_features={in_f}")
        bits = 8 if quant.method == "int8" else 4
        sdt = DTYPES[quant.scale_dtype or ("fp32" if bits == 8 else "fp16")]
        wg = w.view(out_f, in_f // g, g)
        if quant.has_zero_point:
            lo, hi = wg.amin(-1), wg.amax(-1)
            scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
            zero = torch.round(-lo / scale)
            q = torch.clamp(torch.round(wg / scale[..., None]) + zero[..., None], 0, 2**bits - 1)
            self.register_buffer("zero", zero.to(sdt))
        else:
            scale = (wg.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp_min(1e-8)
            q = torch.round(wg / scale[..., None]).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
            self.zero = None
        self.register_buffer("scale", scale.to(sdt))
        q = q.view(out_f, in_f)
        if bits == 8:
            packed = q.to(torch.uint8 if quant.has_zero_point else torch.int8)
        else:
            u = (q if quant.has_zero_point else q + 8).to(torch.uint8).view(out_f, in_f // 2, 2)
            packed = u[..., 0] | (u[..., 1] << 4)
        self.register_buffer("packed", packed.contiguous())
        self.group = g
        self.symmetric4 = bits == 4 and not quant.has_zero_point

    def _quantize_nf4(self, w: torch.Tensor, quant: Quant) -> None:
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
        self.register_buffer("packed", (idx[:, 0] << 4) | idx[:, 1])  # bnb: first in high nibble
        self.register_buffer("code", code)
        self.block = block
        self.double_quant = quant.double_quant
        if quant.double_quant:
            offset = absmax.mean()
            centred = absmax - offset
            n_nested = math.ceil(centred.numel() / NESTED_BLOCK)
            padded = F.pad(centred, (0, n_nested * NESTED_BLOCK - centred.numel()))
            absmax2 = padded.view(n_nested, NESTED_BLOCK).abs().amax(-1).clamp_min(1e-12)
            scaled = (padded.view(n_nested, NESTED_BLOCK) / absmax2[:, None]).reshape(-1)
            qa = torch.round((scaled[: centred.numel()] + 1) * 127.5).clamp(0, 255)
            self.register_buffer("qabsmax", qa.to(torch.uint8))
            self.register_buffer("absmax2", absmax2)
            self.register_buffer("offset", offset.reshape(()))
        else:
            self.register_buffer("absmax", absmax)

    def _quantize_fp8(self, w: torch.Tensor, quant: Quant) -> None:
        fmax = torch.finfo(torch.float8_e4m3fn).max
        if quant.fp8_scaling == "row":
            scale = (w.abs().amax(-1) / fmax).clamp_min(1e-12)
            q = (w / scale[:, None]).to(torch.float8_e4m3fn)
        else:
            scale = (w.abs().amax() / fmax).clamp_min(1e-12).reshape(1)
            q = (w / scale).to(torch.float8_e4m3fn)
        self.register_buffer("packed", q)
        self.register_buffer("scale", scale.float())
        self.row = quant.fp8_scaling == "row"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense ``[out, in]`` weight in ``dtype`` (allocations as ``calc.compress.quant`` lists)."""
        out_f, in_f = self.out_features, self.in_features
        if self.method == "nf4":
            return self._dequantize_nf4(dtype)
        if self.method == "fp8":
            w = self.packed.to(dtype)
            s = self.scale.to(dtype)
            w.mul_(s[:, None] if self.row else s)
            del s
            return w
        if self.method == "int8":
            w = self.packed.to(dtype)
        else:
            lo = self.packed & 15
            hi = self.packed >> 4
            q = torch.stack((lo, hi), dim=-1)
            del lo, hi
            w = q.view(out_f, in_f).to(dtype)
            del q
            if self.symmetric4:
                w.sub_(8)
        wg = w.view(out_f, in_f // self.group, self.group)
        if self.zero is not None:
            z = self.zero.to(dtype)
            wg.sub_(z[..., None])
            del z
        s = self.scale.to(dtype)
        wg.mul_(s[..., None])
        del s, wg
        return w

    def _dequantize_nf4(self, dtype: torch.dtype) -> torch.Tensor:
        if self.double_quant:
            qa = self.qabsmax.to(torch.float32)
            qa.div_(127.5).sub_(1)
            s2 = self.absmax2.repeat_interleave(NESTED_BLOCK)
            qa.mul_(s2[: qa.numel()])
            del s2
            qa.add_(self.offset)
            absmax = qa.to(dtype)
            del qa
        else:
            absmax = self.absmax.to(dtype)
        hi = self.packed >> 4
        lo = self.packed & 15
        idx = torch.stack((hi, lo), dim=-1)
        del hi, lo
        idx32 = idx.view(-1).to(torch.int32)
        del idx
        code = self.code.to(dtype)
        w = code[idx32]
        del idx32, code
        w.view(-1, self.block).mul_(absmax[:, None])
        del absmax
        return w.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return QuantMatmul.apply(x, self)


class LoRALinear(nn.Module):
    """``base(x) + B(A(x)) * scaling`` over a frozen ``base`` (an ``nn.Linear`` or a
    `QuantLinear`); ``A`` and ``B`` are the only trainable tensors."""

    def __init__(self, base: nn.Module, lora: LoRA, dtype: torch.dtype) -> None:
        super().__init__()
        if lora.adapter_dtype is not None:  # peft's autocast_adapter_dtype keeps fp32 adapters
            dtype = DTYPES[lora.adapter_dtype]
        self.base = base
        out_f = base.out_features
        in_f = base.in_features
        device = base.packed.device if isinstance(base, QuantLinear) else base.weight.device
        self.lora_A = nn.Parameter(torch.empty(lora.rank, in_f, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_f, lora.rank, dtype=dtype, device=device))
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = lora.scale
        self.dropout = lora.dropout
        """peft's ``lora_dropout`` (``nn.Dropout``; ``nn.Identity`` at 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        result_dtype = result.dtype
        if not torch.is_autocast_enabled(x.device.type):  # peft's _cast_input_dtype
            x = x.to(self.lora_A.dtype)
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, self.training)
        result = result + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling
        return result.to(result_dtype)


def _targets(model: nn.Module) -> list[tuple[nn.Module, str, tuple[str, ...]]]:
    """(parent module, attribute, LoRA/Quant names it computes) of every decoder-layer linear,
    in the reference model or a Hugging Face llama-family model (same attribute names), or
    Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` (`FUSED_LINEARS`)."""
    spec = getattr(model, "spec", None)
    model_type = spec.model_type if spec is not None else model.config.model_type
    if model_type == "gpt2":
        raise NotImplementedError("LoRA/quantization of GPT-2's Conv1D-style layers")
    blocks = model.blocks if spec is not None else model.model.layers
    out = []
    for block in blocks:
        for name, (sub, attr) in LLAMA_LINEARS.items():
            if isinstance(getattr(getattr(block, sub, None), attr, None), nn.Linear):
                out.append((getattr(block, sub), attr, (name,)))
        for parts, (sub, attr) in FUSED_LINEARS.items():
            if isinstance(getattr(getattr(block, sub, None), attr, None), nn.Linear):
                out.append((getattr(block, sub), attr, parts))
    return out


def _adapted(parts: tuple[str, ...], lora: LoRA, model_type: str) -> bool:
    """Whether the linear computing ``parts`` gets an adapter: all of them chosen (none: no;
    some of a fused linear: refused)."""
    chosen = [p for p in parts if p in lora.modules]
    if chosen and len(chosen) < len(parts):
        raise NotImplementedError(
            f"LoRA modules {chosen} on {model_type}: one fused linear computes {parts}"
        )
    return bool(chosen)


def apply(model: nn.Module, quant: Quant | None, lora: LoRA | None, dtype: torch.dtype) -> None:
    """Quantize the decoder linears (``quant``), add adapters (``lora``), freeze the base.

    ``keep_16bit`` without ``embed``/``lm_head`` (quantized embeddings or head) is not run."""
    if quant is not None and set(quant.keep_16bit) != {"embed", "norm", "lm_head"}:
        raise NotImplementedError("quantized embeddings or LM head are not run by verify")
    if lora is not None:
        for p in model.parameters():
            p.requires_grad_(False)
    targets = _targets(model)
    model_type = getattr(getattr(model, "config", None), "model_type", "the reference model")
    found = {part for *_, parts in targets for part in parts}
    if lora is not None and not set(lora.modules) <= found:
        raise NotImplementedError(f"LoRA modules {lora.modules}: {model_type} has {found}")
    for parent, attr, parts in targets:
        layer = getattr(parent, attr)
        if quant is not None:
            layer = QuantLinear(layer, quant)
        if lora is not None and _adapted(parts, lora, model_type):
            layer = LoRALinear(layer, lora, dtype)
        setattr(parent, attr, layer)
