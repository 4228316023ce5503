"""Which ranks of a parallel layout hold what: the sharding layer every memory term goes through.

`holding` says how one rank holds each kind of tensor (weights, gradients, optimizer states,
activations) under a `calc.config.parallelism.Parallelism`; `rank_classes` groups the ranks
that hold the same tensors (hence have the same peak) and says, for each class, which model it
replays (tensor parallelism: its part, `calc.parallel.tensor.rank_model`) and what changes in
its replay (`calc.parallel.data.ReplayPlan`). `global_rank` numbers the mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from calc.config.checks import check_choice
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.parallel import tensor as tensor_parallel
from calc.parallel.data import ReplayPlan, zero_redundancy_partition

BY_PARAMETER_MAX_LAYERS = 16
"""Largest model (layers) for which the by-parameter ZeRO-1 partition is replayed layer by
layer (about 5 s per layer and rank on one core)."""

Holding = Literal["replicated", "dp-sharded", "dp-owned", "tp-split", "pp-stage", "cpu"]
"""How a rank holds a class of tensors: a full copy (``replicated``), a 1/dp slice of every
tensor (``dp-sharded``: FSDP2/ZeRO-3 parameters, ZeRO-2 gradients), whole tensors owned by one
dp rank each (``dp-owned``: ``ZeroRedundancyOptimizer``'s states), the rank's part of a
Megatron split (``tp-split``), only the layers of its pipeline stage (``pp-stage``), or not on
the GPU at all (``cpu``: offloaded)."""
TENSOR_KINDS: tuple[str, ...] = ("weight", "grad", "state", "activation")


def holding(kind: str, parallel: Parallelism) -> tuple[Holding, ...]:
    """How one rank holds tensors of ``kind`` under ``parallel``: the holdings that apply, in
    the order the layer applies them (e.g. ``("pp-stage", "tp-split", "dp-owned")``).

    Sources: ZeRO stages 1/2/3 shard optimizer states / + gradients / + parameters over the
    data-parallel ranks (Rajbhandari et al. 2020, §5.1-5.3); ``ZeroRedundancyOptimizer`` keeps
    whole parameters' states per rank; Megatron TP splits weights, their gradients and states,
    and the activations inside attention and MLP (Shoeybi et al. 2019 §3; with SP also the
    rest, Korthikanti et al. 2022 §4.2.2); a pipeline stage holds its layers only; ZeRO-Offload
    keeps optimizer states (and, ZeRO-Infinity, parameters) in CPU memory.
    """
    check_choice("kind", kind, TENSOR_KINDS)
    out: list[Holding] = []
    if parallel.pp > 1 and kind != "activation":
        out.append("pp-stage")
    if parallel.tp > 1:
        out.append("tp-split")
    if kind == "activation":
        return tuple(out) or ("replicated",)
    level = parallel.shard_level
    offloaded = (kind == "state" and parallel.offload != "none") or (
        kind in ("weight",) and parallel.offload == "optimizer+params"
    )
    if offloaded:
        out.append("cpu")
    elif parallel.dp > 1:
        sharded_from = {"state": 1, "grad": 2, "weight": 3}[kind]
        if level >= sharded_from:
            by_param = kind == "state" and parallel.zero_partition == "by-parameter"
            out.append("dp-owned" if by_param else "dp-sharded")
    return tuple(out) or ("replicated",)


@dataclass(frozen=True, slots=True)
class RankClass:
    """Ranks that hold the same tensors, hence have the same peak."""

    ranks: tuple[int, ...]
    """Global ranks (mesh ``[dp, pp, cp, tp]``, row-major: tp innermost)."""
    label: str
    """What distinguishes this class (e.g. ``dp rank 1``)."""
    model: ModelSpec
    """The model one rank of this class replays (tensor parallelism: its part)."""
    replay: ReplayPlan
    """Changes to the replayed step (`calc.parallel.data.ReplayPlan`)."""
    ddp: bool
    """DDP gradient buckets are held (data parallel without sharded gradients)."""
    notes: tuple[str, ...] = ()


def global_rank(parallel: Parallelism, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
    """Global rank of mesh coordinates ``[dp, pp, cp, tp]`` (tp innermost)."""
    return ((dp * parallel.pp + pp) * parallel.cp + cp) * parallel.tp + tp


MP_ITEMSIZE = {"none": 0, "bf16": 2, "fp32": 4}
"""Bytes per element of an FSDP2 ``MixedPrecisionPolicy`` dtype (0: no policy)."""


def rank_classes(
    model: ModelSpec, parallel: Parallelism, trainable_numels: Sequence[int] | None = None
) -> list[RankClass]:
    """The classes of ranks of ``parallel`` and what each holds, decided by `holding`.
    ``trainable_numels``: elements of the trainable parameters in ``parameters()`` order when
    not all of the model's parameters train (LoRA: the adapters, `calc.compress.lora.trainable_numels`);
    ``ZeroRedundancyOptimizer`` partitions those.

    Raises ``NotImplementedError`` naming what the cost model does not cover yet.
    """
    w, g, s = holding("weight", parallel), holding("grad", parallel), holding("state", parallel)
    for hold in (w, g, s):
        if "pp-stage" in hold:
            raise NotImplementedError("pipeline parallelism (pp > 1) is not modelled yet")
    fsdp = "dp-sharded" in w or (parallel.offload == "optimizer+params")
    if parallel.offload != "none" and parallel.dp == 1:
        raise NotImplementedError("CPU offload is modelled with data parallelism (dp > 1)")
    if parallel.dp_replicate > 1 and (parallel.offload != "none" or parallel.tp > 1):
        raise NotImplementedError(
            "HSDP (dp_replicate > 1) is modelled without CPU offload and tensor parallelism"
        )
    local = model  # cp > 1: the job is the rank's (calc.parallel.context, in calc.estimate.ranks)
    notes: list[str] = []
    if "tp-split" in w:
        local = tensor_parallel.rank_model(model, parallel)
        notes.append(f"tensor parallel: each rank replays {local.name}")
    zero2 = "dp-sharded" in g and not fsdp
    ddp = parallel.dp > 1 and not fsdp and not zero2
    plan = ReplayPlan(
        grads_in_buckets=ddp and parallel.gradient_as_bucket_view,
        fsdp=fsdp,
        shard_world=parallel.shard_world,
        replicated=fsdp and parallel.dp_replicate > 1,
        reshard_after_forward=parallel.reshard_after_forward,
        shard_states="dp-sharded" in s and not fsdp,
        shard_grads=zero2,
        offload=parallel.offload,
        param_itemsize=MP_ITEMSIZE[parallel.fsdp_param_dtype],
        reduce_itemsize=MP_ITEMSIZE[parallel.fsdp_reduce_dtype],
        output_itemsize=MP_ITEMSIZE[parallel.fsdp_output_dtype] if fsdp else 0,
        cast_forward_inputs=parallel.fsdp_cast_forward_inputs,
        fsdp_version=parallel.fsdp_version if fsdp else 2,
        use_orig_params=parallel.fsdp_use_orig_params,
    )
    if plan.shard_states:
        notes.append(
            f"ZeRO-{parallel.zero} (analytic, no PyTorch engine runs it): optimizer states of "
            f"each parameter's dim-0 shard (1/{parallel.dp})"
            + ("; gradients reduce-scattered as they become ready" if zero2 else
               "; gradients all-reduced through DDP's buckets")
        )  # fmt: skip
    if parallel.offload != "none":
        notes.append(
            f"offload={parallel.offload} (analytic): optimizer states and step on the CPU; "
            "gradients leave the GPU after the backward"
            + ("; parameter shards on the CPU, gathered per layer" if fsdp else "")
        )
    if fsdp:
        notes.extend(_fsdp_notes(parallel))
    every = tuple(range(parallel.world_size))
    if "dp-owned" not in s:
        return [RankClass(every, "every rank", local, plan, ddp, tuple(notes))]
    if local.n_layers > BY_PARAMETER_MAX_LAYERS:
        raise NotImplementedError(
            f"zero_partition='by-parameter' replays every layer once per dp rank (the partition "
            f"is not the same in every layer); {local.n_layers} layers is beyond "
            f"{BY_PARAMETER_MAX_LAYERS}: use zero_partition='shard' (states 1/dp per parameter)"
        )
    numels = param_numels(local) if trainable_numels is None else list(trainable_numels)
    parts = zero_redundancy_partition(numels, parallel.dp)
    out = []
    for d, part in enumerate(parts):
        ranks = tuple(
            global_rank(parallel, dp=d, pp=p, cp=c, tp=t)
            for p in range(parallel.pp)
            for c in range(parallel.cp)
            for t in range(parallel.tp)
        )
        owned = sum(numels[i] for i in part)
        out.append(
            RankClass(
                ranks, f"dp rank {d}", local, replace(plan, optimizer_params=tuple(part)), ddp,
                (*notes, f"ZeRO-1 (ZeroRedundancyOptimizer): dp rank {d} holds the optimizer "
                 f"states of {len(part)} parameters, {owned} elements"),
            )
        )  # fmt: skip
    return out


def param_numels(model: ModelSpec) -> list[int]:
    """Elements of every parameter in ``model.parameters()`` order (layers expanded)."""
    tensors = model.param_tensors()
    out: list[int] = []
    layer = [int(t.numel) for t in tensors if t.group == "layer"]
    placed = False
    for t in tensors:
        if t.group == "layer":
            if not placed:
                out.extend(layer * model.n_layers)
                placed = True
            continue
        out.append(int(t.numel))
    return out


def _fsdp_notes(parallel: Parallelism) -> list[str]:
    """The notes of an FSDP rank: the mixed-precision policy and the wrapping."""
    notes: list[str] = []
    v1 = parallel.fsdp_version == 1
    if parallel.fsdp_param_dtype != "none":
        reduce = parallel.fsdp_reduce_dtype if parallel.fsdp_reduce_dtype != "none" else "bf16"
        policy = "FSDP1 MixedPrecision" if v1 else "FSDP2 MixedPrecisionPolicy"
        notes.append(
            f"{policy}(param_dtype={parallel.fsdp_param_dtype}, "
            f"reduce_dtype={reduce}): fp32 shards, gradients and optimizer states"
        )
    if parallel.fsdp_output_dtype != "none":
        notes.append(
            f"FSDP2 MixedPrecisionPolicy(output_dtype={parallel.fsdp_output_dtype}) on the root: "
            "the model's floating-point outputs cast (recorded from fully_shard)"
        )
    if v1:
        strategy = "FULL_SHARD" if parallel.reshard_after_forward else "SHARD_GRAD_OP"
        notes.append(
            f"FSDP1 FullyShardedDataParallel over {parallel.dp} ranks: one flat parameter per "
            f"decoder layer and one for the rest, {strategy}, use_orig_params="
            f"{parallel.fsdp_use_orig_params}"
        )
    elif parallel.dp_replicate > 1:
        notes.append(
            f"HSDP: FSDP2 per layer and root, each parameter sharded over "
            f"{parallel.shard_world} ranks and replicated over {parallel.dp_replicate} groups "
            f"(gradient shards all-reduced), reshard_after_forward="
            f"{parallel.reshard_after_forward}"
        )
    else:
        notes.append(
            f"FSDP2 per layer and root over {parallel.dp} ranks, reshard_after_forward="
            f"{parallel.reshard_after_forward}; ranks holding smaller (unpadded) shards may "
            "peak lower"
        )
    return notes
