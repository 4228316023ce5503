"""The loop around the model and the optimizer variants, as verify runs them, for the recorder.

`calc.derive.record` runs verify's training protocol (``verify/run/step.py``) on fake tensors.
For the jobs whose loop, loss or optimizer differ from the default, verify swaps two pieces
(``verify/models/build.py``, ``build_model`` and ``build_optimizer``), and so does the
recorder, with the same statements in the same order (the storages they free and when are
what the CPU tracker measures):

* `LoopLoss`: ``(ids, targets) -> loss`` of a ``loop``/``loss`` other than the default
  (``verify/models/loops.py``, ``Loop``): the output held until the next forward returns
  (``hold-output``), the logits taken and dropped before backward (``del-logits``, ``sum``),
  or the head run on ``loss_chunks`` pieces of the flattened hidden states, each upcast and
  reduced with ``reduction="sum"`` (``chunked-ce``, torchtune's ``CEWithChunkedOutputLoss``,
  torchtune/modules/loss/ce_chunked_output_loss.py);
* `NoStep`: ``optimizer=None``, forward and backward alone (no states; ``zero_grad`` sets the
  gradients to None);
* `InBackward`: ``optimizer_in_backward`` (torchtune's ``register_optim_in_bwd_hooks``,
  torchtune/training/memory.py): one optimizer per trainable parameter, stepped and zeroed by
  a post-accumulate-grad hook during the backward; the protocol's own step does nothing;
* `Masters`: ``precision="bf16-master"`` (``verify/models/optimizers.py``, ``MasterWeights``):
  fp32 copies of the bf16 parameters made at the first step, the optimizer over them, each
  step's gradients upcast onto them and the result copied back.

`NoStep` and `InBackward` show the recorder what a torch optimizer shows it (``param_groups``,
``state``, ``step()``), so gradients and states are classified as for the default step.

torch is imported only inside these functions: ``calc`` imports without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from calc.config.jobs import Training


def is_default_loop(job: Training) -> bool:
    """The protocol's own loss: ``model(input_ids, labels).loss``, the output dropped."""
    return job.loop == "drop-output" and job.loss == "cross-entropy"


class LoopLoss:
    """``(ids, targets) -> loss`` of ``job``'s loop on a Hugging Face ``*ForCausalLM``; what the
    loop keeps of the last forward is ``held`` (rebound, hence freed, only at the next call)."""

    def __init__(self, model: Any, job: Training) -> None:
        self.model = model
        self.job = job
        self.held: Any = None

    def __call__(self, ids: Any, targets: Any) -> Any:
        job = self.job
        if job.loss == "chunked-ce":
            return self._chunked(ids, targets)
        if job.loss == "cross-entropy" and job.loop == "hold-output":
            result = self.model(input_ids=ids, labels=targets)
            self.held = result
            return result.loss
        return self._from_logits(ids, targets)

    def _from_logits(self, ids: Any, targets: Any) -> Any:
        """``sum`` or the model's ``loss_function`` on the logits the model returned; the
        output held (``hold-output``) or gone before the loss, the logits dropped after it."""
        result = self.model(input_ids=ids)
        logits = result.logits
        self.held = result if self.job.loop == "hold-output" else None
        del result
        if self.job.loss == "sum":
            loss = logits.sum()
        else:
            loss = self.model.loss_function(logits, targets, vocab_size=logits.shape[-1])
        del logits
        return loss

    def _chunked(self, ids: Any, targets: Any) -> Any:
        """The base model's hidden states, the head on ``loss_chunks`` pieces of the flattened
        tokens, then the chunked cross-entropy (`chunked_cross_entropy`)."""
        import torch.nn.functional as F

        result = self.model.base_model(input_ids=ids)
        hidden = result.last_hidden_state
        weight = self.model.get_output_embeddings().weight
        pieces = hidden.flatten(0, 1).tensor_split(self.job.loss_chunks)
        chunks = [F.linear(piece, weight) for piece in pieces]
        del pieces
        self.held = (result, chunks) if self.job.loop == "hold-output" else None
        del result, hidden
        loss = chunked_cross_entropy(chunks, targets)
        del chunks
        return loss


def chunked_cross_entropy(chunks: list, targets: Any) -> Any:
    """``F.cross_entropy(chunk.float(), its targets, reduction="sum")`` added over the chunks,
    divided by the count of targets that are not ``-100`` (torchtune's
    ``CEWithChunkedOutputLoss.forward``)."""
    import torch.nn.functional as F

    count = (targets != -100).sum()
    total = None
    for logits, target in zip(chunks, targets.flatten().tensor_split(len(chunks)), strict=True):
        part = F.cross_entropy(logits.float(), target, reduction="sum")
        total = part if total is None else total + part
    return total / count


class NoStep:
    """``optimizer=None``: the parameters, no state, a step that does nothing."""

    def __init__(self, params: list) -> None:
        self.param_groups = [{"params": params}]

    @property
    def state(self) -> dict:
        """No optimizer, no state."""
        return {}

    def step(self) -> None:
        """Forward and backward alone: nothing to step."""

    def close(self) -> None:
        """Nothing registered."""


class InBackward(NoStep):
    """``optimizer_in_backward``: ``make([p])`` per parameter, stepped then zeroed
    (``zero_grad(set_to_none=True)``) by ``p``'s post-accumulate-grad hook."""

    def __init__(self, params: list, make: Callable[[list], Any]) -> None:
        super().__init__(params)
        self.optimizers = {p: make([p]) for p in params}
        self.handles = [p.register_post_accumulate_grad_hook(self._step) for p in params]

    def _step(self, param: Any) -> None:
        opt = self.optimizers[param]
        opt.step()
        opt.zero_grad(set_to_none=True)

    @property
    def state(self) -> dict:
        """Every parameter's state, from its own optimizer."""
        return {p: opt.state.get(p, {}) for p, opt in self.optimizers.items()}

    def close(self) -> None:
        """The hooks removed (the model outlives one recording)."""
        for handle in self.handles:
            handle.remove()


class Masters(NoStep):
    """``bf16-master``: bf16 parameters and gradients, fp32 masters and an fp32 optimizer over
    them (``verify/models/optimizers.py``, ``MasterWeights``). First step: ``masters =
    [p.detach().float()]`` and ``make(masters)``; each step, under ``no_grad``: ``m.grad =
    p.grad.float()`` for every parameter, the inner step, then ``p.copy_(m)`` and ``m.grad =
    None`` parameter by parameter. Each master is its parameter's state ``"master"``, beside
    the inner optimizer's states of that master."""

    def __init__(self, params: list, make: Callable[[list], Any]) -> None:
        super().__init__(params)
        self.params = params
        self.make = make
        self.masters: list | None = None
        self.inner: Any = None

    def step(self) -> None:
        """The first step's masters and optimizer, the upcast gradients, the step, the copy."""
        import torch

        with torch.no_grad():
            if self.masters is None:
                self.masters = [p.detach().float() for p in self.params]
                self.inner = self.make(self.masters)
            for p, m in zip(self.params, self.masters, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
            self.inner.step()
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)
                m.grad = None

    @property
    def state(self) -> dict:
        """Each parameter's master and the inner optimizer's states of it."""
        if self.masters is None:
            return {}
        return {
            p: {"master": m, **self.inner.state.get(m, {})}
            for p, m in zip(self.params, self.masters, strict=True)
        }


class LocalSteps:
    """A ZeRO-1 rank's optimizer (``ZeroRedundancyOptimizer``): its param groups hold every
    trained parameter (``zero_grad`` and the recording's filing of gradients cover them all),
    while the local optimizer ``local`` steps, and keeps states for, the rank's own."""

    def __init__(self, local: Any, params: list) -> None:
        self.local = local
        self.param_groups = [{"params": params}]

    @property
    def state(self) -> Any:
        """The local optimizer's states (none for the parameters other ranks own)."""
        return self.local.state

    def step(self) -> None:
        """The local step (the broadcast of the updated parameters allocates nothing)."""
        self.local.step()


def stepper(
    params: list, job: Training, make: Callable[[list], Any], owned: Sequence[int] | None = None
) -> Any:
    """What the protocol steps for ``job``: the optimizer ``make(params)``, or `NoStep` /
    `InBackward` / `Masters` (``verify/models/build.py``, ``build_optimizer``); with ``owned``
    (a ZeRO-1 rank's parameter indices) `LocalSteps` over ``make`` of those
    (``verify/dist/engines.py``, ``zero1``)."""
    if owned is not None:
        return LocalSteps(make([params[i] for i in owned]), params)
    if job.optimizer is None:
        return NoStep(params)
    if job.optimizer_in_backward:
        return InBackward(params, make)
    if job.precision == "bf16-master":
        return Masters(params, make)
    return make(params)
