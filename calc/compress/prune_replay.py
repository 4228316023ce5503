"""``torch.nn.utils.prune`` in the training replay: ``weight_orig``, ``weight_mask`` and the
weight a forward pre-hook recomputes at every module call.

What ``prune.l1_unstructured(module, "weight", amount)`` leaves on a module
(``torch/nn/utils/prune.py``, torch 2.13, ``BasePruningMethod.apply``):

* the parameter is re-registered as ``weight_orig`` (same storage; ``register_parameter``
  appends it, so in ``parameters()`` it now follows the module's bias);
* a buffer ``weight_mask`` = ``ones_like(orig)`` with zeros: one more weight-sized tensor in the
  weight's dtype;
* the attribute ``weight = mask.to(dtype=orig.dtype) * orig`` (``apply_mask``): a third
  weight-sized tensor, kept by the module between calls, recomputed by the forward pre-hook
  (``__call__``: ``setattr(module, name, apply_mask(module))``), so during the pre-hook the new
  product exists before the old one is released.

Autograd: ``MulBackward0`` saves the mask (for ``orig``'s gradient); the linear's weight
gradient goes to the product, then ``grad * mask`` becomes ``weight_orig.grad``.
"""

from __future__ import annotations

from calc.config.model_spec import ModelSpec
from calc.config.pruning import Pruning
from calc.models.reference import Shape, Weights
from calc.replay.kinds import StorageKind
from calc.replay.tape import Node, Tape, Tensor

PRUNING_KIND = StorageKind.PRUNING
"""The tape category of the mask buffers and the materialised weights (breakdown key
``pruning/...``)."""


class _PreHook:
    """One pruned module: its ``weight_orig`` leaf, mask buffer and current ``weight``."""

    __slots__ = ("tape", "orig", "mask", "weight", "kept")

    def __init__(self, tape: Tape, orig: Tensor, tag: int, custom_mask: bool) -> None:
        self.tape = tape
        self.orig = orig
        self.mask = tape.existing(orig.numel, orig.itemsize, "weight_mask", PRUNING_KIND, tag=tag)
        # prune.custom_from_mask (how a 2:4 mask is applied): the method object, registered as
        # the pre-hook, keeps the caller's mask (``CustomFromMask.__init__: self.mask = mask``)
        # beside the buffer it derives from it (``default_mask * self.mask.to(dtype)``).
        self.kept = (
            tape.existing(orig.numel, orig.itemsize, "custom_mask", PRUNING_KIND, tag=tag)
            if custom_mask
            else None
        )
        # The product computed by prune.l1_unstructured itself, alive when the step starts.
        self.weight = tape.existing(
            orig.numel, orig.itemsize, "masked_weight", PRUNING_KIND, tag=tag
        )

    def __call__(self) -> Tensor:
        """The module is called: ``weight = mask * weight_orig`` replaces the old product."""
        tape, orig, mask = self.tape, self.orig, self.mask

        def rule(tape: Tape, node: Node, grads: list) -> list:
            g = grads[0]
            return [None, tape.new(g.numel, g.itemsize, "dweight_orig") if g is not None else None]

        node = tape.node("Mul", rule, [mask, orig], saved=[mask])
        new = tape.output(tape.new(orig.numel, orig.itemsize, "masked_weight", PRUNING_KIND), node)
        if tape.recomputing is not None:
            # The recomputation re-runs the pre-hook too: its product goes to the module
            # attribute (kept), not to the recomputation's locals (dropped when it ends).
            tape.keep_after_recompute(new)
        old, self.weight = self.weight, new
        tape.drop(old)
        return new


class PrunedLayer(dict):
    """A layer's weights (``reference.Weights.layers[j]``) where reading a pruned linear's key
    *is* calling that module: the replayed model code reads ``lw["q"]`` exactly once per call,
    as the argument of its linear, so the pre-hook runs where PyTorch runs it. Every other key
    (biases, norms) reads as usual; ``values()`` still yields the ``weight_orig`` leaves, in
    the order ``parameters()`` has after pruning."""

    def __init__(self, items: dict, hooks: dict[str, _PreHook]) -> None:
        super().__init__(items)
        self.hooks = hooks

    def __getitem__(self, key: str) -> object:
        hook = self.hooks.get(key)
        return hook() if hook is not None else dict.__getitem__(self, key)

    def get(self, key: str, default: object = None) -> object:
        return self[key] if key in self else default


def install(tape: Tape, sh: Shape, w: Weights, pruning: Pruning, model: ModelSpec) -> None:
    """Reparameterise the pruned linears of every layer of ``w`` (``pruning.removed`` False)."""
    keys = pruning.modules_for(model)
    for j, lw in enumerate(w.layers):
        hooks = {}
        for key in keys:
            orig = lw[key]
            assert orig is not None, key  # a decoder linear always has its weight
            hooks[key] = _PreHook(tape, orig, j, pruning.kind == "2:4")
        order: dict = {}
        for key, t in lw.items():
            if key in hooks and lw.get(f"{key}.b") is not None:
                continue  # weight_orig is registered after the module's bias
            order[key] = t
            if key.endswith(".b") and key[:-2] in hooks and t is not None:
                order[key[:-2]] = lw[key[:-2]]
        w.layers[j] = PrunedLayer(order, hooks)
