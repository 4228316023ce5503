"""The cross-entropy loss and its log-softmax (torch 2.13)."""

from __future__ import annotations

from calc.replay.ops.casts import to_dtype
from calc.replay.tape import Node, Size, Tape, Tensor


def cross_entropy(
    tape: Tape,
    logits: Tensor,
    rows: Size,
    vocab: Size,
    itemsize: int,
    target: Tensor | None = None,
) -> Tensor:
    """``F.cross_entropy`` = ``log_softmax`` (saves its output) + ``nll_loss``.

    ``nll_loss_forward`` returns the loss and ``total_weight`` (both 0-d); ``NllLossBackward0``
    saves the log-probabilities, the target (``target``, when the replay allocated it) and
    total_weight. Backward: ``nll_loss_backward`` [N, V], then ``_log_softmax_backward_data``.
    Under autocast cross_entropy runs in fp32: the logits are cast first (one copy).
    """
    up = None
    if tape.autocast_itemsize:
        up = to_dtype(tape, logits, 4, "logits.float")
        logp = log_softmax(tape, up, 4)
    else:
        logp = log_softmax(tape, logits, itemsize)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(rows * vocab, logp.itemsize, "dlogp")]

    loss = tape.new(1, logp.itemsize, "loss")
    total_weight = tape.new(1, logp.itemsize, "total_weight")
    n = tape.node("NllLoss", rule, [logp], saved=[logp, target, total_weight])
    tape.drop(total_weight)
    tape.drop(logp, up)
    return tape.output(loss, n)


def log_softmax(tape: Tape, x: Tensor, itemsize: int) -> Tensor:
    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, itemsize, "dlogits")]

    out = tape.new(x.numel, itemsize, "logp")
    n = tape.node("LogSoftmax", rule, [x], saved=[out])
    return tape.output(out, n)
