"""The loops around the model a `calc.Training` job names (``loop``, ``loss``, ``loss_chunks``).

`Loop` is the ``(ids, targets) -> loss`` callable the training-step protocol
(`verify.run.step`) calls for each micro-batch when the job's head is not today's
(``drop-output`` with the model's cross-entropy, `verify.models.build.build_model`'s own
``loss_fn``). It writes the loops people run, and ``calc.models.head`` replays them:

* ``hold-output``: ``out = model(...)`` and the loss taken from it; ``out`` is an attribute of
  the loop, rebound at the next call, so the previous output dies when the next forward
  returns (a hand-written ``for`` loop's local does the same);
* ``del-logits`` and the losses the loop computes (``sum``, ``chunked-ce``): the model returns
  its output, the loop takes the logits, computes the loss and drops them before backward.

The model's cross-entropy: Hugging Face's ``labels=`` (or ``model.loss_function`` on the
logits under ``del-logits``), the reference model's ``F.cross_entropy``. ``chunked-ce`` is
written here in the style of torchtune's ``CEWithChunkedOutputLoss``
(torchtune/modules/loss/ce_chunked_output_loss.py): the head applied to chunks of the hidden
states (here the flattened tokens, ``tensor_split`` into ``loss_chunks``), each chunk upcast
and reduced with ``reduction="sum"``, the total divided by the number of targets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from calc.config.jobs import Training


def is_default(job: Training) -> bool:
    """Today's step: the model's cross-entropy, its output dropped before backward."""
    return job.loop == "drop-output" and job.loss == "cross-entropy"


def chunked_cross_entropy(chunks: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Sum of ``F.cross_entropy(chunk.float(), target chunk, reduction="sum")`` over the chunks,
    divided by the number of counted targets (``!= -100``), as torchtune's loss does."""
    count = (targets != -100).sum()
    pieces = targets.flatten().tensor_split(len(chunks))
    total = None
    for logits, target in zip(chunks, pieces, strict=True):
        part = F.cross_entropy(logits.float(), target, reduction="sum")
        total = part if total is None else total + part
    assert total is not None
    return total / count


class Loop:
    """``(ids, targets) -> loss`` for one micro-batch, the loop's output held in ``out``."""

    def __init__(
        self, model: torch.nn.Module, job: Training, call: torch.nn.Module | None = None
    ) -> None:
        self.model = model
        self.call = model if call is None else call
        """What the loop calls for the whole model: ``model`` or its data-parallel wrapper (DDP's
        forward prepares the reducer; FSDP2's root forward all-gathers the root's parameters)."""
        self.job = job
        self.hf = hasattr(model, "config")
        self.out: Any = None
        """What the loop holds of the last forward (``hold-output``), else None."""

    def _head_weight(self) -> torch.Tensor:
        model = self.model
        return model.lm_head.weight if self.hf else model.head_weight()

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        job = self.job
        hold = job.loop == "hold-output"
        in_model = job.loss == "cross-entropy" and job.loop != "del-logits"
        if in_model:  # the model's cross-entropy (hold-output)
            if self.hf:
                out = self.call(input_ids=ids, labels=targets)
                self.out = out
                return out.loss
            logits = F.linear(self.model.hidden_states(ids), self._head_weight())
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            self.out = logits
            return loss
        if job.loss == "chunked-ce":
            return self._chunked(ids, targets, hold)
        out = self.call(input_ids=ids) if self.hf else None
        if out is not None:
            logits = out.logits
        else:
            logits = F.linear(self.model.hidden_states(ids), self._head_weight())
        self.out = (out if out is not None else logits) if hold else None
        del out
        if job.loss == "sum":
            loss = logits.sum()
        elif self.hf:
            loss = self.model.loss_function(logits, targets, vocab_size=logits.shape[-1])
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        del logits
        return loss

    def _chunked(self, ids: torch.Tensor, targets: torch.Tensor, hold: bool) -> torch.Tensor:
        """The head on ``loss_chunks`` pieces of the flattened hidden states, then the loss."""
        out = self.model.base_model(input_ids=ids) if self.hf else None
        hidden = out.last_hidden_state if out is not None else self.model.hidden_states(ids)
        weight = self._head_weight()
        chunks = [
            F.linear(c, weight) for c in hidden.flatten(0, 1).tensor_split(self.job.loss_chunks)
        ]
        self.out = (out if out is not None else hidden, chunks) if hold else None
        del out, hidden
        loss = chunked_cross_entropy(chunks, targets)
        del chunks
        return loss
