"""The end of a training forward as the loop around the model writes it: the head, the loss,
and who holds the model's output (`calc.Training`'s ``loop``, ``loss`` and ``loss_chunks``).

The model graphs (`calc.models.reference`, `calc.models.hf`, `calc.models.hf_gpt2`) replay
their own forward up to the final hidden states and hand the rest to `finish`, which follows
the loops of ``verify/models/loops.py`` line by line:

* the model's own cross-entropy under ``drop-output``/``hold-output``: the model computes the
  loss (Hugging Face: ``labels=``), then its output object (loss, logits, cache) dies before
  backward (``drop-output``) or is held until the next forward returns (``hold-output``: the
  Python name ``out`` is rebound only then);
* a loss the loop computes from the logits (``del-logits``, ``sum``, ``chunked-ce``): the model
  returns its output, the loop takes the logits (the rest of the output object dies unless it is
  held), computes the loss and drops the logits before backward (``del logits``), or holds them
  with the output (``hold-output``);
* ``chunked-ce`` (torchtune's ``CEWithChunkedOutputLoss`` with ``num_output_chunks``,
  torchtune/modules/loss/ce_chunked_output_loss.py, and ``TransformerDecoder``'s chunked output
  projection): the head runs on ``hidden.tensor_split(k, dim=1)``, giving ``k`` logits chunks,
  all alive; the loss upcasts one chunk at a time (``.float()``), ``F.cross_entropy(...,
  reduction="sum")`` per chunk, the partial sums added, divided by the number of targets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from calc.config.jobs import Training
from calc.models.shape import Shape
from calc.replay import ops
from calc.replay.tape import Node, Size, Tape, Tensor, divide

LinearFn = Callable[[Tape, Tensor, Size, str], Tensor]
"""The model's head on ``rows`` rows of hidden states: ``(tape, hidden, rows, name) -> logits``."""
LossFn = Callable[[Tape, Tensor], Tensor]
"""The model's own cross-entropy of its logits: ``(tape, logits) -> loss``."""
INT64 = 8
FP32 = 4


class RootHooks(Protocol):
    """A wrapper's hooks around the root module's forward (FSDP2's root: `calc.parallel.fsdp`):
    its post-forward when the model returns, its pre-backward when the gradient first reaches
    the model's output."""

    def end_forward(self, tape: Tape) -> None: ...

    def start_backward(self, tape: Tape) -> None: ...


@dataclass(frozen=True, slots=True)
class Head:
    """How one training forward ends (`calc.Training`'s ``loop``, ``loss``, ``loss_chunks``)."""

    loop: str = "drop-output"
    loss: str = "cross-entropy"
    chunks: int = 8
    root: RootHooks | None = field(default=None, compare=False)
    """The root wrapper's hooks, which `finish` runs where the loop's code meets the model's
    when the loop computes the loss (``None``: no wrapper, or the caller runs them around the
    model's forward and backward: the model's own loss is inside its forward)."""

    @classmethod
    def of(cls, job: Training, root: RootHooks | None = None) -> Head:
        """The job's head; ``root``: the wrapper's hooks (`Head.root`)."""
        return cls(job.loop, job.loss, job.loss_chunks, root)

    @property
    def default(self) -> bool:
        """Today's step (the model's cross-entropy, output dropped): the graphs' own path."""
        return self.loop == "drop-output" and self.loss == "cross-entropy"

    @property
    def hold(self) -> bool:
        """The output object outlives the forward (``hold-output``)."""
        return self.loop == "hold-output"

    @property
    def in_model(self) -> bool:
        """The model computes the loss itself (its cross-entropy, labels passed)."""
        return self.loss == "cross-entropy" and self.loop != "del-logits"


def finish(
    tape: Tape,
    sh: Shape,
    head: Head,
    hid: Tensor,
    output: list[Tensor] | None,
    linear: LinearFn,
    model_ce: LossFn,
    held: list[Tensor],
) -> Tensor:
    """From the final hidden states ``hid`` (a local of the model's forward) to the loss.

    ``output``: the other tensors the model's output object holds (Hugging Face's cache);
    ``None`` for a model that returns bare tensors (the reference model: no object holds the
    loss, ``hold-output`` keeps the logits alone).
    ``held``: what the loop holds from the previous forward (``hold-output``), released when
    this forward's output is bound to the loop's name (``out = model(...)``), and refilled with
    this forward's output. Runs inside the forward's autocast, as the loop's loss does in
    ``verify/models/loops.py``."""
    obj = output is not None
    output = output or []
    n = sh.b * sh.s
    if head.loss == "chunked-ce":  # [head(c) for c in hidden.flatten(0, 1).tensor_split(k)]
        part = divide(n, head.chunks)  # every slice exists before the first linear runs
        pieces = [_slice(tape, hid, part * sh.h, f"hidden.{i}") for i in range(head.chunks)]
        logits = [linear(tape, p, part, f"logits.{i}") for i, p in enumerate(pieces)]
        tape.drop(*pieces)
    else:
        logits = [linear(tape, hid, n, "logits")]
    if head.in_model:  # the model's loss, before its output object is built
        loss = model_ce(tape, logits[0])
        tape.drop(hid)
        own = [tape.alias(loss)] if obj else []  # ``out.loss``
        _rebind(tape, held, [*own, *logits, *output] if head.hold else [])
        if not head.hold:
            tape.drop(*logits, *output)
        return loss
    base = [hid] if head.loss == "chunked-ce" else []  # the base model's last_hidden_state
    if not base:
        tape.drop(hid)  # a local of the model's forward
    if head.root is not None:  # the model returned: the wrapper's post-forward, then its
        head.root.end_forward(tape)  # pre-backward hook on the output's logits
        logits = [root_pre_backward(tape, x, head.root) for x in logits]
    _rebind(tape, held, [*base, *logits, *output] if head.hold else [])
    if not head.hold:  # ``del out``: the rest of the output object dies, the logits stay
        tape.drop(*output, *base)
    if head.loss == "sum":
        loss = logits_sum(tape, logits[0])
    elif head.loss == "chunked-ce":
        loss = chunked_cross_entropy(tape, sh, logits)
    else:
        loss = model_ce(tape, logits[0])
    if not head.hold:
        tape.drop(*logits)  # ``del logits``
    return loss


def root_pre_backward(tape: Tape, logits: Tensor, root: RootHooks) -> Tensor:
    """``logits`` with the hook FSDP2's root post-forward registers on each output tensor
    (``FSDPState._register_pre_backward_hook``, torch/distributed/fsdp/_fully_shard/
    _fsdp_state.py): a tensor hook runs before the node that made the tensor, when the
    gradient reaches it; here a pass-through node between the loss and the head, whose gradient
    is the incoming one (a view, nothing allocated)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        root.start_backward(tape)
        g = grads[0]
        return [tape.alias(g) if g is not None else None]

    n = tape.node("RootPreBackward", rule, [logits])
    hooked = tape.alias(logits, n)
    tape.drop(logits)
    return hooked


def _rebind(tape: Tape, held: list[Tensor], new: list[Tensor]) -> None:
    """``out = ...``: the loop's name takes the new output; the previous one is released."""
    tape.drop(*held)
    held[:] = new


def _slice(tape: Tape, x: Tensor, numel: Size, name: str) -> Tensor:
    """One piece of ``x.tensor_split(k)`` on the first dimension (a view); ``SliceBackward0``
    allocates a zero-filled tensor of the input's size and copies the gradient into it."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, g.itemsize, f"d{name}") if g is not None else None]

    n = tape.node("Slice", rule, [x])
    return tape.alias(x, n, numel=numel)


def logits_sum(tape: Tape, logits: Tensor) -> Tensor:
    """``logits.sum()``: a 0-d result in the logits' dtype, nothing saved; ``SumBackward0``
    hands back ``grad.expand(sizes)``, a view (torch/csrc/autograd/FunctionsManual.cpp,
    ``sum_backward``)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g, numel=logits.numel) if g is not None else None]

    n = tape.node("Sum", rule, [logits])
    return tape.output(tape.new(1, logits.itemsize, "loss"), n)


def chunked_cross_entropy(tape: Tape, sh: Shape, chunks: list[Tensor]) -> Tensor:
    """``verify.models.loops.chunked_cross_entropy``: ``count = (targets != -100).sum()``, then
    per chunk ``F.cross_entropy(c.float(), t, reduction="sum")`` (the targets' chunks are views
    of the flattened targets), the partial sums added, and ``total / count``."""
    rows = divide(sh.b * sh.s, len(chunks))
    mask = tape.new(sh.b * sh.s, 1, "targets.ne")  # targets != ignore_index (bool)
    count = tape.new(1, INT64, "targets.count")
    tape.drop(mask)
    total: Tensor | None = None
    part: Tensor | None = None
    for i, c in enumerate(chunks):
        up = ops.to_dtype(tape, c, FP32, f"logits.{i}.float")
        new = ops.cross_entropy(tape, up, rows, sh.V, FP32)
        tape.drop(up, part)  # the local ``part`` is rebound once the next one exists
        part = new
        if total is None:
            total = tape.alias(part, part.grad_fn, part.out_index)
        else:
            acc = ops.add(tape, total, part, "loss.sum")
            tape.drop(total)
            total = acc
    assert total is not None
    loss = divide_by_count(tape, total, count)
    tape.drop(total, count, part)
    return loss


def divide_by_count(tape: Tape, x: Tensor, count: Tensor) -> Tensor:
    """``x / count`` of 0-d tensors, ``count`` an integer one: ``DivBackward0`` saves
    ``count`` (derivatives.yaml: ``self: div_tensor_self_backward(grad, other, ...)``);
    backward ``grad / count``, a new 0-d tensor."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(1, x.itemsize, "dloss.div") if g is not None else None, None]

    n = tape.node("Div", rule, [x, count], saved=[count])
    return tape.output(tape.new(1, x.itemsize, "loss"), n)
