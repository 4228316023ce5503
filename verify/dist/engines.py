"""Engines of the data-parallel cases: how each rank wraps the model on torch.distributed.

* ``replicas``: no wrapper, no communication (a control: every rank is a single-GPU run);
* ``ddp``: ``DistributedDataParallel`` (``bucket_cap_mb``, ``gradient_as_bucket_view`` from the
  case's `calc.Parallelism`); torchtitan's models under torch's composable ``replicate``, as
  its ``apply_ddp`` wraps them;
* ``zero1``: DDP plus ``torch.distributed.optim.ZeroRedundancyOptimizer`` (optimizer states
  sharded over ranks: ZeRO stage 1);
* ``fsdp2``: ``fully_shard`` on every layer, then on the root (ZeRO-3 sharding), with
  ``reshard_after_forward`` and the ``MixedPrecisionPolicy`` (``fsdp_param_dtype``,
  ``fsdp_reduce_dtype``) from the case; with ``dp_replicate > 1`` over one 2-D mesh
  ``(dp_replicate, dp_shard)`` (HSDP), built outside the tracker as torchtitan builds its
  meshes before the model;
* ``fsdp1``: ``FullyShardedDataParallel`` with a ``ModuleWrapPolicy`` of the decoder layer
  class (flat parameters), ``FULL_SHARD`` or ``SHARD_GRAD_OP``, ``MixedPrecision`` and
  ``use_orig_params`` from the case; LitGPT's model as Lightning's ``FSDPStrategy`` wraps it
  (`_litgpt_fsdp`: blocks checkpointed after the wrapping, ``no_sync`` while accumulating);
* ``hf-native``: transformers' own ``DistributedConfig(tp_size=tp)`` (with
  ``expert_parallel``: ``ep_size=tp``, ``ep_implementation="all_reduce"``) applied to the
  Hugging Face model by ``prepare_distribute_model`` and ``maybe_distribute_model``.

Each builder runs inside the rank's tracker, so what the wrapper allocates at construction
counts (DDP's buckets are allocated in C++ then).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from verify.cases.case import DistCase
from verify.dist.engine import Built, RankContext, built_from, case_model, device_mesh
from verify.models import litgpt_llama, loops
from verify.models.build import LEARNING_RATE, SGD_MOMENTUM, build_optimizer, impl_kwargs


def replicas(case: DistCase, spec: Any, ctx: RankContext) -> Built:
    """The unwrapped model on every rank."""
    model, loss_fn = case_model(case, spec, ctx)
    return built_from(model, loss_fn, build_optimizer(model, case.job, device=ctx.device))


def _ddp(case: DistCase, model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    par = case.parallel
    return DDP(
        model,
        bucket_cap_mb=par.ddp_bucket_mib,  # None: torch's default (1 MiB first bucket, 25 MiB)
        gradient_as_bucket_view=par.gradient_as_bucket_view,
    )


def _call(wrapped: torch.nn.Module, case: DistCase, model: torch.nn.Module) -> Any:
    """The rank's ``(ids, targets) -> loss`` through ``wrapped``: the model's own loss, or the
    job's loop (`verify.models.loops.Loop`, Hugging Face models only: the reference model's
    loops call its submodules, around the wrapper)."""
    if not loops.is_default(case.job):
        if case.impl != "hf":
            raise ValueError(f"{case.name}: another loop or loss runs on implementation='hf'")
        return loops.Loop(model, case.job, call=wrapped)
    if case.impl == "hf":
        return lambda ids, targets: wrapped(input_ids=ids, labels=targets).loss
    return lambda ids, targets: wrapped(ids, targets)


def ddp(case: DistCase, spec: Any, ctx: RankContext) -> Built:
    """``DistributedDataParallel`` around the model; the optimizer over its parameters.
    torchtitan's models as its ``apply_ddp`` replicates them (`_replicate`)."""
    model, loss_fn = case_model(case, spec, ctx)
    if case.impl == "torchtitan":
        _replicate(case, model)
        return built_from(model, loss_fn, build_optimizer(model, case.job, device=ctx.device))
    wrapped = _ddp(case, model)
    bundle = build_optimizer(model, case.job, device=ctx.device)
    return built_from(wrapped, _call(wrapped, case, model), bundle)


TITAN_BUCKET_MIB = 100
"""torchtitan 0.2.2's ``apply_ddp`` (models/llama3/infra/parallelize.py):
``replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)``."""


def _replicate(case: DistCase, model: torch.nn.Module) -> None:
    """torchtitan's ``apply_ddp``: the composable ``replicate`` in place, over the 1-D
    ``dp_replicate`` mesh (built outside the tracker, as torchtitan builds its meshes before the
    model; a GPU run keeps the mesh's rank tensor on the host). torch 2.13's ``replicate``
    (distributed/_composable/replicate.py) builds ``DistributedDataParallel`` over a
    ``ParameterList`` of the model's parameters in its first forward pre-hook: the broadcast of
    the parameters and the buckets come in step 1's forward. The case's ``ddp_bucket_mib``, if
    set, replaces torchtitan's 100 (to exercise several buckets on a small model)."""
    from torch.distributed._composable.replicate import replicate

    par = case.parallel
    if par.gradient_as_bucket_view:
        raise ValueError(f"{case.name}: torchtitan's apply_ddp keeps gradient_as_bucket_view=False")
    mesh = device_mesh((torch.distributed.get_world_size(),), ("dp_replicate",))
    cap = TITAN_BUCKET_MIB if par.ddp_bucket_mib is None else par.ddp_bucket_mib
    replicate(model, device_mesh=mesh, bucket_cap_mb=cap)


_OPTIM_CLASSES = {
    "adamw": (torch.optim.AdamW, {}),
    "adam": (torch.optim.Adam, {}),
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": SGD_MOMENTUM}),
}


def zero1(case: DistCase, spec: Any, ctx: RankContext) -> Built:
    """DDP plus ``ZeroRedundancyOptimizer``: each rank keeps the states of its parameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    job = case.job
    if job.optimizer not in _OPTIM_CLASSES or job.precision in ("amp-fp16", "bf16-master"):
        raise ValueError(f"zero1 engine: optimizer={job.optimizer}, precision={job.precision}")
    model, _ = case_model(case, spec, ctx)
    wrapped = _ddp(case, model)
    cls, extra = _OPTIM_CLASSES[job.optimizer]
    opt = ZeroRedundancyOptimizer(
        [p for p in model.parameters() if p.requires_grad],  # LoRA: the adapters only
        optimizer_class=cls,
        **extra,
        lr=LEARNING_RATE,
        weight_decay=job.weight_decay,
        **impl_kwargs(job.optimizer_impl),
    )
    return Built(
        model=wrapped,
        loss_fn=_call(wrapped, case, model),
        optimizer=opt,
        step=opt.step,
        zero_grad=lambda: opt.zero_grad(set_to_none=True),
    )


_MP_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def mp_policy(case: DistCase) -> dict[str, Any]:
    """``mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs)`` from
    the case's ``fsdp_*`` fields (no policy when neither ``fsdp_param_dtype`` nor
    ``fsdp_output_dtype`` is set; the root adds ``output_dtype``)."""
    par = case.parallel
    if par.fsdp_param_dtype == "none" and par.fsdp_output_dtype == "none":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(
        param_dtype=_MP_DTYPES.get(par.fsdp_param_dtype),
        reduce_dtype=_MP_DTYPES.get(par.fsdp_reduce_dtype),
        cast_forward_inputs=par.fsdp_cast_forward_inputs,
    )
    return {"mp_policy": policy}


def fsdp2(case: DistCase, spec: Any, ctx: RankContext) -> Built:
    """``fully_shard`` on each layer and on the root; the optimizer over the DTensor shards.
    torchtitan's models as its ``apply_fsdp`` (torchtitan 0.2.2, models/llama3/infra/
    parallelize.py) wraps them: the embedding, each block, then ``[norm, output]`` with
    ``reshard_after_forward=False``, then the root (``disable_fsdp_gradient_division`` is left
    out: it changes the reduce-scatter's scaling, not its buffers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, loss_fn = case_model(case, spec, ctx)
    reshard = case.parallel.reshard_after_forward
    kw = {"reshard_after_forward": reshard, **mp_policy(case)}
    layers = getattr(model, "blocks", None) or getattr(model, "layers", None) or model.model.layers
    titan = case.impl == "torchtitan"
    mesh = ctx.mesh
    replicas = case.parallel.dp_replicate
    if replicas > 1:  # HSDP: one 2-D mesh (replicate, shard) made before the model
        shape = (replicas, torch.distributed.get_world_size() // replicas)
        two = device_mesh(shape, ("dp_replicate", "dp_shard"))
        mesh = lambda: two  # noqa: E731
    elif titan:  # torchtitan's apply_fsdp over its one dp mesh (ParallelDims.build_mesh)
        one = ctx.mesh() or init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        mesh = lambda: one  # noqa: E731
    if titan:
        fully_shard(model.tok_embeddings, mesh=mesh(), **kw)  # the embedding, its own unit
        layers = layers.values()
    for layer in layers:
        fully_shard(layer, mesh=mesh(), **kw)
    if titan:  # [norm, output] one unit, kept unsharded after forward (its "default" policy)
        fully_shard([model.norm, model.output], mesh=mesh(),
                    **{**kw, "reshard_after_forward": False})  # fmt: skip
    if case.parallel.fsdp_output_dtype != "none":  # the root's outputs only
        policy = replace(kw["mp_policy"], output_dtype=_MP_DTYPES[case.parallel.fsdp_output_dtype])
        kw = {**kw, "mp_policy": policy}
    fully_shard(model, mesh=mesh(), **kw)
    bundle = build_optimizer(model, case.job, device=ctx.device)
    # torchtune's recipe loss and torchtitan's loss step call the model itself, which
    # fully_shard wrapped in place
    call = loss_fn if case.impl in ("torchtune", "torchtitan") else _call(model, case, model)
    return built_from(model, call, bundle)


def fsdp1(case: DistCase, spec: Any, ctx: RankContext) -> Built:
    """FSDP1 around the Hugging Face model: every decoder layer its own flat parameter
    (``ModuleWrapPolicy``), the rest the root's; the optimizer over the wrapper's parameters
    (flat parameters, or the original ones with ``use_orig_params``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if case.impl == "litgpt":
        return _litgpt_fsdp(case, spec, ctx)
    if case.impl != "hf":
        raise ValueError(f"{case.name}: the fsdp1 engine wraps Hugging Face and LitGPT models")
    par = case.parallel
    model, _ = case_model(case, spec, ctx)
    mixed = None
    if par.fsdp_param_dtype != "none":
        mixed = MixedPrecision(
            param_dtype=_MP_DTYPES[par.fsdp_param_dtype],
            reduce_dtype=_MP_DTYPES.get(par.fsdp_reduce_dtype),
            cast_forward_inputs=par.fsdp_cast_forward_inputs,
        )
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
        sharding_strategy=ShardingStrategy.FULL_SHARD
        if par.reshard_after_forward
        else ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=mixed,
        device_id=torch.device(ctx.device),
        use_orig_params=par.fsdp_use_orig_params,
    )
    bundle = build_optimizer(wrapped, case.job, device=ctx.device)
    return built_from(wrapped, _call(wrapped, case, wrapped), bundle)


def _litgpt_fsdp(case: DistCase, spec: Any, ctx: RankContext) -> Built:
    """LitGPT's ``finetune/full.py`` on several devices: Lightning's ``FSDPStrategy(
    auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, limit_all_gathers=True,
    cpu_offload=False)`` (lightning 2.5 ``fabric/strategies/fsdp.py``: ``use_orig_params=True``
    by default; ``FSDPPrecision``'s ``MixedPrecision`` with param, reduce and buffer dtypes all
    the model's, ``bf16-true`` or ``32-true``), the blocks checkpointed after the wrapping when
    the job recomputes, and ``fabric.no_backward_sync`` (``no_sync``) on every micro-batch but
    the last of a step. FSDP's lazy initialisation (the first forward, litgpt's sanity-check
    validation in ``fit``: it casts the RoPE tables, buffers, to the buffer dtype) runs here,
    before the measured steps."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp._runtime_utils import _lazy_init
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    job = case.job
    model, _ = case_model(replace(case, job=replace(job, recompute="none")), spec, ctx)
    dtype = next(model.parameters()).dtype
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({litgpt_llama.Block}),
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype),
        device_id=torch.device(ctx.device),
        use_orig_params=True,
        limit_all_gathers=True,
    )
    if job.recompute == "full":
        litgpt_llama.checkpoint_blocks(wrapped)
    _lazy_init(wrapped, wrapped)
    bundle = build_optimizer(wrapped, job, device=ctx.device)
    done = [0]

    def backward(loss: torch.Tensor) -> None:
        done[0] += 1
        if done[0] % job.grad_accum:  # accumulating: Lightning's no_backward_sync
            with wrapped.no_sync():
                loss.backward()
        else:
            loss.backward()

    built = built_from(wrapped, litgpt_llama.FineTuneLoss(wrapped, job.grad_accum), bundle)
    built.backward = backward
    return built


def hf_native(case: DistCase, spec: Any, ctx: RankContext) -> Built:
    """transformers' own tensor (and expert) parallelism: the model's ``base_model_tp_plan``
    (and ``base_model_ep_plan``) over every rank; the device meshes built outside the tracker
    (a GPU run keeps their rank tensors on the host)."""
    from torch.utils._python_dispatch import _disable_current_modes
    from transformers.distributed import DistributedConfig

    if case.impl != "hf":
        raise ValueError(f"{case.name}: the hf-native engine parallelizes Hugging Face models")
    par = case.parallel
    kwargs: dict[str, Any] = {"tp_size": par.tp}
    if par.expert_parallel:
        kwargs.update(ep_size=par.tp, ep_implementation="all_reduce")
    model, _ = case_model(case, spec, ctx)
    with _disable_current_modes():
        config, _, mesh = type(model).prepare_distribute_model(DistributedConfig(**kwargs))
    model = type(model).maybe_distribute_model(model, config, mesh)
    bundle = build_optimizer(model, case.job, device=ctx.device)
    return built_from(model, _call(model, case, model), bundle)
