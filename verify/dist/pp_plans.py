"""Pipeline parallelism of verify's reference model with ``torch.distributed.pipelining``.

Each rank keeps one stage of a `verify.models.reference.ReferenceLM` (llama family): the first
stage the embedding and the first layers, the last stage the last layers, the final norm, the
head and the loss; layers are split as `calc.config.parallelism.layers_per_stage` says (the first stages
take the extra ones). A stage is a `StageModule` around the rank's modules (the others are
deleted, so a rank holds only its parameters), wrapped in ``PipelineStage`` and driven by
``ScheduleGPipe`` or ``Schedule1F1B`` (``pp_schedule``), ``pp_microbatches`` micro-batches per
step, each ``micro_batch / pp_microbatches`` sequences. Runs on gloo (CPU) with one stage per
rank, or, for ``interleaved-1f1b``, ``pp_virtual_stages`` stages per rank in the loop placement
(rank ``r`` runs stages ``r, r + pp, ...``; layers split evenly over all ``pp * v`` stages,
the first ones taking the extra) driven by ``ScheduleInterleaved1F1B``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from calc.config.model_spec import ModelSpec
from calc.config.parallelism import layers_per_stage
from verify.cases.case import DistCase
from verify.dist.engine import Built, RankContext, built_from, case_model, device_mesh
from verify.dist.tp_plans import parallelize_blocks
from verify.models.build import WEIGHT_DTYPE, build_optimizer
from verify.models.reference import ReferenceLM
from verify.run.step import AUTOCAST_DTYPE


class StageModule(nn.Module):
    """The part of a `ReferenceLM` one pipeline stage runs: ``ids -> hidden`` (first stage),
    ``hidden -> hidden`` (middle) or ``hidden -> logits`` (last)."""

    def __init__(self, model: ReferenceLM, first: int, stop: int, *, is_first: bool,
                 is_last: bool, autocast: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        self.full_recompute = model.recompute == "full"  # selective lives inside the blocks
        self.autocast = autocast
        if model.spec.model_type == "gpt2":
            raise ValueError("pipeline stages are planned for the llama family only")
        self.embed_tokens = model.embed_tokens if is_first else None
        self.layers = nn.ModuleList(model.layers[first:stop])
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.register_buffer("cos", model.cos, persistent=False)
        self.register_buffer("sin", model.sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's part of the model, under ``torch.autocast`` when the job is ``amp-*``
        (left before the schedule calls the loss), each layer checkpointed (non-reentrant)
        under ``recompute="full"``."""
        amp = self.autocast is not None
        ctx = torch.autocast(x.device.type, dtype=self.autocast) if amp else nullcontext()
        with ctx:
            if self.embed_tokens is not None:
                x = self.embed_tokens(x)
            rope = (self.cos, self.sin)
            for block in self.layers:
                if self.full_recompute and self.training:
                    x = checkpoint(block, x, rope, use_reentrant=False)
                else:
                    x = block(x, rope)
            if self.norm is not None:
                x = F.linear(self.norm(x), self.lm_head.weight)
        return x


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: ``F.cross_entropy`` over the flattened micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _static_meta(case: DistCase, spec: ModelSpec, stage: int, last: int) -> dict[str, Any]:
    """``input_args`` / ``output_args`` of a stage wrapped in DDP, as meta tensors.

    Without them torch 2.13's ``PipelineStage`` infers the shapes with a real forward through
    the DDP wrapper outside ``no_sync``: DDP's ``_post_forward`` then arms its autograd hooks
    (``prepare_for_backward``) and the first ``no_sync`` backward records every parameter
    again, so the next bucket rebuild fails (``reducer.cpp``: "rebuilt parameter indices size
    is not same as original model parameters size"; seen with GPipe and with 1F1B when two
    backwards follow each other). Given shapes, the stage skips that inference."""
    job = case.job
    rows = job.micro_batch // case.parallel.pp_microbatches
    act = WEIGHT_DTYPE[job.precision]  # the residual stream stays in the weights' dtype
    meta = torch.device("meta")
    hidden = torch.empty(rows, job.seq_len, spec.hidden, dtype=act, device=meta)
    ids = torch.empty(rows, job.seq_len, dtype=torch.int64, device=meta)
    logits_dtype = _autocast_dtype(case) or act
    logits = torch.empty(rows, job.seq_len, spec.vocab, dtype=logits_dtype, device=meta)
    out: dict[str, Any] = {
        "input_args": (ids if stage == 0 else hidden,),
        "output_args": (logits if stage == last else hidden,),
    }
    if stage != last:  # the gradient received from the next stage
        out["output_grads"] = (hidden,)
    if stage != 0:  # the gradient sent back to the previous stage
        out["input_grads"] = (hidden,)
    return out


def _autocast_dtype(case: DistCase) -> torch.dtype | None:
    """The dtype the job's stages autocast to (``amp-bf16``), else None."""
    return AUTOCAST_DTYPE.get(case.job.precision)


def _no_loss(ids: torch.Tensor, targets: torch.Tensor) -> None:
    """A pipeline rank has no loss call of its own: its schedule's ``step`` runs the micro-batch."""


def _untied_model(case: DistCase, spec: ModelSpec, ctx: RankContext) -> ReferenceLM:
    """The case's whole model (every stage is cut from it), which must have an untied head."""
    if spec.tied_embeddings:
        raise ValueError("pp engine: a tied head is not planned (untied models only)")
    model, _ = case_model(case, spec, ctx)
    return model


def pp_engine(case: DistCase, spec: ModelSpec, ctx: RankContext) -> Built:
    """``pp``: one stage per rank, ``ScheduleGPipe`` / ``Schedule1F1B``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    par = case.parallel
    if par.pp_schedule == "interleaved-1f1b":
        return _interleaved_engine(case, spec, ctx)
    if par.dp * par.pp * par.tp != ctx.world or par.pp_virtual_stages != 1 or par.cp != 1:
        raise ValueError(f"pp engine: one stage per pp rank (pp={par.pp}, tp={par.tp})")
    if par.dp > 1 and par.tp > 1:
        raise ValueError("pp engine: dp and tp together are not planned")
    model = _untied_model(case, spec, ctx)
    counts = layers_per_stage(spec.n_layers, par)
    r, last = (ctx.rank // par.tp) % par.pp, par.pp - 1  # mesh [dp, pp, tp], tp innermost
    start = sum(counts[:r])
    stage_mod = StageModule(model, start, start + counts[r], is_first=r == 0, is_last=r == last,
                            autocast=_autocast_dtype(case))
    del model
    group = None
    submod: nn.Module = stage_mod
    if par.tp > 1:  # a 2-D mesh: Megatron splits inside each stage, stages over pp
        mesh = device_mesh((par.pp, par.tp), ("pp", "tp"))
        parallelize_blocks(stage_mod.layers, mesh["tp"])
        group = mesh["pp"].get_group()
    elif par.dp > 1:  # a 2-D mesh: each stage replicated over dp by DDP, stages over pp
        from torch.nn.parallel import DistributedDataParallel as DDP

        mesh = device_mesh((par.dp, par.pp), ("dp", "pp"))
        group = mesh["pp"].get_group()
        submod = DDP(stage_mod, process_group=mesh["dp"].get_group(),
                     bucket_cap_mb=par.ddp_bucket_mib)  # fmt: skip
    static = _static_meta(case, spec, r, last) if par.dp > 1 else {}
    stage = PipelineStage(submod, r, par.pp, torch.device(ctx.device), group=group, **static)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(par.pp_schedule)
    if cls is None:
        raise ValueError(f"pp engine: pp_schedule={par.pp_schedule!r} is not planned")
    schedule = cls(stage, n_microbatches=par.pp_microbatches, loss_fn=pipeline_loss)
    bundle = build_optimizer(stage_mod, case.job, device=ctx.device)

    def train_step(ids: torch.Tensor, targets: torch.Tensor) -> None:
        if r == 0:
            schedule.step(ids)
        elif r == last:
            schedule.step(target=targets)
        else:
            schedule.step()

    return built_from(stage_mod, _no_loss, bundle, train_step=train_step)


def _interleaved_engine(case: DistCase, spec: ModelSpec, ctx: RankContext) -> Built:
    """``pp`` with ``interleaved-1f1b``: ``pp_virtual_stages`` `StageModule` chunks per rank
    (loop placement), one ``PipelineStage`` each, ``ScheduleInterleaved1F1B``."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    par = case.parallel
    if par.pp != ctx.world or par.tp * par.dp * par.cp != 1:
        raise ValueError(f"pp engine (interleaved): pp only, one rank per pp rank (pp={par.pp})")
    model = _untied_model(case, spec, ctx)
    n_stages = par.pp * par.pp_virtual_stages
    base, extra = divmod(spec.n_layers, n_stages)
    counts = [base + (1 if i < extra else 0) for i in range(n_stages)]
    r = ctx.rank
    ids = [r + k * par.pp for k in range(par.pp_virtual_stages)]
    chunks = []
    for i in ids:
        start = sum(counts[:i])
        chunks.append(StageModule(model, start, start + counts[i], is_first=i == 0,
                                  is_last=i == n_stages - 1, autocast=_autocast_dtype(case)))  # fmt: skip
    del model
    holder = nn.ModuleList(chunks)  # the rank's parameters, for the optimizer and attribution
    stages = [
        PipelineStage(c, i, n_stages, torch.device(ctx.device))
        for c, i in zip(chunks, ids, strict=True)
    ]
    schedule = ScheduleInterleaved1F1B(
        stages, n_microbatches=par.pp_microbatches, loss_fn=pipeline_loss
    )
    bundle = build_optimizer(holder, case.job, device=ctx.device)
    first, last = 0 in ids, n_stages - 1 in ids

    def train_step(ids_: torch.Tensor, targets: torch.Tensor) -> None:
        args = (ids_,) if first else ()
        kwargs = {"target": targets} if last else {}
        schedule.step(*args, **kwargs)

    return built_from(holder, _no_loss, bundle, train_step=train_step)

