"""Pruning: the `Pruning` config of ``torch.nn.utils.prune`` in the step, and which weights it prunes.

Three kinds users meet (memory-facts.md §2.10, checked against torch 2.13's source):

* **unstructured**, with ``torch.nn.utils.prune`` while training: each pruned module keeps the
  parameter ``weight_orig``, a buffer ``weight_mask`` (``ones_like(orig)`` with zeros: the
  weight's dtype) and the attribute ``weight = mask.to(orig.dtype) * orig``, recomputed by a
  forward pre-hook at every call (``torch/nn/utils/prune.py``, ``BasePruningMethod.apply``,
  ``apply_mask``, ``__call__``). Memory goes *up* (two more weight-sized tensors per pruned
  weight) until ``prune.remove``, after which the weight is dense again, zeros included: no
  saving. The replay of the reparameterised step is `calc.compress.prune_replay`; the storage a pruned
  weight could take in a sparse format (CSR or COO), and the density below which that saves
  anything, are in `calc.compress.sparse`.
* **2:4 semi-structured**: two values of every four kept, packed, plus metadata
  (`calc.compress.sparse.semi_structured_bytes`).
* **structured** (heads, FFN channels, whole layers): a smaller dense model,
  `calc.compress.structured.pruned_spec` (every other term of the cost model then shrinks with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from calc.config.model_spec import ModelSpec

PruningKind = Literal["unstructured", "2:4"]

PRUNING_KINDS: tuple[str, ...] = get_args(PruningKind)
LLAMA_MODULES: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
"""Prunable linears of a llama-family layer (the replay's names for q_proj ... down_proj)."""
GPT2_MODULES: tuple[str, ...] = ("qkv", "o", "fc", "proj")
"""Prunable linears of a GPT-2 layer (c_attn, attn.c_proj, c_fc, mlp.c_proj)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pruning:
    """Unstructured or 2:4 pruning of the decoder layers' linear weights with
    ``torch.nn.utils.prune`` (for structured pruning, see `calc.compress.structured.pruned_spec`)."""

    kind: PruningKind = "unstructured"
    """``unstructured`` (``prune.l1_unstructured`` at ``amount``) or ``2:4`` (a mask keeping
    two of every four consecutive weights of a row, applied with ``prune.custom_from_mask``
    and a mask in the weight's dtype, which the pruning method keeps: one more weight-sized
    tensor per pruned weight)."""
    amount: float = 0.5
    """Fraction of each pruned weight set to zero, in [0, 1]; ``torch.nn.utils.prune`` zeroes
    ``round(amount * numel)`` entries. 2:4 is always 0.5."""
    modules: tuple[str, ...] | None = None
    """Which linears of every layer are pruned: llama family ``q k v o gate up down``, GPT-2
    ``qkv o fc proj``. ``None``: all of them."""
    removed: bool = False
    """Whether ``prune.remove`` ran before the step: the weights are then plain dense tensors
    (with zeros) and the step costs what an unpruned one does."""

    def __post_init__(self) -> None:
        if self.kind not in PRUNING_KINDS:
            raise ValueError(f"kind={self.kind!r} is not one of {PRUNING_KINDS}")
        ok = isinstance(self.amount, int | float) and not isinstance(self.amount, bool)
        if not ok or not 0 <= self.amount <= 1:
            raise ValueError(f"amount={self.amount!r} must be a number in [0, 1]")
        if self.kind == "2:4" and self.amount != 0.5:
            raise ValueError(f"amount={self.amount} must be 0.5 for kind='2:4'")
        if self.modules is not None:
            allowed = LLAMA_MODULES + GPT2_MODULES
            if not isinstance(self.modules, tuple) or not self.modules:
                raise ValueError(f"modules={self.modules!r} must be a non-empty tuple or None")
            for m in self.modules:
                if m not in allowed:
                    raise ValueError(f"modules entry {m!r} is not one of {allowed}")
            if len(set(self.modules)) != len(self.modules):
                raise ValueError(f"modules={self.modules!r} lists a module twice")
        if not isinstance(self.removed, bool):
            raise ValueError(f"removed={self.removed!r} must be a bool")

    def modules_for(self, model: ModelSpec) -> tuple[str, ...]:
        """The pruned linears of ``model``'s layers; ``ValueError`` for a name it lacks, or
        (2:4) for a weight whose input width is not a multiple of 4."""
        own = GPT2_MODULES if model.model_type == "gpt2" else LLAMA_MODULES
        if self.modules is not None:
            for m in self.modules:
                if m not in own:
                    raise ValueError(
                        f"modules entry {m!r} does not exist in a {model.model_type} layer: "
                        f"allowed {own}"
                    )
        keys = own if self.modules is None else tuple(m for m in own if m in self.modules)
        if self.kind == "2:4":
            for key, (_, cols) in zip(keys, _shapes(model, keys), strict=True):
                if cols % 4:
                    raise ValueError(
                        f"kind='2:4' needs the input width of {key!r} ({cols}) to be a "
                        "multiple of 4 (two of every four weights of a row are kept)"
                    )
        return keys


def pruned_shapes(model: ModelSpec, pruning: Pruning) -> list[tuple[int, int]]:
    """``(out, in)`` of each pruned weight of one layer, in the layer's order."""
    return _shapes(model, pruning.modules_for(model))


def _shapes(model: ModelSpec, keys: tuple[str, ...]) -> list[tuple[int, int]]:
    h, a, k, d, f = model.hidden, model.n_heads, model.n_kv_heads, model.head_dim, model.ffn
    shape = {
        "q": (a * d, h), "k": (k * d, h), "v": (k * d, h), "o": (h, a * d),
        "gate": (f, h), "up": (f, h), "down": (h, f),
        "qkv": (3 * h, h), "fc": (f, h), "proj": (h, f),
    }  # fmt: skip
    return [shape[m] for m in keys]
