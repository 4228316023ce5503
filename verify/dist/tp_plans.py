"""Tensor (and sequence) parallel plans for verify's reference model, on the real engine.

`tensor_parallel` applies ``torch.distributed.tensor.parallel.parallelize_module`` to a
`verify.models.reference.ReferenceLM` (llama-family: separate q/k/v, SwiGLU) over a 1-D
``DeviceMesh``, the way torchtitan's ``parallelize_llama`` does (Megatron-LM's split,
Shoeybi et al. 2019, Section 3):

* attention: ``q_proj``/``k_proj``/``v_proj`` column-parallel (heads and kv heads split over
  ``tp``), ``o_proj`` row-parallel (its output all-reduced, or reduce-scattered over the
  sequence under sequence parallelism);
* MLP: ``gate_proj``/``up_proj`` column-parallel (ffn split), ``down_proj`` row-parallel;
* sequence parallelism (Korthikanti et al. 2022): the norms run on ``Shard(1)`` (sequence)
  DTensors (``SequenceParallel``); the attention and MLP inputs are all-gathered
  (``PrepareModuleInput``); the residual stream is a local ``[b, s/tp, h]`` tensor;
* the embedding stays replicated (every rank holds the whole table) and so does the head,
  unless ``vocab_parallel``: embedding row-parallel over the vocabulary, head column-parallel
  with a vocabulary-sharded loss (``loss_parallel``).

After the plan, each attention module's ``spec`` is replaced by the per-rank one (heads and kv
heads divided by ``tp``): the model's ``view(b, s, heads, head_dim)`` then sees the local heads.
`TensorParallelLM` is the loss function of a parallelized model: it calls the head as a module
(so the plan's hooks run), where ``ReferenceLM.forward`` calls ``F.linear`` on its weight.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from verify.cases.case import DistCase
from verify.dist.engine import Built, RankContext, built_from, case_model, device_mesh
from verify.dist.engines import mp_policy
from verify.models.build import build_optimizer
from verify.models.reference import ReferenceLM

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from calc.config.model_spec import ModelSpec


def check_supported(model: ReferenceLM, tp: int) -> None:
    """Raise ``ValueError`` when the plan does not cover this model or ``tp`` does not divide."""
    spec = model.spec
    if spec.model_type == "gpt2":
        raise ValueError(
            "tensor_parallel: gpt2's fused c_attn has no plan here (llama family only)"
        )
    if spec.tied_embeddings:
        raise ValueError("tensor_parallel: a tied head is not planned (untied models only)")
    for field, value in (("n_heads", spec.n_heads), ("n_kv_heads", spec.n_kv_heads),
                         ("ffn", spec.ffn)):  # fmt: skip
        if value % tp:
            raise ValueError(f"tensor_parallel: tp={tp} must divide {field}={value}")


def tensor_parallel(
    model: ReferenceLM,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
) -> None:
    """Parallelize ``model`` in place over the 1-D ``mesh`` (module docstring)."""
    tp = mesh.size()
    check_supported(model, tp)
    sp = sequence_parallel
    top: dict = {}
    if vocab_parallel:
        top["embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()
        )
    elif sp:  # a replicated table: its output is sliced to the local sequence (no comm)
        top["embed_tokens"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1)
        )
    if sp:
        top["norm"] = SequenceParallel()
    top["lm_head"] = ColwiseParallel(
        input_layouts=Shard(1) if sp else Replicate(),
        output_layouts=Shard(-1) if vocab_parallel else Replicate(),
        use_local_output=not vocab_parallel,
    )
    if not vocab_parallel and not sp:
        del top["lm_head"]  # replicated head: a plain nn.Linear on every rank
    if top:
        parallelize_module(model, mesh, top)
    parallelize_blocks(model.layers, mesh, sequence_parallel=sp)


def parallelize_blocks(
    blocks: torch.nn.ModuleList, mesh: DeviceMesh, *, sequence_parallel: bool = False
) -> None:
    """The per-layer part of `tensor_parallel` (also used on a pipeline stage's layers)."""
    tp = mesh.size()
    sp = sequence_parallel
    for block in blocks:
        plan: dict = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if sp:
            plan["input_layernorm"] = SequenceParallel()
            plan["post_attention_layernorm"] = SequenceParallel()
            plan["self_attn"] = PrepareModuleInput(
                input_layouts=(Shard(1), None),
                desired_input_layouts=(Replicate(), None),
                use_local_output=True,
            )
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_output=True,
            )  # fmt: skip
        parallelize_module(block, mesh, plan)
        attn = block.self_attn
        attn.spec = attn.spec.with_overrides(
            n_heads=attn.spec.n_heads // tp, n_kv_heads=attn.spec.n_kv_heads // tp
        )


class TensorParallelLM:
    """``(ids, targets) -> loss`` of a parallelized `ReferenceLM`: the head as a module call.

    With ``vocab_parallel`` the logits are a vocabulary-sharded DTensor and the cross entropy
    runs under ``loss_parallel()`` (its backward too: call `backward_context` around it)."""

    def __init__(self, model: ReferenceLM, *, vocab_parallel: bool) -> None:
        self.model = model
        self.vocab_parallel = vocab_parallel

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self.model.hidden_states(ids))
        with self.backward_context():
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def backward_context(self) -> contextlib.AbstractContextManager:
        """``loss_parallel()`` for a vocabulary-sharded loss, else nothing."""
        return loss_parallel() if self.vocab_parallel else contextlib.nullcontext()


# ---------------------------------------------------------------------- engines


def tp_engine(case: DistCase, spec: ModelSpec, ctx: RankContext) -> Built:
    """``tp``: the reference model parallelized over all ranks (`tensor_parallel`); options
    ``sequence_parallel`` and ``vocab_parallel`` come from the case's `calc.Parallelism`."""
    par = case.parallel
    vocab = bool(getattr(par, "vocab_parallel", False))
    model, loss_fn = case_model(case, spec, ctx)
    mesh = device_mesh((par.tp,), ("tp",))
    tensor_parallel(model, mesh, sequence_parallel=par.sp, vocab_parallel=vocab)
    if par.sp or vocab or case.job.loop == "del-logits":
        fn = TensorParallelLM(model, vocab_parallel=vocab)
        loss_fn = fn
    built = built_from(model, loss_fn, build_optimizer(model, case.job, device=ctx.device))
    if vocab:
        built.backward = lambda loss: _backward_in(fn, loss)
    return built


class HeadCallLM(torch.nn.Module):
    """The root a 2-D run shards: a `ReferenceLM` whose forward calls its head as a module (the
    plan's hooks run) and returns the logits (torchtitan's ``Transformer.forward``), or the
    loss when given targets (the model's own cross-entropy, inside the root's forward)."""

    def __init__(self, model: ReferenceLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.model.lm_head(self.model.hidden_states(ids))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TitanLoop:
    """``(ids, targets) -> loss`` around a sharded `HeadCallLM` root, under ``loss_parallel()``
    when the head is vocabulary-sharded. ``loop="del-logits"`` is torchtitan's train step
    (``pred = model(inputs); loss = loss_fn(pred, labels); del pred``); the default loop calls
    the root with the targets (the loss inside its forward)."""

    def __init__(self, root: HeadCallLM, *, vocab_parallel: bool, del_logits: bool) -> None:
        self.root = root
        self.vocab_parallel = vocab_parallel
        self.del_logits = del_logits

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.backward_context():
            if not self.del_logits:
                return self.root(ids, targets)
            logits = self.root(ids)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            del logits
            return loss

    def backward_context(self) -> contextlib.AbstractContextManager:
        """``loss_parallel()`` for a vocabulary-sharded loss, else nothing."""
        return loss_parallel() if self.vocab_parallel else contextlib.nullcontext()


def fsdp_tp_engine(case: DistCase, spec: ModelSpec, ctx: RankContext) -> Built:
    """``fsdp-tp``: a 2-D ``[dp, tp]`` mesh (tp innermost, as `calc.config.parallelism.global_rank`):
    the tensor-parallel plan over ``tp`` (sequence parallel and vocabulary-parallel head as the
    case says), then FSDP2 ``fully_shard`` of every layer and the root over ``dp``, with the
    case's ``MixedPrecisionPolicy`` (torchtitan's 2-D order: TP first, then FSDP on the DTensor
    weights). With sequence parallelism, a vocabulary-parallel head or ``loop="del-logits"``
    the root is a `HeadCallLM` and the loop `TitanLoop`."""
    from torch.distributed.fsdp import fully_shard

    par = case.parallel
    model, loss_fn = case_model(case, spec, ctx)
    mesh = device_mesh((par.dp, par.tp), ("dp", "tp"))
    vocab = bool(par.vocab_parallel)
    tensor_parallel(model, mesh["tp"], sequence_parallel=par.sp, vocab_parallel=vocab)
    kw = {"reshard_after_forward": par.reshard_after_forward, **mp_policy(case)}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"], **kw)
    root: torch.nn.Module = model
    if par.sp or vocab or case.job.loop == "del-logits":
        root = HeadCallLM(model)
        loop = TitanLoop(root, vocab_parallel=vocab, del_logits=case.job.loop == "del-logits")
        loss_fn = loop
    fully_shard(root, mesh=mesh["dp"], **kw)
    built = built_from(root, loss_fn, build_optimizer(root, case.job, device=ctx.device))
    if vocab:
        built.backward = lambda loss: _backward_in(loop, loss)
    return built


def _backward_in(fn: TensorParallelLM | TitanLoop, loss: torch.Tensor) -> None:
    with fn.backward_context():
        loss.backward()
