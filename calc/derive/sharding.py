"""FSDP2 on a derived model: the rank's step recorded with torch's own ``fully_shard``.

A derived model's FSDP2 rank is not rebuilt from rules (as `calc.parallel.fsdp` replays a
hand-written graph): the recording (`calc.derive.record`) wraps transformers' model with
``fully_shard`` on every decoder layer and then on the root, as verify's ``fsdp2`` engine does
(``verify/dist/engines.py``), over a ``fake`` process group of ``world`` ranks (torch's
``FakeProcessGroup``, ``torch/testing/_internal/distributed/fake_pg.py``: rank 0 of ``world``,
every collective a no-op). Everything FSDP2 allocates is then seen as it happens: the padded
dim-0 shards (``_fsdp_param.py``), the all-gather inputs and outputs and the unsharded
parameters (``resize_`` of storages kept at 0 bytes between uses, ``_fsdp_common.py``
``alloc_storage``/``free_storage``), the reduce-scatter buffers and the sharded gradients
(``_fsdp_collectives.py``), the optimizer states of the shards, and the hooks' timing (root
post-forward, prefetching, the final callback).

What the recording does not hold: the ``DeviceMesh`` each ``fully_shard`` call without a mesh
makes on a CPU run (built here once, outside the fake tensors; `calc.estimate.ranks` adds the
CPU's 512 B per call), and the timing of gloo's worker threads (verify's tolerance notes).

torch is imported only inside these functions: ``calc`` imports without it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from calc.derive.book import DeriveError

MP_DTYPES = {2: "bfloat16", 4: "float32"}
"""``MixedPrecisionPolicy`` dtype by bytes per element (`calc.parallel.data.ReplayPlan`'s
``param_itemsize``/``reduce_itemsize``; calc offers bf16 and fp32)."""


_ONE_WORLD = threading.Lock()
"""One fake default process group at a time (the app may estimate on several threads)."""


@dataclass(frozen=True, slots=True)
class Shard:
    """One FSDP2 rank's wrapping (part of the recording's cache key)."""

    world: int
    """Ranks the parameters are sharded over (dp)."""
    reshard_after_forward: bool = True
    param_itemsize: int = 0
    """``MixedPrecisionPolicy(param_dtype=...)`` bytes per element, 0 without a policy."""
    reduce_itemsize: int = 0
    """``MixedPrecisionPolicy(reduce_dtype=...)`` bytes per element, 0: the gradients'."""
    cast_forward_inputs: bool = True
    output_itemsize: int = 0
    """The root's ``MixedPrecisionPolicy(output_dtype=...)`` bytes per element, 0: no cast
    (FSDP2)."""
    version: int = 2
    """2: FSDP2 ``fully_shard``; 1: FSDP1 ``FullyShardedDataParallel`` (flat parameters)."""
    use_orig_params: bool = False
    """FSDP1 ``use_orig_params`` (LoRA needs it: frozen and trained parameters in one flat
    parameter)."""

    def __post_init__(self) -> None:
        if self.world < 2:
            raise ValueError(f"Shard.world={self.world}: FSDP shards over 2 or more ranks")
        if self.version not in (1, 2):
            raise ValueError(f"Shard.version={self.version}: allowed 1 (FSDP1), 2 (FSDP2)")
        for name in ("param_itemsize", "reduce_itemsize", "output_itemsize"):
            value = getattr(self, name)
            if value != 0 and value not in MP_DTYPES:
                raise ValueError(f"Shard.{name}={value}: allowed 0, 2 (bf16), 4 (fp32)")


@contextlib.contextmanager
def fake_group(world: int) -> Iterator[None]:
    """A ``fake`` default process group of ``world`` ranks (this process is rank 0), torn down
    afterwards. A process that already has a default group cannot record a second one."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    with _ONE_WORLD:
        if dist.is_initialized():
            raise DeriveError(
                "recording a distributed rank needs a process without a default process group "
                "(it makes a fake one of the rank count); this one already has one"
            )
        hook = sys.excepthook  # init_process_group prefixes every later traceback "[rank0]"
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
        try:
            yield
        finally:
            dist.destroy_process_group()
            sys.excepthook = hook


@contextlib.contextmanager
def fake_world(shard: Shard | None) -> Iterator[Any]:
    """`fake_group` of ``shard.world`` ranks and its 1-D CPU ``DeviceMesh``, made before any
    fake tensor exists (``init_device_mesh`` reads its ranks from a real tensor). Yields the
    mesh (None without ``shard``)."""
    if shard is None:
        yield None
        return
    from torch.distributed.device_mesh import init_device_mesh

    with fake_group(shard.world):
        yield init_device_mesh("cpu", (shard.world,))


def torch_dtype(itemsize: int) -> Any:
    """The torch dtype of a mixed-precision itemsize (`MP_DTYPES`), None for 0 (no cast)."""
    import torch

    return getattr(torch, MP_DTYPES[itemsize]) if itemsize else None


def wrap(model: Any, layers: Any, shard: Shard, mesh: Any) -> Any:
    """The module to train: ``model`` itself after ``fully_shard`` on every decoder layer, then
    on the root (FSDP2, in place), or FSDP1's ``FullyShardedDataParallel`` wrapper around it
    (`wrap_fsdp1`); with ``shard``'s options (verify's ``fsdp2`` and ``fsdp1`` engines,
    ``verify/dist/engines.py``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if shard.version == 1:
        return wrap_fsdp1(model, type(layers[0]), shard)

    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": shard.reshard_after_forward}
    if shard.param_itemsize or shard.output_itemsize:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch_dtype(shard.param_itemsize),
            reduce_dtype=torch_dtype(shard.reduce_itemsize),
            cast_forward_inputs=shard.cast_forward_inputs,
        )
    for layer in layers:
        fully_shard(layer, **kw)
    if shard.output_itemsize:  # the root's outputs only (a layer's would reach the bf16 head)
        kw["mp_policy"] = replace(kw["mp_policy"], output_dtype=torch_dtype(shard.output_itemsize))
    fully_shard(model, **kw)
    return model


def wrap_fsdp1(model: Any, layer_class: type, shard: Shard) -> Any:
    """FSDP1: ``FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer
    class}))`` (each decoder layer one flat parameter, the rest the root's), on the CPU
    (``device_id``: FSDP1 asks for an accelerator otherwise, ``_init_utils.py``
    ``_init_device_handle``), ``FULL_SHARD`` (``SHARD_GRAD_OP`` without
    ``reshard_after_forward``), ``MixedPrecision(param_dtype, reduce_dtype,
    cast_forward_inputs)`` and ``use_orig_params`` from ``shard``; every other argument
    FSDP1's default (``BACKWARD_PRE`` prefetch, ``limit_all_gathers``). The same call as
    verify's ``fsdp1`` engine."""
    import torch
    from torch.distributed.fsdp import (
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
        _flat_param,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # use_orig_params aligns every parameter by its dtype's size, which FSDP1 learns once per
    # process from a scalar ``torch.empty`` (``_get_dtype_size``, an lru_cache): every
    # recording starts as a fresh process does, so every point records the same stream
    cache_clear = getattr(getattr(_flat_param, "_get_dtype_size", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()

    strategy = (
        ShardingStrategy.FULL_SHARD
        if shard.reshard_after_forward
        else ShardingStrategy.SHARD_GRAD_OP
    )
    mixed = None
    if shard.param_itemsize:
        mixed = MixedPrecision(
            param_dtype=torch_dtype(shard.param_itemsize),
            reduce_dtype=torch_dtype(shard.reduce_itemsize),
            cast_forward_inputs=shard.cast_forward_inputs,
        )
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({layer_class}),
        sharding_strategy=strategy,
        mixed_precision=mixed,
        device_id=torch.device("cpu"),
        use_orig_params=shard.use_orig_params,
    )
