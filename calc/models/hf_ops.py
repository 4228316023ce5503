"""Op rules the Hugging Face modeling code needs beyond `calc.replay.ops` (torch 2.13).

Each function mirrors one ATen op as `calc.replay.ops` does: what it allocates, what autograd saves
(``tools/autograd/derivatives.yaml``) and what its backward formula allocates, in order.
"""

from __future__ import annotations

from calc.replay.tape import Node, Size, Tape, Tensor


def _half(n: Size) -> Size:
    return n // 2 if isinstance(n, int) else n / 2


def mul(tape: Tape, x: Tensor, y: Tensor, name: str, out_itemsize: int | None = None) -> Tensor:
    """``x * y`` with either operand broadcasting (HF's RMSNorm writes ``weight * x``):
    `calc.replay.ops.mul`."""
    from calc.replay import ops

    big = x if ops.numel_ge(x.numel, y.numel) else y
    return ops.mul(tape, x, y, name, out_itemsize, out_numel=big.numel)


def slice_half(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x[..., :d//2]`` or ``x[..., d//2:]``: a view; backward ``slice_backward`` allocates a
    zero-filled tensor of the input's size and copies the gradient into it."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, g.itemsize, f"d{name}.slice") if g is not None else None]

    n = tape.node("Slice", rule, [x])
    return tape.alias(x, n, numel=_half(x.numel))


def cat_onto_empty(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``torch.cat([empty, x], dim=-2)`` (``DynamicLayer.update`` on a fresh cache): a full copy
    of ``x``; backward hands ``x`` a narrowed view of the gradient (no allocation)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g) if g is not None else None]

    n = tape.node("Cat", rule, [x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def to_copy(tape: Tape, x: Tensor, itemsize: int, name: str) -> Tensor:
    """``x.to(dtype)``: a view of ``x`` when the dtype already matches, else ``_to_copy``
    (backward casts the gradient back: one tensor of the source dtype)."""
    if itemsize == x.itemsize:
        return tape.alias(x, x.grad_fn, x.out_index)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(g.numel, x.itemsize, f"d{name}") if g is not None else None]

    n = tape.node("ToCopy", rule, [x])
    return tape.output(tape.new(x.numel, itemsize, name), n)


def cross_entropy(tape: Tape, logits: Tensor, target: Tensor, rows: Size, vocab: Size) -> Tensor:
    """``F.cross_entropy(logits, target, ignore_index=-100)`` = ``log_softmax`` + ``nll_loss``.

    ``LogSoftmaxBackward0`` saves its output; ``NllLossBackward0`` saves the log-probabilities,
    the target and ``total_weight`` (``nll_loss_forward`` returns the loss and total_weight,
    both 0-d). Backward: ``nll_loss_backward`` [N, V], then ``_log_softmax_backward_data``.
    """
    isz = logits.itemsize

    def rule_ls(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(logits.numel, isz, "dlogits")]

    logp = tape.new(logits.numel, isz, "logp")
    n_ls = tape.node("LogSoftmax", rule_ls, [logits], saved=[logp])
    tape.output(logp, n_ls)

    def rule_nll(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(rows * vocab, isz, "dlogp")]

    loss = tape.new(1, isz, "loss")
    total_weight = tape.new(1, isz, "total_weight")
    n = tape.node("NllLoss", rule_nll, [logp], saved=[logp, target, total_weight])
    tape.drop(total_weight, logp)
    return tape.output(loss, n)


def plain(tape: Tape, numel: Size, itemsize: int, name: str) -> Tensor:
    """A tensor outside autograd (position ids, labels, masks): allocated, no node."""
    return tape.new(numel, itemsize, name)


def linear(
    tape: Tape,
    x: Tensor,
    w: Tensor,
    bias: Tensor | None,
    rows: Size,
    out_features: Size,
    name: str,
) -> Tensor:
    """``F.linear(x, w, b)`` on a contiguous input: `calc.replay.ops.linear` (``mm`` or ``addmm``)."""
    from calc.replay import ops

    return ops.linear(tape, x, w, bias, rows, out_features, name)


def add(tape: Tape, x: Tensor, y: Tensor | None, name: str) -> Tensor:
    """``x + y`` (y may be a Python scalar: None), operands of one size, dtypes possibly mixed
    (autocast: an fp32 residual plus a bf16 projection gives fp32). Saves nothing; backward
    hands the incoming gradient to each operand, and the engine's ``validate_outputs`` casts
    it to an operand's dtype when they differ (one new tensor for that operand).
    ``calc.replay.ops.add`` is this op for equal dtypes."""
    need = (tape.needs_grad(x), tape.needs_grad(y))

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        res: list = []
        for mine, want in zip((x, y), need, strict=True):
            if not want or g is None:
                res.append(None)
            elif mine.itemsize == g.itemsize:
                res.append(tape.alias(g))
            else:
                res.append(tape.new(mine.numel, mine.itemsize, f"d{name}.cast"))
        return res

    n = tape.node("Add", rule, [x, y])
    itemsize = max(x.itemsize, y.itemsize if y is not None else 0)
    return tape.output(tape.new(x.numel, itemsize, name), n)


# -- eager attention ------------------------------------------------------------------------------
def clone(tape: Tape, x: Tensor, name: str) -> Tensor:
    """A copy that autograd sees as a view (``contiguous()``/``reshape`` of a non-viewable
    layout: ``CloneBackward0`` + ``UnsafeViewBackward0``); ``copy_back``-free: the gradient
    passes through as a view."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g) if g is not None else None]

    n = tape.node("Clone", rule, [x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def expand(tape: Tape, x: Tensor, numel: Size) -> Tensor:
    """``x.expand(...)`` (a view); backward ``sum_to_size`` allocates an x-sized gradient."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, g.itemsize, "dexpand.sum") if g is not None else None]

    n = tape.node("Expand", rule, [x])
    return tape.alias(x, n, numel=numel)


def bmm(tape: Tape, x: Tensor, y: Tensor, out_numel: Size, name: str) -> Tensor:
    """``matmul`` of 4-D tensors folded to ``bmm`` (the 3-D result, before matmul's
    ``_unsafe_view`` back to 4-D); saves both operands (each when the other's gradient is
    needed). Backward (measured): the second operand's gradient ``x^T.bmm(grad)`` first, then
    the first's ``grad.bmm(y^T)``, as ``mm``."""
    need = (tape.needs_grad(x), tape.needs_grad(y))

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        if g is None:
            return [None, None]
        gy = tape.new(y.numel, y.itemsize, f"d{name}.y") if need[1] else None
        gx = tape.new(x.numel, x.itemsize, f"d{name}.x") if need[0] else None
        return [gx, gy]

    n = tape.node("Bmm", rule, [x, y], saved=[y if need[0] else None, x if need[1] else None])
    return tape.output(tape.new(out_numel, x.itemsize, name), n)


def scale(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x * python_scalar`` (``MulBackward1``: saves nothing; backward one x-sized tensor)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, g.itemsize, f"d{name}") if g is not None else None]

    n = tape.node("MulScalar", rule, [x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def softmax(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``softmax(x, -1)``: saves its output; backward ``_softmax_backward_data`` (one x-sized)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, x.itemsize, f"d{name}") if g is not None else None]

    out = tape.new(x.numel, x.itemsize, name)
    n = tape.node("Softmax", rule, [x], saved=[out])
    return tape.output(out, n)
