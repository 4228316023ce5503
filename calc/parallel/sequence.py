"""Sequence parallelism: the communication tensors of PyTorch's ``SequenceParallel`` plan.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
§4.2.2, Table 2 row "tensor + sequence parallel": ``sbh(34/t + 5as/(ht))`` per layer) split the
norms, dropouts and residual stream over the sequence (``[b, s/t, h]`` per rank) and count the
all-gathered input of the column-parallel linears as ``sbh/t`` (Megatron-LM keeps the local
shard and all-gathers it again in the backward). PyTorch's plan (torchtitan's
``parallelize_llama``: ``SequenceParallel`` norms, ``PrepareModuleInput(Shard(1) ->
Replicate)`` before attention and MLP, ``RowwiseParallel(output_layouts=Shard(1))``), measured
under verify's tracker on gloo (torch 2.13, case ``tp2-sp``), differs:

* `gather`: ``all_gather_into_tensor`` gathers along dim 0 into ``[t*b, s/t, h]``, then
  ``split`` + ``cat`` rebuild ``[b, s, h]``: two full-size tensors at once, the buffer freed
  after the ``cat``; the ``cat`` output is what q/k/v (gate/up, the head) save, **whole**:
  ``sbh`` per gathered input, not ``sbh/t``;
* `reduce_scatter` after a row-parallel linear: a ``cat`` copy of the partial ``[b*s, h]``
  (the chunks along dim 1 made contiguous along dim 0), then the ``[b, s/t, h]`` result; both
  the copy and the partial die at once;
* `local_slice`: the replicated embedding's ``[b, s, h]`` output cut to the local sequence by
  a ``clone`` (``Replicate -> Shard(1)``), the full output then freed.

Backward (same trace): a gather's gradient is the local chunk of the full gradient (a
``clone``) when the gather ran in ``PrepareModuleInput`` (the column linears then all-reduce
their input gradients as without sp, `calc.parallel.tensor.enter_column`), or a reduce-scatter
(``cat`` copy, then the local result) when it ran inside the head's ``ColwiseParallel``
(``input_layouts=Shard(1)``: ``Partial -> Shard(1)``); a reduce-scatter's gradient and the
embedding slice's gradient are all-gathers (buffer, then ``cat``). One lifetime is the
gloo's: in the backward an all-gather buffer can outlive its ``cat`` until gloo's worker
thread drops the work object (verify/cases/model_parallel.py, "gloo's late release"); the
replay frees it after the ``cat``, as in the forward.
"""

from __future__ import annotations

import sympy as sp

from calc.replay import ops
from calc.replay.tape import Node, Size, Tape, Tensor


def _all_gathered(tape: Tape, numel: Size, itemsize: int, name: str) -> Tensor:
    """``all_gather_into_tensor`` then ``cat``: the buffer dies once the ``cat`` exists."""
    buf = tape.new(numel, itemsize, f"{name}.all_gather")
    out = tape.new(numel, itemsize, name)
    tape.drop(buf)
    return out


def gather(tape: Tape, x: Tensor, full_numel: Size, name: str, *, grad: str = "slice") -> Tensor:
    """``Shard(1) -> Replicate`` of ``x`` (``[b, s/t, ...]`` -> ``[b, s, ...]``, ``full_numel``
    elements): a new full-size tensor via `_all_gathered`. Backward: ``grad="slice"``: the
    local chunk of the (already all-reduced) gradient, a ``clone``; ``grad="reduce_scatter"``:
    ``Partial -> Shard(1)``: a ``cat`` copy of the gradient, then the local result."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        if g is None:
            return [None]
        if grad == "slice":
            return [tape.new(x.numel, g.itemsize, f"{name}.grad_slice")]
        copy = tape.new(g.numel, g.itemsize, f"{name}.grad_rs_copy")
        out = tape.new(x.numel, g.itemsize, f"{name}.grad_reduce_scatter")
        tape.drop(copy)
        return [out]

    n = tape.node("SpGather", rule, [x])
    return tape.output(_all_gathered(tape, full_numel, x.itemsize, name), n)


def reduce_scatter(tape: Tape, partial: Tensor, local_numel: Size, name: str) -> Tensor:
    """``Partial -> Shard(1)`` after a row-parallel linear: a ``cat`` copy of the partial sum,
    then the ``[b, s/t, h]`` result (the copy dies at once; the caller drops the partial).
    Backward: the gradient all-gathered to full size (`_all_gathered`)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        if g is None:
            return [None]
        return [_all_gathered(tape, partial.numel, g.itemsize, f"{name}.grad_all_gather")]

    copy = tape.new(partial.numel, partial.itemsize, f"{name}.rs_copy")
    n = tape.node("SpReduceScatter", rule, [partial])
    out = tape.output(tape.new(local_numel, partial.itemsize, name), n)
    tape.drop(copy)
    return out


def local_slice(tape: Tape, full: Tensor, local_numel: Size, name: str) -> Tensor:
    """``Replicate -> Shard(1)`` of a replicated tensor: a ``clone`` of the local sequence
    chunk. Backward: the local gradient all-gathered to full size (`_all_gathered`)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        if g is None:
            return [None]
        return [_all_gathered(tape, full.numel, g.itemsize, f"{name}.grad_all_gather")]

    n = tape.node("SpSlice", rule, [full])
    return tape.output(tape.new(local_numel, full.itemsize, name), n)


def row_linear(
    tape: Tape, x: Tensor, w: Tensor, bias: Tensor | None, rows: Size, out: Size, name: str,
    tp: int,
) -> Tensor:  # fmt: skip
    """``RowwiseParallel(output_layouts=Shard(1))`` around ``F.linear``: the local linear (a
    partial ``[rows, out]`` sum), then `reduce_scatter` to ``[rows / tp, out]``."""
    xi = ops.view(tape, x)
    y = ops.linear(tape, xi, w, bias, rows, out, name)
    tape.drop(xi)
    r = reduce_scatter(tape, y, sp.sympify(rows * out) / tp, f"{name}.reduce_scatter")
    tape.drop(y)
    return r


def vocab_embedding(tape: Tape, w: Tensor, rows: Size, hidden: Size, name: str, tp: int) -> Tensor:
    """The vocabulary-parallel embedding (``RowwiseParallel(output_layouts=Shard(1))``): the
    masked local lookup ``[rows, hidden]`` as `calc.replay.ops.embedding`, but its gradient is the
    size of the *whole* table, ``tp`` times the rank's ``[V/tp, h]`` share, and it is what
    ``.grad`` keeps until ``zero_grad`` (measured: ``embedding_dense_backward`` allocates
    ``[V, h]`` on every rank of tp2-sp-vocab-parallel and tp4-sp-vocab-parallel; DTensor's
    sharding propagation of the backward, after the all-gathered sequence gradient, picks a
    strategy with a partial whole-table gradient; without sp the gradient is the share)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(w.numel * tp, w.itemsize, f"d{w.name}.whole_table")]

    n = tape.node("Embedding", rule, [w])
    if n is not None:  # no node with grad mode off
        n.info["in_meta"] = None  # the whole-table gradient is not reduced to the share
    tape.grad_any_size.add(id(w.storage))
    return tape.output(tape.new(rows * hidden, w.itemsize, name), n)
