"""LoRA in the recording: the adapters verify puts on a transformers model, on fake tensors.

verify trains LoRA with its own adapter module (``verify/models/compress.py``, ``LoRALinear``
and ``apply``; no peft): every parameter frozen, then each chosen decoder linear wrapped so
that ``result = base(x)``, ``x`` cast to the adapters' dtype (not under autocast; peft's
``_cast_input_dtype``), ``result = result + B(A(dropout(x))) * scaling`` and ``result.to(its dtype)``
(peft ``tuners/lora/layer.py``, ``Linear.forward``; Hu et al. 2021, arXiv 2106.09685). ``A``
is ``[r, in]``, ``B`` ``[out, r]``, in the weights' dtype or ``LoRA.adapter_dtype``.

`apply` does the same to the model the recorder built. The chosen linears are found by name
in each decoder layer (`calc.derive.linears.SITES`): the llama-family projections
``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``; Phi-3's fused ones (one adapter
on ``qkv_proj`` when ``q``, ``k`` and ``v`` are all chosen, on ``gate_up_proj`` when ``gate``
and ``up`` are: peft adapts a linear whole; the target modules people give Phi-3 are
``qkv_proj, o_proj, gate_up_proj, down_proj``); latent attention's (``q`` on ``q_proj`` or
``q_a_proj`` and ``q_b_proj``, ``k`` and ``v`` together on ``kv_a_proj_with_mqa`` and
``kv_b_proj``, the linears a peft target list naming them adapts) and shared experts' MLP.
A chosen projection no layer has (GPT-2's ``Conv1D``) is refused by name, except a mixture of
experts' ``gate``, ``up`` and ``down``: as with peft's ``target_modules``, its routed experts
(3-D parameters) get no adapter, the shared experts and dense layers do.

torch is imported only inside these functions: ``calc`` imports without it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from calc.config.compression import LORA_MODULES, LoRA
from calc.derive.book import DeriveError
from calc.derive.linears import MLP_NAMES, SITES, has_experts, parent_of
from calc.derive.quantized import quant_linear_class

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _linear(layer: Any, path: tuple[str, ...]) -> tuple[Any, str] | None:
    """(parent, attribute) of the linear (dense, or quantized by `calc.derive.quantized.apply`)
    at ``path`` in ``layer``, or ``None``."""
    import torch

    parent = parent_of(layer, path)
    found = getattr(parent, path[-1], None)
    if isinstance(found, torch.nn.Linear | quant_linear_class()):
        return parent, path[-1]
    return None


def targets(layer: Any, lora: LoRA, model_type: str) -> list[tuple[Any, str]]:
    """(parent module, attribute) of the linears of one decoder ``layer`` that get an adapter
    (`calc.derive.linears.SITES`): each one all of whose LoRA names are chosen; a fused or
    latent linear only some of whose names are chosen is refused."""
    chosen: set[str] = set(lora.modules)
    out: list[tuple[Any, str]] = []
    for parts, path in SITES:
        place = _linear(layer, path)
        present = chosen & set(parts)
        if place is None or not present:
            continue
        if present != set(parts):
            raise DeriveError(
                f"LoRA modules {sorted(present)} on model_type={model_type!r}: "
                f"{'.'.join(path)} computes {', '.join(parts)} in one linear; an adapter takes "
                "all of them or none"
            )
        out.append(place)
    return out


def _names_in(layer: Any) -> list[str]:
    """The LoRA names the linears of ``layer`` compute, in `LORA_MODULES` order."""
    has = {n for parts, path in SITES if _linear(layer, path) is not None for n in parts}
    return [n for n in LORA_MODULES if n in has]


def check_found(layers: Any, lora: LoRA, model_type: str) -> None:
    """Refuse the LoRA names no layer of ``layers`` has a linear for, by name, offering the
    ones it has. A mixture of experts may leave ``gate``, ``up`` and ``down`` unmatched: its
    routed experts are 3-D parameters peft's ``target_modules`` do not reach, and the
    adapters go where those names exist (shared experts, dense layers) or nowhere."""
    has: list[str] = []
    for layer in layers:
        has += [n for n in _names_in(layer) if n not in has]
    moe = any(has_experts(layer) for layer in layers)
    missing = [n for n in lora.modules if n not in has]
    if moe:
        missing = [n for n in missing if n not in MLP_NAMES]
    if not missing and (set(lora.modules) & set(has)):
        return
    missing = missing or list(lora.modules)
    offer: tuple[str, ...] = tuple(n for n in lora.modules if n in has) or tuple(has)
    hint = (
        f"its layers have {tuple(has)}: try LoRA(modules={offer})"
        if has
        else "its layers have none of the projections it adapts"
        + (" (GPT-2's are transformers' Conv1D)" if model_type == "gpt2" else "")
    )
    raise DeriveError(
        f"LoRA modules {sorted(missing)} on model_type={model_type!r}: its decoder layers "
        "have no such nn.Linear (the derived replay adapts llama-family projections, Phi-3's "
        "fused qkv_proj / gate_up_proj, latent attention's and shared experts' linears; "
        "routed experts are not nn.Linear); " + hint
    )


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
    check_found(layers, lora, model_type)
    for layer in layers:
        for parent, attr in targets(layer, lora, model_type):
            setattr(parent, attr, cls(getattr(parent, attr), lora, dtype))
