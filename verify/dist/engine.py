"""What an engine is: ``(case, spec, rank) -> Built``, the model a rank trains and its step.

An engine (`verify.dist.engines`, `verify.dist.tp_plans`, `verify.dist.pp_plans`; the registry
is `verify.dist.launch.ENGINES`) builds the case's model on its rank, wraps it for the layout
and builds the optimizer, all inside the rank's tracker. `case_model` and `built_from` are the
steps they share; `device_mesh` builds a ``DeviceMesh`` outside the tracker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from calc.config.model_spec import ModelSpec
from verify.cases.case import DistCase
from verify.cases.scale import with_dropout
from verify.models.build import OptBundle, build_model
from verify.run.step import micro_batches


@dataclass(slots=True)
class Built:
    """What a rank trains: the wrapped model, its loss and the optimizer step."""

    model: Any
    """The module whose parameters are the rank's (wrapped or not), for attribution."""
    loss_fn: Callable[[Any, Any], Any]
    """``(ids, targets) -> loss`` through the wrapper."""
    optimizer: Any
    """The torch optimizer holding the rank's states (for attribution)."""
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    scale: Callable[[Any], Any] = field(default=lambda loss: loss)
    backward: Callable[[Any], None] | None = None
    """``loss -> None`` replacing ``loss.backward()`` (e.g. under ``loss_parallel``)."""
    train_step: Callable[[Any, Any], None] | None = None
    """``(ids, targets) -> None`` replacing forward and backward of a micro-batch (a pipeline
    schedule's ``step``); marks ``forward`` only."""


@dataclass(frozen=True, slots=True)
class RankContext:
    """Where this process sits."""

    rank: int
    world: int
    device: str
    group: Any = None
    """The process group of the wrapper's device meshes, None: the default one (gloo). The
    profiled cases' is a ``fake`` group (`verify.dist.profiled`)."""

    def mesh(self) -> Any:
        """A new 1-D CPU ``DeviceMesh`` over `group` (as ``fully_shard`` makes one per call
        when given none), or None for the default group.

        ``fully_shard``'s own mesh (``init_device_mesh``) holds its ranks in a tensor made by
        ``arange``, which the tracker counts (512 B); ``DeviceMesh.from_group`` makes its
        tensor with ``torch.tensor``, a literal neither meter counts. The mesh keeps an
        ``arange`` of its ranks beside it, so that each mesh weighs what the default one does."""
        if self.group is None:
            return None
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(self.group, "cpu")
        mesh.vramplan_rank_tensor = torch.arange(self.group.size(), dtype=torch.int)
        return mesh


Engine = Callable[[DistCase, ModelSpec, RankContext], Built]
"""``(case, scaled spec, rank) -> Built``, called inside the tracker on every rank."""


def case_model(
    case: DistCase, spec: ModelSpec, ctx: RankContext
) -> tuple[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The case's model on this rank (the job's dropout, rotary tables for its sequence length)
    and its loss, before any wrapper."""
    spec = with_dropout(spec, case.job.dropout)
    model, loss_fn = build_model(spec, case.job, seed=case.seed, device=ctx.device)
    if hasattr(model, "set_rope") and not spec.learned_positions:
        model.set_rope(case.job.seq_len)
    return model, loss_fn


def built_from(
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    bundle: OptBundle,
    *,
    train_step: Callable[[Any, Any], None] | None = None,
) -> Built:
    """`Built` of ``model`` and its loss with the optimizer ``bundle`` of
    `verify.models.build.build_optimizer`."""
    return Built(
        model=model,
        loss_fn=loss_fn,
        optimizer=bundle.optimizer,
        step=bundle.step,
        zero_grad=bundle.zero_grad,
        scale=bundle.scale,
        train_step=train_step,
    )


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A CPU ``DeviceMesh``, built outside the tracker: its rank tensor lives on the host on
    every backend (on a GPU run it never counts in ``memory_allocated``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return init_device_mesh("cpu", shape, mesh_dim_names=names)


def run_step(
    step: int, built: Built, ids: torch.Tensor, targets: torch.Tensor, job: Any, meter: Any,
    device: str,
) -> None:  # fmt: skip
    """Optimizer step ``step`` of the protocol on a rank (`verify.run.step`): the job's
    micro-batches through ``built`` (or its pipeline schedule), each phase marked on
    ``meter``, then the optimizer step and the after-step ``zero_grad``."""
    if built.train_step is not None:  # a pipeline schedule: forward and backward
        for _ in range(job.grad_accum):
            meter.mark(f"step{step}/forward")
            built.train_step(ids, targets)
    else:
        micro_batches(step, built.loss_fn, ids, targets, job, meter, scale=built.scale,
                      zero_grad=built.zero_grad, backward=built.backward,
                      device_type=device)  # fmt: skip
    meter.mark(f"step{step}/optimizer")
    built.step()
    if job.zero_grad == "after_step":
        built.zero_grad()
