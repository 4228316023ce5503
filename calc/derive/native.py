"""transformers' own tensor and expert parallelism on a derived model: the rank's step
recorded with ``DistributedConfig`` applied as transformers applies it.

transformers 5.24 parallelizes a model itself (``transformers/distributed/``:
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., ep_size=...))``, which
calls ``PreTrainedModel.prepare_distribute_model`` for the device mesh and
``maybe_distribute_model`` for the plans). The plans are the model's own: its config class's
``base_model_tp_plan`` (column/row-wise projections, the embedding split over the vocabulary)
and, with expert parallelism, ``base_model_ep_plan`` (each rank holds ``E / ep`` whole experts
and the tokens reach them through the plan's dispatch). `distribute` makes the same two calls
on the model the recording builds, over `calc.derive.sharding.fake_group` (every collective a
no-op), so the DTensor shards, the redistributions and their buffers are transformers' and
torch's own. verify's ``hf-native`` engine makes them on gloo ranks.

torch and transformers are imported only inside these functions: ``calc`` imports without them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from calc.derive.sharding import Shard, fake_group

EP_IMPL = "all_reduce"
"""transformers' ``ep_implementation`` recorded: each rank runs its experts on the batch the
group shares and the outputs are summed (``ep_size == tp_size``). ``all_to_all`` sends each
expert its routed tokens, buffers whose sizes follow the routing: not recordable."""


@dataclass(frozen=True, slots=True)
class Native:
    """One rank of transformers' ``DistributedConfig`` (part of the recording's cache key)."""

    tp: int
    """``tp_size``: ranks the model's ``base_model_tp_plan`` splits over."""
    expert_parallel: bool = False
    """``ep_size=tp``: the experts spread over the ranks (``base_model_ep_plan``)."""

    def __post_init__(self) -> None:
        if self.tp < 2:
            raise ValueError(f"Native.tp={self.tp}: tensor parallelism over 2 or more ranks")

    @property
    def world(self) -> int:
        """Ranks of the fake process group."""
        return self.tp

    def config(self) -> Any:
        """transformers' ``DistributedConfig`` of this rank's layout."""
        from transformers.distributed import DistributedConfig

        if not self.expert_parallel:
            return DistributedConfig(tp_size=self.tp)
        return DistributedConfig(tp_size=self.tp, ep_size=self.tp, ep_implementation=EP_IMPL)


@dataclass(frozen=True, slots=True)
class LocalOptimizer:
    """A DDP rank under ZeRO-1 by parameter (``torch.distributed.optim.ZeroRedundancyOptimizer``,
    verify's ``zero1`` engine): its local optimizer steps, and keeps the states of, the trained
    parameters at ``params`` only (indices in ``model.parameters()`` order, as
    `calc.parallel.data.zero_redundancy_partition` assigns them); the model is not wrapped (DDP's
    buckets are added to the recorded step, `calc.derive.data_parallel`), and every gradient is
    made and set to None as on one process (``zero_grad`` covers every parameter)."""

    params: tuple[int, ...]


Rank = Shard | Native | LocalOptimizer
"""How a recorded distributed rank differs from one process: FSDP (`Shard`), transformers'
plans (`Native`) or a ZeRO-1 rank's optimizer (`LocalOptimizer`)."""


@contextlib.contextmanager
def native_world(plan: Native) -> Iterator[Any]:
    """`fake_group` of ``plan.world`` ranks and transformers' device meshes for ``plan``
    (``prepare_distribute_model``, before any fake tensor exists). Yields ``(distributed
    config, mesh manager)``."""
    from transformers import PreTrainedModel

    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(plan.world)})
    try:
        with fake_group(plan.world):
            config, _, mesh = PreTrainedModel.prepare_distribute_model(plan.config())
            yield config, mesh
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def distribute(model: Any, world: Any) -> Any:
    """``model`` with transformers' plans applied (``maybe_distribute_model``) over the
    ``(distributed config, mesh manager)`` of `native_world`."""
    config, mesh = world
    return type(model).maybe_distribute_model(model, config, mesh)
