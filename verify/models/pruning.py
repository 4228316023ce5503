"""Pruning a built model for real, as a user does it: ``torch.nn.utils.prune`` on the layers'
linears (unstructured L1, or a 2:4 mask through ``prune.custom_from_mask``), optionally
followed by ``prune.remove``; and structured pruning by slicing heads and FFN channels out of
the linears (checked against ``calc.pruned_spec``'s parameter count).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.utils import prune

if TYPE_CHECKING:
    from calc.config.model_spec import ModelSpec
    from calc.config.pruning import Pruning

_LLAMA_PATHS = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
    "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}  # fmt: skip
_GPT2_PATHS = {"qkv": "attn.c_attn", "o": "attn.c_proj", "fc": "mlp.c_fc", "proj": "mlp.c_proj"}


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a reference or Hugging Face model."""
    for path in ("layers", "h", "model.layers", "transformer.h"):
        mod = model
        try:
            for part in path.split("."):
                mod = getattr(mod, part)
        except AttributeError:
            continue
        if isinstance(mod, nn.ModuleList):
            return mod
    raise ValueError(f"no decoder layers found in {type(model).__name__}")


def two_four_mask(weight: torch.Tensor) -> torch.Tensor:
    """Keep the two largest-magnitude weights of every four consecutive ones in a row."""
    rows, cols = weight.shape
    groups = weight.detach().abs().reshape(rows, cols // 4, 4)
    keep = groups.topk(2, dim=-1).indices
    mask = torch.zeros_like(groups).scatter_(-1, keep, 1.0)
    return mask.reshape(rows, cols)


def apply(model: nn.Module, pruning: Pruning, spec: ModelSpec) -> None:
    """Prune ``model`` in place as ``pruning`` says (after ``model.to(dtype)``)."""
    paths = _GPT2_PATHS if spec.model_type == "gpt2" else _LLAMA_PATHS
    keys = pruning.modules_for(spec)
    for block in _blocks(model):
        for key in keys:
            mod = block.get_submodule(paths[key])
            if pruning.kind == "2:4":
                prune.custom_from_mask(mod, "weight", mask=two_four_mask(mod.weight))
            else:
                prune.l1_unstructured(mod, "weight", amount=pruning.amount)
            if pruning.removed:
                prune.remove(mod, "weight")


def _slice_linear(
    lin: nn.Linear, rows: torch.Tensor | None, cols: torch.Tensor | None
) -> nn.Linear:
    """A new ``nn.Linear`` holding the kept output rows / input columns of ``lin``."""
    w = lin.weight.detach()
    if rows is not None:
        w = w.index_select(0, rows)
    if cols is not None:
        w = w.index_select(1, cols)
    bias = lin.bias
    out = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if bias is not None:
            out.bias.copy_(bias.detach() if rows is None else bias.detach().index_select(0, rows))
    return out


def prune_structured(model: nn.Module, full: ModelSpec, pruned: ModelSpec) -> None:
    """Slice a llama-family reference model built from ``full`` down to ``pruned``'s heads,
    KV heads, FFN channels and layers (the first ones kept), in place; its ``spec`` becomes
    ``pruned``. Replaces each linear by a smaller one (the old weights are freed)."""
    hd = full.head_dim
    group_full = full.n_heads // full.n_kv_heads
    group = pruned.n_heads // pruned.n_kv_heads
    # Keep the first n_kv KV heads and, of each, the first `group` of its query heads.
    q_heads = [kv * group_full + i for kv in range(pruned.n_kv_heads) for i in range(group)]
    q_rows = torch.tensor([h * hd + e for h in q_heads for e in range(hd)])
    kv_rows = torch.arange(pruned.n_kv_heads * hd)
    ffn_rows = torch.arange(pruned.ffn)
    model.layers = nn.ModuleList(list(model.layers)[: pruned.n_layers])
    for block in model.layers:
        att, mlp = block.self_attn, block.mlp
        att.q_proj = _slice_linear(att.q_proj, q_rows, None)
        att.k_proj = _slice_linear(att.k_proj, kv_rows, None)
        att.v_proj = _slice_linear(att.v_proj, kv_rows, None)
        att.o_proj = _slice_linear(att.o_proj, None, q_rows)
        mlp.gate_proj = _slice_linear(mlp.gate_proj, ffn_rows, None)
        mlp.up_proj = _slice_linear(mlp.up_proj, ffn_rows, None)
        mlp.down_proj = _slice_linear(mlp.down_proj, None, ffn_rows)
        att.spec = mlp.spec = block.spec = pruned
    model.spec = pruned
