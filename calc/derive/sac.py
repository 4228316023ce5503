"""torchtitan's op-level selective activation checkpointing (``[activation_checkpoint]
mode="selective"``, ``selective_ac_option="op"``), applied to transformers' decoder layers for
the recording (`calc.derive.record`).

The policy, from ``torchtitan/distributed/activation_checkpoint.py`` (``_apply_op_sac``,
torchtitan 0.1-0.2, 2025; ``_get_custom_policy``): each checkpointed block's forward keeps the
outputs of the ops in the save list (``MUST_SAVE``), except every second ``aten.mm`` of the
block, counted from one per block and separately in the recompute; every other op is
recomputed in the backward (``PREFER_RECOMPUTE``). The save list: ``aten.mm``, the fused SDPA
kernels (efficient, flash), ``_c10d_functional.reduce_scatter_tensor`` and ``aten.max`` (for
float8 scales). The wrapper is ``checkpoint_wrapper(preserve_rng_state=False)``: non-reentrant
``torch.utils.checkpoint.checkpoint`` with ``context_fn`` set.

The recording runs CPU kernels; CPU SDPA's flash kernel (``_scaled_dot_product_flash_attention_
for_cpu``) stands for CUDA's flash kernel it replays (`calc.derive.replay`), so it is saved as
CUDA's is. A CPU run of torchtitan's list would recompute it: calc models the GPU recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def saved_ops() -> frozenset[Any]:
    """The ops whose outputs the policy keeps (every second ``mm`` excepted)."""
    import torch

    aten = torch.ops.aten
    return frozenset(
        {
            aten.mm.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
            aten.max.default,
        }
    )


def op_context() -> Any:
    """One checkpointed call's ``(forward, recompute)`` contexts: a fresh ``mm`` count per call,
    as torchtitan's ``selective_checkpointing_context_fn`` makes one per block forward."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = saved_ops()
    mm = torch.ops.aten.mm.default
    counts = {False: 0, True: 0}  # mm seen in the forward, in the recompute

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func == mm:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs() -> dict[str, Callable[[], Any] | bool]:
    """The ``activation_checkpointing_enable`` keyword arguments of torchtitan's wrapper."""
    return {"use_reentrant": False, "preserve_rng_state": False, "context_fn": op_context}
