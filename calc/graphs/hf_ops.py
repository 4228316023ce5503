"""Op rules the Hugging Face modeling code needs beyond `calc.ops` (torch 2.13).

Each function mirrors one ATen op as `calc.ops` does: what it allocates, what autograd saves
(``tools/autograd/derivatives.yaml``) and what its backward formula allocates, in order.
"""

from __future__ import annotations

import sympy as sp

from calc.tape import Node, Size, Tape, Tensor


def _half(n: Size) -> Size:
    return n // 2 if isinstance(n, int) else n / 2


def mul(tape: Tape, x: Tensor, y: Tensor, name: str, out_itemsize: int | None = None) -> Tensor:
    """``x * y`` where either operand may broadcast (to the output's size ``max`` numel).

    Saves ``y`` if x needs grad and ``x`` if y needs grad. Backward (``MulBackward0``) computes
    ``grad * y`` then ``grad * x``, both full size; only afterwards does the engine's
    ``validate_outputs`` reduce a broadcast operand's gradient with ``sum_to`` (one reduced
    tensor each, the full product freed right after), and cast it to the operand's dtype.
    ``calc.ops.mul`` reduces each gradient as soon as it is made, which is the same order only
    when the broadcast operand comes second.
    """
    need = (tape.needs_grad(x), tape.needs_grad(y))
    big = x if _ge(x.numel, y.numel) else y
    itemsize = out_itemsize or max(x.itemsize, y.itemsize)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        if g is None:
            return [None, None]
        full = [
            tape.new(g.numel, g.itemsize, f"d{name}") if want else None
            for want in need
        ]
        tape.formula_done(node)  # recomputed (checkpointed) saved tensors die with the formula
        res: list = []
        for mine, f in zip((x, y), full, strict=True):
            if f is None:
                res.append(None)
            elif bool(mine.numel == g.numel) and mine.itemsize == g.itemsize:
                res.append(f)
            else:
                r = tape.new(mine.numel, mine.itemsize, f"d{name}.sum")
                tape.drop(f)
                res.append(r)
        return res

    n = tape.node("Mul", rule, [x, y], saved=[y if need[0] else None, x if need[1] else None])
    return tape.output(tape.new(big.numel, itemsize, name), n)


def _ge(p: Size, q: Size) -> bool:
    """``p >= q`` for sizes; symbolic sizes are compared at a generic point (every symbol 7):
    broadcasting is structural, so the larger operand is larger at any point but degenerate ones."""
    if isinstance(p, int) and isinstance(q, int):
        return p >= q
    point = {sym: 7 for sym in (sp.sympify(p) - sp.sympify(q)).free_symbols}
    return bool(sp.sympify(p).subs(point) >= sp.sympify(q).subs(point))


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


def cross_entropy(
    tape: Tape, logits: Tensor, target: Tensor, rows: Size, vocab: Size
) -> Tensor:
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
    """``F.linear(x, w, b)`` on a contiguous input.

    Without a bias this is `calc.ops.linear` (``mm``: backward gives the weight gradient, then
    the input gradient). With one it is ``addmm(b, x2d, w.t())``: ``AddmmBackward0`` computes
    the input gradient (``mm_mat1_backward``), then the weight gradient, and hands the bias
    the incoming gradient itself (``maybe_multiply(grad, beta=1)``), which the engine's
    ``validate_outputs`` reduces with ``sum_to`` last (measured: mm, mm, sum).
    """
    from calc import ops

    if bias is None:
        return ops.linear(tape, x, w, None, rows, out_features, name)
    need_x, need_w, need_b = tape.needs_grad(x), tape.needs_grad(w), tape.needs_grad(bias)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        gx = tape.new(x.numel, x.itemsize, f"d{name}.in") if need_x else None
        gw = tape.new(w.numel, w.itemsize, f"d{w.name}") if need_w else None
        gb = tape.new(bias.numel, bias.itemsize, f"d{bias.name}") if need_b and g else None
        return [gx, gw, gb]

    n = tape.node(
        "Addmm", rule, [x, w, bias], saved=[x if need_w else None, w if need_x else None]
    )
    return tape.output(tape.new(rows * out_features, x.itemsize, name), n)


def add(tape: Tape, x: Tensor, y: Tensor | None, name: str) -> Tensor:
    """``x + y`` (y may be a Python scalar: None), operands of one size, dtypes possibly mixed
    (autocast: an fp32 residual plus a bf16 projection gives fp32). Saves nothing; backward
    hands the incoming gradient to each operand, and the engine's ``validate_outputs`` casts
    it to an operand's dtype when they differ (one new tensor for that operand).
    ``calc.ops.add`` is this op for equal dtypes."""
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
