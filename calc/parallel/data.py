"""Data parallelism on one rank: DDP's gradient buckets and ZeRO-1's optimizer-state partition.

What a data-parallel rank holds beyond the single-GPU step (PyTorch 2.13):

* **DDP** (``torch/nn/parallel/distributed.py``, the C++ ``Reducer``): flat gradient buckets,
  one tensor per bucket of ``sum(numel)`` elements in the gradients' dtype, allocated when DDP
  is built. Without ``find_unused_parameters`` the first iteration uses a single bucket holding
  every parameter (``compute_bucket_size_limits`` returns ``[sys.maxsize]``); after it the
  buckets are rebuilt in the order the gradients became ready, with limits
  ``[first_bucket_bytes_cap, bucket_bytes_cap]`` (1 MiB then 25 MiB with the default
  ``bucket_cap_mb=None``; the given cap for both otherwise): a bucket closes as soon as its
  bytes reach the current limit (``compute_bucket_assignment_by_size``). With
  ``gradient_as_bucket_view=False`` every ``.grad`` is kept besides the buckets (2x gradient
  memory, memory-facts §2.3); with ``True`` each gradient is copied into its bucket as soon as
  it is ready and ``.grad`` becomes a view of the bucket (the stolen gradient dies there).
* **ZeRO-1 by parameter** (``torch.distributed.optim.ZeroRedundancyOptimizer``,
  ``_partition_parameters``): parameters sorted by ``numel`` (largest first, stable), each given
  to the rank with the smallest total so far; a rank keeps the optimizer states of its own
  parameters and runs the optimizer on them only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sympy as sp

from calc.config.parallelism import Parallelism
from calc.replay.tape import Size, Tape, Tensor
from calc.units import MIB

DDP_FIRST_BUCKET_BYTES = 1 * MIB
"""``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``: the first bucket's cap with the default
``bucket_cap_mb``."""
DDP_DEFAULT_BUCKET_MIB = 25
"""``_DEFAULT_BUCKET_CAP_MB`` in ``torch/nn/parallel/distributed.py``."""


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What changes in one rank's replay of the step (hashable: part of the compile key)."""

    grads_in_buckets: bool = False
    """DDP ``gradient_as_bucket_view=True``: ``.grad`` is a view of a bucket (no own storage)."""
    optimizer_params: tuple[int, ...] | None = None
    """Indices (``parameters()`` order) of the parameters whose optimizer states this rank holds,
    in the order its local optimizer sees them; None: all of them."""
    fsdp: bool = False
    """FSDP2 ``fully_shard`` per layer and root over ``shard_world`` ranks (`calc.parallel.fsdp`)."""
    shard_world: int = 1
    """Ranks the shards are spread over (dp, or dp / dp_replicate under HSDP)."""
    replicated: bool = False
    """HSDP: the shards are replicated over ``dp_replicate`` groups and their gradients
    all-reduced across them (`calc.parallel.fsdp`)."""
    reshard_after_forward: bool = True
    """FSDP2: free each layer's unsharded parameters after its forward."""
    shard_states: bool = False
    """ZeRO-1/2 (no FSDP): the optimizer steps each parameter's dim-0 shard only."""
    shard_grads: bool = False
    """ZeRO-2: each gradient is reduce-scattered once ready; its shard is kept."""
    offload: str = "none"
    """``optimizer``: states and the step on the CPU; ``optimizer+params``: shards too."""
    param_itemsize: int = 0
    """FSDP2 ``MixedPrecisionPolicy``: bytes per element of the all-gathered parameters (2 for
    bf16), or 0 without a policy."""
    reduce_itemsize: int = 0
    """FSDP2 ``MixedPrecisionPolicy``: bytes per element of the reduce-scatter (0: the
    gradients' own)."""
    cast_forward_inputs: bool = True
    """FSDP2 ``MixedPrecisionPolicy(cast_forward_inputs=...)`` (the hand-written replays cast
    where the attention does, the same bytes; a derived rank records the policy itself)."""
    output_itemsize: int = 0
    """FSDP2 ``MixedPrecisionPolicy(output_dtype=...)`` bytes per element, 0: no cast
    (recorded only: `calc.derive.sharding`)."""
    fsdp_version: int = 2
    """With ``fsdp``: 2 (``fully_shard``) or 1 (``FullyShardedDataParallel``, recorded only:
    `calc.derive.sharding`)."""
    use_orig_params: bool = False
    """FSDP1 ``use_orig_params``."""
    fsdp_rank: int = 0
    """FSDP1 written by hand (`calc.parallel.fsdp1`): the rank replayed, whose piece of each
    flat parameter cuts the original parameters where it does."""

    @property
    def recorded_only(self) -> str:
        """What of this plan only the recorded rank models (the hand-written replays do not),
        or ``""``: FSDP1 and FSDP2's ``output_dtype``."""
        if self.fsdp and self.fsdp_version == 1:
            return "fsdp_version=1 (FullyShardedDataParallel's flat parameters)"
        if self.fsdp and self.output_itemsize:
            return "fsdp_output_dtype (MixedPrecisionPolicy output casts)"
        return ""


def bucket_limits(parallel: Parallelism) -> tuple[int, int]:
    """(first bucket cap, later bucket cap) in bytes for DDP's rebuilt buckets."""
    if parallel.ddp_bucket_mib is None:
        return DDP_FIRST_BUCKET_BYTES, DDP_DEFAULT_BUCKET_MIB * MIB
    cap = parallel.ddp_bucket_mib * MIB
    return cap, cap


def assign_buckets(grads: Sequence[tuple[int, int]], limits: Sequence[int]) -> list[list[int]]:
    """Indices of ``grads`` (``(itemsize, numel)`` in ready order) per bucket, as the C++
    ``compute_bucket_assignment_by_size`` groups them: per dtype, a bucket closes once its bytes
    reach the current limit; the limit then advances to the next one (the last one stays)."""
    open_: dict[int, list[int]] = {}
    size: dict[int, int] = {}
    limit_at: dict[int, int] = {}
    out: list[list[int]] = []
    for i, (itemsize, numel) in enumerate(grads):
        open_.setdefault(itemsize, []).append(i)
        size[itemsize] = size.get(itemsize, 0) + itemsize * numel
        j = limit_at.setdefault(itemsize, 0)
        if size[itemsize] >= limits[j]:
            out.append(open_.pop(itemsize))
            size[itemsize] = 0
            limit_at[itemsize] = min(j + 1, len(limits) - 1)
    out.extend(idx for idx in open_.values() if idx)
    return out


def bucket_bytes(grads: Sequence[tuple[int, int]], buckets: Sequence[Sequence[int]]) -> list[int]:
    """Bytes charged for each bucket: one allocation of ``sum(numel) * itemsize``, rounded to
    512 like every allocation (``calc.replay.tape.round_block``)."""
    out = []
    for idx in buckets:
        itemsize = grads[idx[0]][0]
        nbytes = itemsize * sum(grads[i][1] for i in idx)
        out.append(-(-nbytes // 512) * 512 if nbytes else 0)
    return out


def zero_redundancy_partition(numels: Sequence[int], world: int) -> list[list[int]]:
    """Parameter indices per rank, as ``ZeroRedundancyOptimizer._partition_parameters`` assigns
    them (one parameter group): largest first (stable sort), each to the least-loaded rank (the
    lowest such rank on ties); each rank's list in that order."""
    order = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
    loads = [0] * world
    ranks: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        r = loads.index(min(loads))
        ranks[r].append(i)
        loads[r] += numels[i]
    return ranks


def install(tape: Tape, plan: ReplayPlan, shard_of: dict[int, Size] | None = None) -> None:
    """Set the tape's post-accumulate-grad hook for ``plan`` (``shard_of``: leaf storage id ->
    shard numel, for ZeRO-2)."""
    if plan.grads_in_buckets:
        tape.grad_hook = _grad_into_bucket
    elif plan.shard_grads and shard_of is not None:

        def reduce_scatter(tape: Tape, leaf: Tensor) -> None:
            key = id(leaf.storage)
            full = tape.grads[key]
            tape.grads[key] = tape.new(
                shard_of[key], leaf.itemsize, f"grad_shard:{leaf.name}", "grad", leaf.storage.tag
            )
            tape.drop(full)

        tape.grad_hook = reduce_scatter


def _grad_into_bucket(tape: Tape, leaf: Tensor) -> None:
    """DDP ``mark_variable_ready`` with ``gradient_as_bucket_view``: the gradient is copied into
    its bucket view and ``.grad`` becomes that view; the gradient's own storage dies (its bytes
    are the bucket's, counted once as a constant)."""
    key = id(leaf.storage)
    old = tape.grads[key]
    view = tape.new(0, leaf.itemsize, f"grad_view:{leaf.name}", "grad", leaf.storage.tag)
    tape.grads[key] = view
    tape.drop(old)


def prepare(
    tape: Tape,
    plan: ReplayPlan,
    params: Sequence[Tensor],
    opt_params: Sequence[Tensor],
    shapes: Sequence[tuple],
) -> list[Tensor]:
    """Install ``plan``'s hooks; return what the optimizer steps (ZeRO-1/2 with sharded states:
    a view of each parameter's share, `flat_share`)."""
    shard_of: dict[int, Size] = {}
    if plan.shard_states or plan.shard_grads:
        for p, shape in zip(params, shapes, strict=True):
            shard_of[id(p.storage)] = flat_share(shape, plan.shard_world)
    install(tape, plan, shard_of)
    if plan.shard_states:
        return [tape.alias(p, numel=shard_of[id(p.storage)]) for p in opt_params]
    return list(opt_params)


def flat_share(shape: Sequence[Size], n: int) -> Size:
    """One rank's share of a parameter under ZeRO-1/2 with sharded states: ``ceil(numel / n)``
    elements. DeepSpeed's stage 1 and 2 flatten a group's parameters into one buffer and give
    each rank an equal contiguous slice (``DeepSpeedZeroOptimizer``,
    ``deepspeed/runtime/zero/stage_1_and_2.py``: ``flatten_dense_tensors_aligned``, then
    ``get_data_parallel_partitions``), so a parameter narrower than ``n`` rows (a LoRA ``A`` of
    ``[r, in]`` with ``r < n``) costs ``1/n`` of it, not a padded row per rank as FSDP2's
    dim-0 shards (`calc.parallel.fsdp.shard_numel`)."""
    numel: Size = 1
    for d in shape:
        numel = numel * d
    return -(-numel // n) if isinstance(numel, int) else sp.ceiling(numel / n)


def optimizer_params(params: Sequence[Tensor], plan: ReplayPlan) -> list[Tensor]:
    """The parameters this rank's optimizer steps (ZeRO-1: its own, in its order)."""
    if plan.optimizer_params is None:
        return list(params)
    return [params[i] for i in plan.optimizer_params]
