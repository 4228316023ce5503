"""Dtype casts, plain and under ``torch.autocast`` (torch 2.13).

One autocast model for every graph: `autocast_cast` casts an op input to the autocast dtype,
parameters (leaves that need grad) once per autocast context through the tape's cast cache
(``cached_casts`` in ``aten/src/ATen/autocast_mode.cpp``, cleared on exit: `Tape.autocast_exit`),
other tensors at every call.
"""

from __future__ import annotations

from calc.replay.tape import Node, Tape, Tensor


def to_dtype(tape: Tape, x: Tensor, itemsize: int, name: str, grad_suffix: str = "->src") -> Tensor:
    """``x.to(dtype)``: a view of ``x`` when the dtype already matches, else ``_to_copy`` (a new
    tensor ``name``); backward casts the gradient back, ``d<name><grad_suffix>`` (the graphs
    of `calc.models.reference` and of Hugging Face name it differently: ``"->src"`` and
    ``""``)."""
    if itemsize == x.itemsize:
        return tape.alias(x, x.grad_fn, x.out_index)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        if g is None:
            return [None]
        return [tape.new(g.numel, node.info["src_itemsize"], f"d{name}{grad_suffix}")]

    n = tape.node("ToCopy", rule, [x], src_itemsize=x.itemsize)
    return tape.output(tape.new(x.numel, itemsize, name), n)


def autocast_cast(
    tape: Tape,
    t: Tensor,
    name: str,
    leaf_name: str | None = None,
    grad_suffix: str = "->src",
    cache_any: bool = False,
) -> Tensor:
    """Autocast's cast of an op input to the lower precision (``tape.autocast_itemsize``).

    A parameter (a leaf that needs grad) is cast once per autocast context and cached
    (``leaf_name``, default ``<t.name>.cast``); any other tensor is cast at every call
    (``name``); a tensor already in that dtype is used as it is. The caller holds (and drops)
    what is returned; the cache keeps its own reference until `Tape.autocast_exit`.
    ``grad_suffix``: as `to_dtype`'s. ``cache_any``: cache the cast even when ``t`` is not a
    leaf that needs grad (the Hugging Face GPT-2 graph holds its ``Conv1D`` parameter casts
    until autocast exits whatever they are: a pruned weight, a frozen bias)."""
    ac = tape.autocast_itemsize
    if t.itemsize == ac:
        return tape.alias(t, t.grad_fn, t.out_index)
    if t.leaf or cache_any:
        hit = tape.autocast_cache.get(id(t.storage))
        if hit is None:
            cached_name = f"{t.name}.cast" if leaf_name is None else leaf_name
            hit = to_dtype(tape, t, ac, cached_name, grad_suffix)
            tape.autocast_cache[id(t.storage)] = hit
        return tape.alias(hit, hit.grad_fn, hit.out_index)
    return to_dtype(tape, t, ac, name, grad_suffix)
