"""Pipeline parallelism's estimate: one compiled replay per stage (`calc.step.pipeline`),
evaluated at the micro-batch's size; `calc.estimate.ranks` takes the most-loaded stage."""

from __future__ import annotations

from calc.config.jobs import Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.estimate.core import ReplayOptions, compiled_for, evaluate
from calc.estimate.result import Estimate
from calc.parallel.data import ReplayPlan
from calc.parallel.layout import RankClass, global_rank
from calc.parallel.tensor import rank_model
from calc.step.pipeline import in_flight, microbatch_job, stage_plans


def stage_results(
    model: ModelSpec, job: Training, parallel: Parallelism, device: str
) -> list[tuple[RankClass, Estimate]]:
    """``[(RankClass, Estimate)]``, one per pipeline stage: each stage's replay compiled and
    evaluated at the micro-batch's size (`calc.estimate.ranks` takes the most-loaded one).

    Pipeline parallelism combined with dp, tp or cp is not modelled yet
    (``NotImplementedError``)."""
    if parallel.dp > 1 or parallel.cp > 1 or parallel.sp or parallel.vocab_parallel:
        raise NotImplementedError("pipeline parallelism combined with dp, cp, sp or vocab_parallel")
    if parallel.shard_level or parallel.offload != "none":
        raise NotImplementedError("pipeline parallelism with ZeRO/FSDP or offload")
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
        ranks = tuple(global_rank(parallel, pp=plan.stage, tp=t) for t in range(parallel.tp))
        rc = RankClass(ranks, f"pp stage {plan.stage}", local, ReplayPlan(), False, (note,))
        out.append((rc, evaluate(comp, key, local, mb_job, device, (), (note,))))
    return out
