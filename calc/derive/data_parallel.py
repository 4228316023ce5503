"""DDP and FSDP2 on a derived model: DDP's rank replays the recorded single-GPU step plus
DDP's buckets; FSDP2's rank is recorded wrapped (`calc.derive.sharding`).

Without ``gradient_as_bucket_view`` a DDP rank (``torch/nn/parallel/distributed.py`` and the
C++ ``Reducer``) holds everything the single-process step holds, plus flat gradient buckets
allocated at construction (one per dtype in the first iteration, rebuilt in the order the
gradients became ready after it): constant storages `calc.estimate.ranks` adds to the replay
(``ddp_buckets``), given every gradient's size in ready order. For a hand-written graph the
replay's tape lists them; for a derived one `grad_order` reads them from the recorded stream:
the gradients (storages classified ``grad``) in the order the first backward allocated them,
each one's bytes over its parameter dtype's itemsize.

The buckets are constant, so whatever the loop does around the model (the held output, the
loop's loss, accumulation without ``no_sync``, where ``zero_grad`` runs, LoRA's adapters as the
only gradients) is the recorded step's. What neither recording holds is refused by
`check_ddp`: gradient views of the buckets, ZeRO-1/2, offload, an optimizer stepped inside the
backward, and the chunked loss, which calls the base model outside the wrapper.
"""

from __future__ import annotations

from calc.config.jobs import Training
from calc.config.model_spec import ModelSpec
from calc.derive import lift
from calc.derive.native import LocalOptimizer, Rank
from calc.derive.period import expand_order
from calc.derive.replay import derived_stream
from calc.derive.sharding import Shard
from calc.parallel.data import ReplayPlan
from calc.replay.kinds import StorageKind

GRAD_ITEMSIZE = {"fp32": 4, "amp-bf16": 4, "amp-fp16": 4, "bf16": 2, "bf16-master": 2}
"""Bytes per gradient element of each precision: the parameters' dtype (fp32 weights under
autocast, bf16 under fp32 masters; ``verify/models/build.py``, ``WEIGHT_DTYPE``)."""


def plain_ddp(plan: ReplayPlan) -> bool:
    """Whether ``plan`` is DDP without gradient views, ZeRO, FSDP or offload, or with ZeRO-1 by
    parameter: the rank's step is the single-process one (`calc.parallel.data.install` installs
    no hook for it), its optimizer over the rank's parameters for ZeRO-1."""
    return plan == ReplayPlan(shard_world=plan.shard_world,
                              reshard_after_forward=plan.reshard_after_forward,
                              cast_forward_inputs=plan.cast_forward_inputs,
                              optimizer_params=plan.optimizer_params)  # fmt: skip


def check_ddp(model: ModelSpec, job: Training, plan: ReplayPlan) -> None:
    """Raise ``NotImplementedError`` naming what a derived model's data-parallel rank does not
    cover yet: DDP without bucket views (verify's ``dist-derived-*`` DDP cases) and FSDP2
    without offload (`fsdp_shard`) are modelled; with either, neither an optimizer stepped
    inside the backward nor the chunked loss, which calls the base model around the
    wrapper."""
    name = f"model_type={model.model_type!r} (derived replay)"
    if plan.replicated:
        raise NotImplementedError(
            f"{name} under HSDP (dp_replicate > 1): the recording wraps the model with FSDP2 "
            "over one mesh dimension; HSDP is replayed on the hand-written graphs"
        )
    if not plain_ddp(plan) and not (plan.fsdp and plan.offload == "none"):
        raise NotImplementedError(
            f"{name}: of the parallel layouts DDP without gradient_as_bucket_view (ZeRO-1 by "
            "parameter included) and FSDP2 without offload are modelled (ZeRO-1 by shard, "
            "ZeRO-2, bucket views and offload change the recorded step)"
        )
    zero1 = ("sgd", "sgd-momentum", "adam", "adamw")  # verify's zero1 engine: torch's classes
    if plan.optimizer_params is not None and (
        job.optimizer not in zero1 or job.precision in ("amp-fp16", "bf16-master")
    ):
        raise NotImplementedError(
            f"{name} under ZeRO-1 with optimizer={job.optimizer!r}, precision={job.precision!r}: "
            f"ZeroRedundancyOptimizer is recorded around {', '.join(zero1)} without a "
            "GradScaler or fp32 masters"
        )
    if job.optimizer_in_backward or job.loss == "chunked-ce":
        raise NotImplementedError(
            f"{name} under DDP or FSDP2 with optimizer_in_backward or loss='chunked-ce': the "
            "first steps parameters inside the wrapper's hooks, the second calls the base "
            "model around the wrapper (the other loops and losses, accumulation, zero_grad "
            "placements, LoRA and optimizer=None are modelled)"
        )


def fsdp_shard(model: ModelSpec, job: Training, plan: ReplayPlan) -> Rank | None:
    """How a derived rank is recorded: wrapped by FSDP2 (`calc.derive.sharding`), with ZeRO-1's
    local optimizer (`LocalOptimizer`), or as one process (None: DDP);
    ``NotImplementedError`` from `check_ddp` for what is not modelled."""
    check_ddp(model, job, plan)
    if not plan.fsdp:
        return None if plan.optimizer_params is None else LocalOptimizer(plan.optimizer_params)
    return Shard(
        world=plan.shard_world,
        reshard_after_forward=plan.reshard_after_forward,
        param_itemsize=plan.param_itemsize,
        reduce_itemsize=plan.reduce_itemsize,
        cast_forward_inputs=plan.cast_forward_inputs,
        output_itemsize=plan.output_itemsize,
        version=plan.fsdp_version,
        use_orig_params=plan.use_orig_params,
    )


def grad_order(model: ModelSpec, job: Training, n_layers: int) -> tuple:
    """``(name, layer tag, numel, itemsize)`` of every gradient of the recording of ``job``
    with ``n_layers`` layers, in the order the first backward allocated them (what
    `calc.estimate.core.Compiled.grad_order` holds for a hand-written replay)."""
    d = derived_stream(model, job, n_layers)
    itemsize = GRAD_ITEMSIZE[job.precision]
    out = []
    seen: set[int] = set()
    for alloc, sid, phase, _segment in d.stream:
        kind, name, tag = d.info[sid]
        if alloc and phase == "step1/backward" and kind == StorageKind.GRAD and sid not in seen:
            seen.add(sid)
            nbytes = lift.expression(d.sizes[sid], d.regime)
            if not isinstance(nbytes, int) or nbytes % itemsize:
                raise NotImplementedError(
                    f"the gradient {name} of model_type={model.model_type!r} has {nbytes} bytes, "
                    f"not a whole number of {itemsize}-byte elements independent of the sizes"
                )
            out.append((name, tag, nbytes // itemsize, itemsize))
    return tuple(out) if d.layout is None else expand_order(out, d.layout)
