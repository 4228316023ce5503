"""Pipeline parallelism's estimate: one compiled replay per stage (`calc.step.pipeline`),
evaluated at the micro-batch's size; `calc.estimate.ranks` takes the most-loaded stage."""

from __future__ import annotations

from collections.abc import Callable

from calc.config.jobs import Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.estimate.core import Compiled, ReplayOptions, StructureKey, compiled_for, evaluate
from calc.estimate.result import Estimate
from calc.parallel.data import ReplayPlan
from calc.parallel.layout import RankClass, global_rank
from calc.parallel.tensor import rank_model
from calc.step.pipeline import in_flight, microbatch_job, stage_plans

Extras = Callable[[Compiled, StructureKey, ModelSpec, Training], tuple[tuple, tuple[str, ...]]]
"""``(compiled stage, key, stage model, micro-batch job) -> (extras, notes)``: the constant
storages outside a stage's replay (DDP's gradient buckets, `calc.estimate.ranks`)."""


def stage_results(
    model: ModelSpec, job: Training, parallel: Parallelism, device: str,
    ddp_extras: Extras | None = None,
) -> list[tuple[RankClass, Estimate]]:  # fmt: skip
    """``[(RankClass, Estimate)]``, one per pipeline stage: each stage's replay compiled and
    evaluated at the micro-batch's size (`calc.estimate.ranks` takes the most-loaded one).

    With ``dp > 1`` every stage is wrapped in ``DistributedDataParallel`` over its dp group
    (``PipelineStage`` runs all but the last backward under ``no_sync`` and the last one with
    ``prepare_for_backward``: torch 2.13 ``backward_maybe_with_nosync``): the stage's replay
    plus DDP's gradient buckets, sized by ``ddp_extras``. Pipeline parallelism with cp, sp,
    vocab_parallel, ZeRO/FSDP, offload or bucket-view gradients is not modelled yet
    (``NotImplementedError``)."""
    if parallel.cp > 1 or parallel.sp or parallel.vocab_parallel:
        raise NotImplementedError("pipeline parallelism combined with cp, sp or vocab_parallel")
    if parallel.shard_level or parallel.offload != "none":
        raise NotImplementedError(
            "pipeline parallelism with ZeRO/FSDP or offload (with dp > 1 each stage is DDP)"
        )
    if parallel.dp > 1 and parallel.gradient_as_bucket_view:
        raise NotImplementedError(
            "pipeline parallelism with DDP gradient_as_bucket_view=True (the micro-batches' "
            "no_sync backwards accumulate outside the buckets)"
        )
    if parallel.dp > 1 and (parallel.tp > 1 or parallel.pp_schedule == "interleaved-1f1b"):
        raise NotImplementedError(
            "pipeline parallelism with dp > 1 is modelled for GPipe and 1F1B without tensor "
            "parallelism (one DDP stage per rank)"
        )
    if parallel.dp > 1 and ddp_extras is None:
        raise ValueError("stage_results: dp > 1 needs ddp_extras (the DDP buckets)")
    plans = stage_plans(model, job, parallel)  # checks the layout first (check_pipeline)
    mb_job = microbatch_job(job, parallel)
    tp_model = rank_model(model, parallel)  # the model itself when tp == 1
    interleaved = parallel.pp_schedule == "interleaved-1f1b"
    if interleaved and parallel.tp > 1:
        raise NotImplementedError("interleaved 1F1B combined with tensor parallelism")
    out = []
    for plan in plans:
        local = tp_model.with_overrides(n_layers=plan.n_layers)
        # interleaved: the chunks' layers differ, so every layer is replayed
        opts = ReplayOptions(tp_comm=parallel.tp > 1, exact_layers=interleaved, stage=plan)
        comp, key = compiled_for(local, mb_job, device, opts)
        role = "embedding" if plan.first else "loss" if plan.last else "middle"
        note = (
            f"pipeline stage {plan.stage} ({role}): {plan.n_layers} layers, "
            f"{plan.schedule}"
            + (
                f" ({plan.virtual} chunks: stages "
                f"{', '.join(str(plan.chunk_index(k)) for k in range(plan.virtual))})"
                if plan.virtual > 1
                else ""
            )
            + f", {plan.microbatches} micro-batches of "
            f"{mb_job.micro_batch}, at most {in_flight(plan)} "
            + ("chunk micro-batches " if plan.virtual > 1 else "")
            + "in flight"
        )
        ranks = tuple(
            global_rank(parallel, dp=d, pp=plan.stage, tp=t)
            for d in range(parallel.dp)
            for t in range(parallel.tp)
        )
        ddp = parallel.dp > 1
        extras, notes = ddp_extras(comp, key, local, mb_job) if ddp_extras and ddp else ((), ())
        rc = RankClass(ranks, f"pp stage {plan.stage}", local, ReplayPlan(), ddp, (note,))
        out.append((rc, evaluate(comp, key, local, mb_job, device, extras, (note, *notes))))
    return out
