"""Elementwise ops and reductions along the last dimension (torch 2.13).

Each saves what its ``derivatives.yaml`` formula needs and allocates, in backward, the
temporaries and gradients that formula makes, in order.
"""

from __future__ import annotations

import sympy as sp

from calc.replay.tape import BackwardRule, Node, Size, Tape, Tensor


def numel_ge(p: Size, q: Size) -> bool:
    """``p >= q`` for sizes; symbolic sizes are compared at a generic point (every symbol 7):
    broadcasting is structural, so the larger operand is larger at any non-degenerate point."""
    if isinstance(p, int) and isinstance(q, int):
        return p >= q
    point = {sym: 7 for sym in (sp.sympify(p) - sp.sympify(q)).free_symbols}
    return bool(sp.sympify(p).subs(point) >= sp.sympify(q).subs(point))


def mul(
    tape: Tape,
    x: Tensor,
    y: Tensor,
    name: str,
    out_itemsize: int | None = None,
    out_numel: Size | None = None,
) -> Tensor:
    """``x * y``: the result has x's size (or ``out_numel``, when x is the operand that
    broadcasts). Saves y if x needs grad and x if y needs grad.

    Backward (``MulBackward0``): ``grad * y`` then ``grad * x``, both full size; a broadcast or
    lower-precision operand's product is then reduced (``sum_to``) or cast by the engine's
    ``validate_outputs`` (`Tape._validate_outputs`), the full product freed right after.
    """
    need = (tape.needs_grad(x), tape.needs_grad(y))

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [
            tape.new(g.numel, g.itemsize, f"d{name}") if want and g is not None else None
            for want in need
        ]

    n = tape.node("Mul", rule, [x, y], saved=[y if need[0] else None, x if need[1] else None])
    itemsize = out_itemsize or max(x.itemsize, y.itemsize)
    return tape.output(tape.new(x.numel if out_numel is None else out_numel, itemsize, name), n)


def mul_broadcast(
    tape: Tape, x: Tensor, y: Tensor, name: str, out_itemsize: int | None = None
) -> Tensor:
    """`mul` with either operand broadcasting (HF's RMSNorm writes ``weight * x``): the result
    has the larger operand's size."""
    big = x if numel_ge(x.numel, y.numel) else y
    return mul(tape, x, y, name, out_itemsize, out_numel=big.numel)


def add(
    tape: Tape, x: Tensor, y: Tensor | None, name: str, out_numel: Size | None = None
) -> Tensor:
    """``x + y`` (y may be a Python scalar: None). Saves nothing; backward hands the same
    gradient to both operands (reduced with ``sum_to_size`` for a broadcast one, cast by the
    engine's ``validate_outputs`` for an operand of another dtype)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g) if need and g is not None else None for need in node.info["need"]]

    need = (tape.needs_grad(x), tape.needs_grad(y))
    n = tape.node("Add", rule, [x, y], need=need)
    numel = out_numel if out_numel is not None else x.numel
    itemsize = max(x.itemsize, y.itemsize if y is not None else 0)
    return tape.output(tape.new(numel, itemsize, name), n)


def add_cast_in_formula(tape: Tape, x: Tensor, y: Tensor | None, name: str) -> Tensor:
    """``x + y`` as `add`, operands of one size, dtypes possibly mixed (autocast: an fp32
    residual plus a bf16 projection gives fp32), with the gradient cast to an operand's dtype
    inside the backward formula (``d<name>.cast``, one new tensor for that operand) rather
    than by ``validate_outputs`` afterwards: the Hugging Face graphs' order."""
    need = (tape.needs_grad(x), tape.needs_grad(y))

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        res: list = []
        for mine, want in zip((x, y), need, strict=True):
            if not want or g is None or mine is None:
                res.append(None)
            elif mine.itemsize == g.itemsize:
                res.append(tape.alias(g))
            else:
                res.append(tape.new(mine.numel, mine.itemsize, f"d{name}.cast"))
        return res

    n = tape.node("Add", rule, [x, y])
    itemsize = max(x.itemsize, y.itemsize if y is not None else 0)
    return tape.output(tape.new(x.numel, itemsize, name), n)


def scale(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x * c`` for a Python/Sym float c (``MulBackward1``: a wrapped number allocates no
    tensor): saves nothing; backward ``grad * c`` (one gradient-sized, ``d<name>``)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, g.itemsize, f"d{name}") if g is not None else None]

    n = tape.node("MulScalar", rule, [x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def unary(tape: Tape, x: Tensor, name: str, saves: str, bwd_temps: int = 0) -> Tensor:
    """An elementwise op (``silu``, ``gelu``, ``rsqrt``, ``neg``, ``exp``).

    ``saves``: "input", "output" or "none". Backward allocates ``bwd_temps`` same-size
    temporaries (freed at the end of the formula) and then the gradient.
    """

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        if g is None:
            return [None]
        temps = [tape.new(x.numel, x.itemsize, f"d{name}.tmp") for _ in range(bwd_temps)]
        out = tape.new(x.numel, x.itemsize, f"d{name}")
        tape.drop(*temps)
        return [out]

    out = tape.new(x.numel, x.itemsize, name)
    saved = {"input": [x], "output": [out], "none": []}[saves]
    n = tape.node(name, rule, [x], saved=saved)
    return tape.output(out, n)


def neg(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``-x``: saves nothing; backward ``grad.neg()``."""
    return unary(tape, x, name, saves="none")


def softmax(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``softmax``/``_safe_softmax`` on the last dimension: saves its output; backward
    ``_softmax_backward_data`` (one x-sized)."""
    return unary(tape, x, name, saves="output")


def _two_temporaries_backward(x: Tensor, name: str, first: str, second: str) -> BackwardRule:
    """A backward formula of two ``x``-sized temporaries (``<name>.<first>``, then
    ``<name>.<second>``) and the gradient ``d<name>``; the temporaries die after it, the
    second first (pow2's ``2 * x.pow(1)``, rsqrt's ``result.pow(3)`` product)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        a = tape.new(x.numel, x.itemsize, f"{name}.{first}")
        b = tape.new(x.numel, x.itemsize, f"{name}.{second}")
        out = tape.new(x.numel, x.itemsize, f"d{name}")
        tape.drop(b, a)
        return [out]

    return rule


def pow2(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x.pow(2)``: saves x; backward ``grad * (2 * x.pow(1))``: three same-size tensors."""

    n = tape.node("Pow", _two_temporaries_backward(x, name, "pow1", "x2"), [x], saved=[x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def rsqrt(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``rsqrt``: saves its result; backward ``-0.5 * grad * result.pow(3)``."""

    out = tape.new(x.numel, x.itemsize, name)
    n = tape.node("Rsqrt", _two_temporaries_backward(x, name, "pow3", "mul"), [x], saved=[out])
    return tape.output(out, n)


def mean_last(tape: Tape, x: Tensor, rows: Size, name: str) -> Tensor:
    """``x.mean(-1, keepdim=True)``: saves nothing; backward ``grad.expand(x) / n`` (one full)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, x.itemsize, f"d{name}")]

    n = tape.node("Mean", rule, [x])
    return tape.output(tape.new(rows, x.itemsize, name), n)


def masked_fill(tape: Tape, x: Tensor, mask: Tensor, name: str) -> Tensor:
    """Out-of-place ``x.masked_fill(mask, value)``: saves the mask; backward
    ``grad.masked_fill(mask, 0)`` (one x-sized)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, x.itemsize, f"d{name}") if g is not None else None]

    n = tape.node("MaskedFill", rule, [x], saved=[mask])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def dropout(tape: Tape, x: Tensor, name: str, device: str) -> Tensor:
    """``F.dropout(x, p)`` in training.

    CUDA: ``native_dropout`` returns the output and a bool mask (1 B/element), saving the mask;
    backward ``native_dropout_backward`` allocates the gradient. CPU (torch 2.13): composite,
    ``mask = empty_like(x).bernoulli_(1-p).div_(1-p)`` in x's dtype, then ``x * mask``
    (saves the mask); backward ``grad * mask``. Measured with the allocation trace.
    """

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, x.itemsize, f"d{name}")]

    if device == "cuda":  # the mask is an output: saved after the kernel ran
        out = tape.new(x.numel, x.itemsize, name)
        mask = tape.new(x.numel, 1, f"{name}.mask")
        n = tape.node("Dropout", rule, [x], saved=[mask])
    else:  # the mask is an input of ``mul``: saved before it runs
        mask = tape.new(x.numel, x.itemsize, f"{name}.mask")
        n = tape.node("Dropout", rule, [x], saved=[mask])
        out = tape.new(x.numel, x.itemsize, name)
    tape.drop(mask)
    return tape.output(out, n)
