"""Views, copies and joins: ops that move or reshape data (torch 2.13).

A view allocates nothing and shares its base's storage; its backward hands the gradient on
(viewed back, or copied when ``reshape`` cannot view it). Copies (``clone``, ``cat``) allocate
their output.
"""

from __future__ import annotations

from calc.replay.tape import Node, Size, Tape, Tensor, divide


def _pass_rule(tape: Tape, node: Node, grads: list) -> list:
    """Backward of a view, a same-size ``expand`` or a ``clone``: the gradient handed on."""
    g = grads[0]
    return [tape.alias(g) if g is not None else None]


def _view_rule(tape: Tape, node: Node, grads: list) -> list:
    """A view's backward: the incoming gradient viewed back, or copied when its layout cannot
    be viewed to the input's shape (``reshape`` of a transposed contiguous gradient clones)."""
    g = grads[0]
    if g is None:
        return [None]
    if node.info["copy_back"]:
        return [tape.new(g.numel, g.itemsize, "dview.clone")]
    return [tape.alias(g)]


def view(
    tape: Tape,
    x: Tensor,
    copy_back: bool = False,
    numel: Size | None = None,
    name: str = "View",
) -> Tensor:
    """``view``/``transpose``/``flatten``/``unsqueeze``/a viewable ``reshape``/a same-size
    ``expand`` (same storage; ``numel`` when it differs from x's). ``copy_back``: the gradient
    reaching this view in backward has a layout that ``reshape`` must copy. ``name`` names the
    autograd node only."""
    if copy_back:
        n = tape.node(name, _view_rule, [x], copy_back=True)
    else:
        n = tape.node(name, _pass_rule, [x])
    return tape.alias(x, n, numel=numel)


def clone(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x.clone(memory_format=contiguous)`` (also ``contiguous()``/``reshape`` of a layout that
    cannot be viewed: ``CloneBackward0`` + ``UnsafeViewBackward0``): a new tensor; backward
    hands the gradient on."""
    n = tape.node("Clone", _pass_rule, [x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def expand(tape: Tape, x: Tensor, numel: Size, name: str) -> Tensor:
    """A broadcasting ``expand`` to ``numel`` elements (a view); backward ``sum_to_size``
    allocates a gradient of x's size, ``d<name>``."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, g.itemsize, f"d{name}") if g is not None else None]

    n = tape.node("Expand", rule, [x])
    return tape.alias(x, n, numel=numel)


def repeat_interleave(tape: Tape, x: Tensor, numel: Size, name: str) -> Tensor:
    """``x.repeat_interleave(groups, dim=1)`` (``Repeat.cpp``): ``unsqueeze(2)``, ``expand``
    over the groups, ``clone(contiguous)``, ``flatten(1, 2)``. Backward: the expand's
    ``sum_to_size`` over the repeat dimension (one x-sized gradient)."""
    u = view(tape, x, name="Unsqueeze")
    e = expand(tape, u, numel, f"{name}.expand")
    tape.drop(u)
    c = clone(tape, e, name)
    tape.drop(e)
    out = view(tape, c, name="Flatten")
    tape.drop(c)
    return out


def slice_half(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x[..., :d//2]`` or ``x[..., d//2:]``: `slice_last` of half the elements."""
    return slice_last(tape, x, divide(x.numel, 2), name)


def slice_last(tape: Tape, x: Tensor, numel: Size, name: str) -> Tensor:
    """A slice of the last dimension holding ``numel`` of ``x``'s elements: a view; backward
    ``slice_backward`` allocates a zero-filled tensor of the input's size and copies the
    gradient into it."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, g.itemsize, f"d{name}.slice") if g is not None else None]

    n = tape.node("Slice", rule, [x])
    return tape.alias(x, n, numel=numel)


def split3(tape: Tape, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``x.split(n, -1)`` into three views; backward concatenates the three gradients."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, x.itemsize, "dsplit")]

    n = tape.node("Split", rule, [x], n_outputs=3)
    third = divide(x.numel, 3)
    return (
        tape.alias(x, n, 0, numel=third),
        tape.alias(x, n, 1, numel=third),
        tape.alias(x, n, 2, numel=third),
    )


def chunk2(tape: Tape, x: Tensor) -> tuple[Tensor, Tensor]:
    """``x.chunk(2, -1)``: two views; backward concatenates the two gradients (one full)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, x.itemsize, "dchunk")]

    n = tape.node("Split", rule, [x], n_outputs=2)
    half = divide(x.numel, 2)
    return tape.alias(x, n, 0, numel=half), tape.alias(x, n, 1, numel=half)


def cat2(tape: Tape, x: Tensor, y: Tensor, name: str) -> Tensor:
    """``torch.cat((x, y), -1)``: backward hands each input a narrowed view of the gradient."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g, numel=x.numel), tape.alias(g, numel=y.numel)]

    n = tape.node("Cat", rule, [x, y])
    return tape.output(tape.new(x.numel + y.numel, x.itemsize, name), n)


def cat_onto_empty(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``torch.cat([empty, x], dim=-2)`` (``DynamicLayer.update`` on a fresh cache): a full copy
    of ``x``; backward hands ``x`` a narrowed view of the gradient (no allocation)."""
    n = tape.node("Cat", _pass_rule, [x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def plain(tape: Tape, numel: Size, itemsize: int, name: str) -> Tensor:
    """A tensor outside autograd (position ids, labels, masks): allocated, no node."""
    return tape.new(numel, itemsize, name)
