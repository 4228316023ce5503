"""Weight-only quantized linears and LoRA adapters in plain PyTorch (no bitsandbytes, no peft).

What ``calc.compress.quant`` and ``calc.compress.lora`` replay, line by line:

* `QuantLinear` (`calc.derive.quantized`, shared with the derived recording as transformers'
  code is) holds a decoder linear's weight as integer (or fp8) tensors with their scales, as
  buffers, and dequantizes it to the compute dtype in forward and again in backward (the dense
  weight is a transient of one matmul, as bitsandbytes' ``MatMul4Bit`` does).
* `LoRALinear` wraps a frozen linear: ``base(x) + B(A(x)) * (alpha / r)`` with ``A`` ``[r, in]``
  and ``B`` ``[out, r]`` trainable (Hu et al. 2021), written like peft's ``lora.Linear.forward``
  (result first; ``x`` cast to the adapters' dtype; ``result = result + lora_B(lora_A(x)) *
  scaling``; the sum cast back to the result's dtype: casts that are no-ops for one dtype).

torchtune's model (`verify.models.torchtune_llama`) is quantized as its QLoRA recipes do, on
torchao's ``NF4Tensor`` (`verify.models.torchao_nf4`).

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

from calc.derive.linears import MLP_NAMES, SITES, Site, has_experts, parent_of
from calc.derive.quantized import quant_linear_class, quantize_head
from verify.models import torchao_nf4, torchtune_llama

if TYPE_CHECKING:
    from calc.config.compression import LoRA, Quant

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QuantLinear = quant_linear_class()
"""`calc.derive.quantized`'s weight-only quantized linear (the recording builds the same)."""
TORCHTUNE_LINEARS: tuple[Site, ...] = (
    (("q",), ("attn", "q_proj")), (("k",), ("attn", "k_proj")), (("v",), ("attn", "v_proj")),
    (("o",), ("attn", "output_proj")), (("gate",), ("mlp", "w1")), (("down",), ("mlp", "w2")),
    (("up",), ("mlp", "w3")),
)  # fmt: skip
"""(LoRA module name, attribute path) in torchtune's layer, in its registration order
(`verify.models.torchtune_llama`). torchtune's own ``LoRALinear`` (modules/peft/lora.py,
``forward``) runs the ops `LoRALinear` runs here: the frozen base's ``F.linear``,
``lora_b(lora_a(x))`` times ``alpha / rank``, the sum."""


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
    in the reference model or a Hugging Face model (`calc.derive.linears.SITES`: llama-family
    names, Phi-3's fused linears, latent attention's, shared experts'), or torchtune's."""
    if isinstance(model, torchtune_llama.TransformerDecoder):
        blocks, sites = model.layers, TORCHTUNE_LINEARS
    else:
        spec = getattr(model, "spec", None)
        model_type = spec.model_type if spec is not None else model.config.model_type
        if model_type == "gpt2":
            raise NotImplementedError("LoRA/quantization of GPT-2's Conv1D-style layers")
        blocks = model.blocks if spec is not None else model.model.layers
        sites = SITES
    out = []
    for block in blocks:
        for parts, path in sites:
            parent = parent_of(block, path)
            if isinstance(getattr(parent, path[-1], None), nn.Linear):
                out.append((parent, path[-1], parts))
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

    ``keep_16bit`` without ``lm_head`` quantizes a Hugging Face model's output linear too
    (Lightning's bitsandbytes plugin replaces every ``nn.Linear``); without ``embed`` it is not
    run (bitsandbytes quantizes no ``nn.Embedding``)."""
    if quant is not None and "embed" not in quant.keep_16bit:
        raise NotImplementedError("quantized embeddings are not run by verify")
    if quant is not None and "lm_head" not in quant.keep_16bit:
        quantize_head(model, quant)  # the derived recording's own (calc.derive.quantized)
    if lora is not None:
        for p in model.parameters():
            p.requires_grad_(False)
    targets = _targets(model)
    model_type = getattr(getattr(model, "config", None), "model_type", "the reference model")
    found = {part for *_, parts in targets for part in parts}
    if lora is not None:  # peft: routed experts (3-D parameters) are no target module
        layers = getattr(getattr(model, "model", None), "layers", ())
        routed = set(MLP_NAMES) if any(has_experts(b) for b in layers) else set()
        missing = set(lora.modules) - found - routed
        if missing or not set(lora.modules) & found:
            raise NotImplementedError(f"LoRA modules {lora.modules}: {model_type} has {found}")
    torchtune = isinstance(model, torchtune_llama.TransformerDecoder)
    for parent, attr, parts in targets:
        layer = getattr(parent, attr)
        if quant is not None:  # torchtune's QLoRA: torchao's NF4Tensor (its FrozenNF4Linear)
            layer = torchao_nf4.NF4Base(layer) if torchtune else QuantLinear(layer, quant)
        if lora is not None and _adapted(parts, lora, model_type):
            layer = LoRALinear(layer, lora, dtype)
        setattr(parent, attr, layer)
