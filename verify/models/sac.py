"""torchtitan's op-level selective checkpointing (``selective_ac_option="op"``) for the
measured runs, written again from ``torchtitan/distributed/activation_checkpoint.py``
(``_apply_op_sac``): per checkpointed block, keep the outputs of ``mm`` (all but every second
one), of the fused SDPA kernels, ``reduce_scatter_tensor`` and ``max``; recompute the rest.

CPU SDPA's flash kernel is kept as CUDA's flash kernel is: calc replays that CPU kernel as
CUDA's (the GPU recipe), and the measured run on the tracker must run the same policy."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_ATEN = torch.ops.aten
KEPT = (
    _ATEN.mm.default,
    _ATEN._scaled_dot_product_efficient_attention.default,
    _ATEN._scaled_dot_product_flash_attention.default,
    _ATEN._scaled_dot_product_flash_attention_for_cpu.default,
    _ATEN._scaled_dot_product_cudnn_attention.default,
    _ATEN._scaled_dot_product_attention_math.default,
    _ATEN._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    _ATEN.max.default,
    torch._higher_order_ops.flex_attention,
)
"""llama3/infra/parallelize.py's ``_op_sac_save_list`` (torchtitan 0.2.2), plus the CPU flash
kernel. On the CPU the cuDNN, overrideable and flex kernels never run and the math kernel is a
composite (its ops reach the policy, not it): only ``mm`` and the flash kernel decide."""


class _BlockPolicy:
    """The policy of one block call: its own ``mm`` counters (forward, recompute)."""

    def __init__(self) -> None:
        self.forward_mm = 0
        self.recompute_mm = 0

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func is _ATEN.mm.default:
            if ctx.is_recompute:
                self.recompute_mm += 1
                nth = self.recompute_mm
            else:
                self.forward_mm += 1
                nth = self.forward_mm
            if nth % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in KEPT:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def block_contexts():
    """``context_fn`` of torchtitan's wrapper: fresh counters per block forward."""
    return create_selective_checkpoint_contexts(_BlockPolicy())


def enable_on(model: torch.nn.Module) -> None:
    """Every decoder layer of a transformers model checkpointed with the policy
    (``checkpoint_wrapper(preserve_rng_state=False)`` is non-reentrant checkpoint)."""
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={
            "use_reentrant": False,
            "preserve_rng_state": False,
            "context_fn": block_contexts,
        }
    )
