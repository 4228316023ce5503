"""Matrix products: ``F.linear``, ``bmm``, 4-D ``matmul`` and the embedding lookup (torch 2.13)."""

from __future__ import annotations

from calc.replay.ops.casts import autocast_cast
from calc.replay.ops.views import clone, view
from calc.replay.tape import Node, Size, Tape, Tensor


def linear(
    tape: Tape, x: Tensor, w: Tensor, bias: Tensor | None, rows: Size, out_features: Size, name: str
) -> Tensor:
    """``F.linear(x, w, b)`` on a contiguous input, as ``mm``/``addmm`` on its 2-D view.

    Saves the input (for the weight's gradient) and the weight (for the input's gradient).
    Backward allocates the weight gradient, the input gradient and the bias gradient
    (``grad.sum(0)``); ``mm_mat2_backward`` gives the weight gradient in the weight's layout.
    The output is an ``mm`` (``addmm`` with a bias) call's (`Tape.op_outputs`).
    A weight with a hook (LoRA-adapted or quantized: `calc.compress.lora`,
    `calc.compress.quant`) runs the hook instead; under autocast, `_linear_autocast`.
    """
    hook = tape.linear_hooks.get(id(w.storage))
    if hook is not None:
        return hook(tape, x, bias, rows, out_features, name)
    if tape.autocast_itemsize:
        return _linear_autocast(tape, x, w, bias, rows, out_features, name)
    need_x, need_w = tape.needs_grad(x), tape.needs_grad(w)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        # MmBackward computes the weight's gradient first; AddmmBackward the input's.
        if bias is None:
            gw = tape.new(w.numel, w.itemsize, f"d{w.name}") if need_w else None
            gx = tape.new(x.numel, x.itemsize, f"d{name}.in") if need_x else None
        else:
            gx = tape.new(x.numel, x.itemsize, f"d{name}.in") if need_x else None
            gw = tape.new(w.numel, w.itemsize, f"d{w.name}") if need_w else None
            tape.formula_done(node)  # the mat1/mat2 locals die before the bias' sum
        gb = None
        if need_b and bias is not None:
            gb = tape.new(bias.numel, bias.itemsize, f"d{bias.name}")
        return [gx, gw, gb]

    need_b = tape.needs_grad(bias)
    n = tape.node(
        "Linear", rule, [x, w, bias], saved=[x if need_w else None, w if need_x else None]
    )
    op = "mm" if bias is None else "addmm"
    (out,) = tape.op_outputs(op, lambda: [tape.new(rows * out_features, x.itemsize, name)])
    assert out is not None
    return tape.output(out, n)


def _linear_autocast(
    tape: Tape, x: Tensor, w: Tensor, bias: Tensor | None, rows: Size, out_features: Size,
    name: str,
) -> Tensor:  # fmt: skip
    """``F.linear`` under autocast (lower-precision op list): the weight's cast (cached), then
    the input's cast, then ``mm``/``addmm`` on the casts, which are what autograd saves."""
    # Cast order as traced: bias, weight, input.
    cb = autocast_cast(tape, bias, f"{name}.b") if bias is not None else None
    cw = autocast_cast(tape, w, f"{name}.w")
    cx = autocast_cast(tape, x, f"{name}.x")
    with tape.autocast_paused():
        out = linear(tape, cx, cw, cb, rows, out_features, name)
    tape.drop(cw, cx, cb)
    return out


def bmm(
    tape: Tape,
    x: Tensor,
    y: Tensor,
    out_numel: Size,
    name: str,
    grad_names: tuple[str, str] = ("self", "mat2"),
) -> Tensor:
    """``x.bmm(y)``: saves y for x's gradient and x for y's. Backward (traced order): y's
    gradient ``x^T.bmm(grad)``, then x's ``grad.bmm(y^T)``, named ``d<name>.<grad_names[i]>``
    (the Hugging Face graphs name them ``x``, ``y``)."""
    need_x, need_y = tape.needs_grad(x), tape.needs_grad(y)
    x_name, y_name = grad_names

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        gy = (
            tape.new(y.numel, y.itemsize, f"d{name}.{y_name}") if need_y and g is not None else None
        )
        gx = (
            tape.new(x.numel, x.itemsize, f"d{name}.{x_name}") if need_x and g is not None else None
        )
        return [gx, gy]

    n = tape.node("Bmm", rule, [x, y], saved=[y if need_x else None, x if need_y else None])
    return tape.output(tape.new(out_numel, max(x.itemsize, y.itemsize), name), n)


def _fold(tape: Tape, x: Tensor, contiguous: bool, name: str) -> Tensor:
    """matmul's ``x.expand(same size).reshape(batch, m, n)``: a view, or a contiguous copy."""
    e = view(tape, x, name="Expand")
    if contiguous:
        r = view(tape, e, name="View")
    else:
        c = clone(tape, e, name)
        r = view(tape, c, name="UnsafeView")
        tape.drop(c)
    tape.drop(e)
    return r


def matmul(
    tape: Tape,
    x: Tensor,
    x_contiguous: bool,
    y: Tensor,
    y_contiguous: bool,
    out_numel: Size,
    name: str,
    grad_copy: bool,
) -> Tensor:
    """``torch.matmul`` of two 4-D tensors (``_matmul_impl``): each operand folded to 3-D
    (``*_contiguous``: whether its reshape is a view), ``bmm``, ``_unsafe_view`` back to 4-D.
    ``grad_copy``: the gradient reaching the result is not contiguous, so the ``_unsafe_view``
    backward (``grad.reshape``) copies it."""
    xr = _fold(tape, x, x_contiguous, f"{name}.a")
    yr = _fold(tape, y, y_contiguous, f"{name}.b")
    out = bmm(tape, xr, yr, out_numel, name)
    res = view(tape, out, copy_back=grad_copy)
    tape.drop(out, yr, xr)
    return res


def embedding(
    tape: Tape, w: Tensor, rows: Size, hidden: Size, name: str, indices: Tensor | None = None
) -> Tensor:
    """``F.embedding``: saves the indices (``indices``, when the replay allocated them);
    backward ``embedding_dense_backward`` allocates a dense gradient of the table."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(w.numel, w.itemsize, f"d{w.name}")]

    n = tape.node("Embedding", rule, [w], saved=[indices])
    return tape.output(tape.new(rows * hidden, w.itemsize, name), n)
