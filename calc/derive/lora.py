"""LoRA in the recording: the adapters verify puts on a transformers model, on fake tensors.

verify trains LoRA with its own adapter module (``verify/models/compress.py``, ``LoRALinear``
and ``apply``; no peft): every parameter frozen, then each chosen decoder linear wrapped so
that ``result = base(x)``, ``x`` cast to the adapters' dtype (not under autocast; peft's
``_cast_input_dtype``), ``result = result + B(A(dropout(x))) * scaling`` and ``result.to(its dtype)``
(peft ``tuners/lora/layer.py``, ``Linear.forward``; Hu et al. 2021, arXiv 2106.09685). ``A``
is ``[r, in]``, ``B`` ``[out, r]``, in the weights' dtype or ``LoRA.adapter_dtype``.

`apply` does the same to the model the recorder built. The chosen linears are found by name
in each decoder layer: the llama-family projections ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj`` (`LINEARS`), and the fused ones of Phi-3 (`FUSED`): one adapter
on ``qkv_proj`` when ``q``, ``k`` and ``v`` are all chosen, on ``gate_up_proj`` when ``gate``
and ``up`` are (peft adapts a linear whole; the target modules people give Phi-3 are
``qkv_proj, o_proj, gate_up_proj, down_proj``). A chosen projection found in neither form
(MoE experts, GPT-2's ``Conv1D``) is refused by name.

torch is imported only inside these functions: ``calc`` imports without it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from calc.config.compression import LoRA
from calc.derive.book import DeriveError
from calc.derive.linears import FUSED, LINEARS
from calc.derive.quantized import quant_linear_class

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _linear(layer: Any, sub: str, attr: str) -> Any | None:
    """The linear (dense, or quantized by `calc.derive.quantized.apply`) at ``sub.attr``."""
    import torch

    found = getattr(getattr(layer, sub, None), attr, None)
    return found if isinstance(found, torch.nn.Linear | quant_linear_class()) else None


def targets(layer: Any, lora: LoRA, model_type: str) -> list[tuple[Any, str]]:
    """(parent module, attribute) of the linears of one decoder ``layer`` that get an adapter:
    each chosen llama-family projection, or the fused linear all of whose parts are chosen."""
    chosen: set[str] = set(lora.modules)
    out: list[tuple[Any, str]] = []
    for name, (sub, attr) in LINEARS.items():
        if name in chosen and _linear(layer, sub, attr) is not None:
            out.append((getattr(layer, sub), attr))
            chosen.discard(name)
    for parts, (sub, attr) in FUSED.items():
        present = chosen & set(parts)
        if not present or _linear(layer, sub, attr) is None:
            continue
        if present != set(parts):
            raise DeriveError(
                f"LoRA modules {sorted(present)} on model_type={model_type!r}: {sub}.{attr} "
                f"computes {', '.join(parts)} in one linear; an adapter takes all of them or none"
            )
        out.append((getattr(layer, sub), attr))
        chosen -= present
    if chosen:
        has: list[str] = [
            n for n, (sub, attr) in LINEARS.items() if _linear(layer, sub, attr) is not None
        ]
        has += [n for parts, (sub, attr) in FUSED.items() if _linear(layer, sub, attr) is not None
                for n in parts]  # fmt: skip
        offer: tuple[str, ...] = tuple(n for n in lora.modules if n in has) or tuple(has)
        hint = (
            f"the layer refused has {tuple(has)}: try LoRA(modules={offer})"
            if has
            else "the layer refused has none of the projections it adapts"
            + (" (GPT-2's are transformers' Conv1D)" if model_type == "gpt2" else "")
        )
        raise DeriveError(
            f"LoRA modules {sorted(chosen)} on model_type={model_type!r}: its decoder layers "
            "have no such nn.Linear (the derived replay adapts llama-family projections and "
            "Phi-3's fused qkv_proj / gate_up_proj; MoE experts are not nn.Linear); " + hint
        )
    return out


@lru_cache(maxsize=1)
def adapted_linear() -> type:
    """The adapter module class (made on first use: it subclasses ``torch.nn.Module``)."""
    import torch
    import torch.nn.functional as F

    class Adapted(torch.nn.Module):
        """``base(x) + B(A(x)) * scaling`` over the frozen linear ``base``."""

        def __init__(self, base: Any, lora: LoRA, dtype: Any) -> None:
            super().__init__()
            self.base = base
            device = base.packed.device if hasattr(base, "packed") else base.weight.device
            kw = {"dtype": dtype, "device": device}
            self.lora_A = torch.nn.Parameter(torch.empty(lora.rank, base.in_features, **kw))
            self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, lora.rank, **kw))
            self.scaling = lora.scale
            self.dropout = lora.dropout

        def forward(self, x: Any) -> Any:
            result = self.base(x)
            dtype = result.dtype
            if not torch.is_autocast_enabled(x.device.type):
                x = x.to(self.lora_A.dtype)
            if self.dropout > 0:  # peft's lora_dropout (nn.Identity at 0)
                x = F.dropout(x, self.dropout, self.training)
            result = result + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling
            return result.to(dtype)

    return Adapted


def apply(model: Any, layers: Any, lora: LoRA, weight_dtype: Any) -> None:
    """Freeze ``model`` and wrap the chosen linears of each decoder layer in ``layers`` with
    adapters in ``weight_dtype`` (or ``lora.adapter_dtype``), in place."""
    import torch

    for p in model.parameters():
        p.requires_grad_(False)
    dtype = weight_dtype
    if lora.adapter_dtype is not None:
        dtype = getattr(torch, DTYPES[lora.adapter_dtype])
    cls = adapted_linear()
    model_type = str(getattr(model.config, "model_type", "?"))
    for layer in layers:
        for parent, attr in targets(layer, lora, model_type):
            setattr(parent, attr, cls(getattr(parent, attr), lora, dtype))
