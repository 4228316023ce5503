"""Tensor parallelism: what one rank of a Megatron-style column/row split holds and allocates.

The split (Shoeybi et al. 2019, "Megatron-LM", §3; PyTorch ``ColwiseParallel`` /
``RowwiseParallel`` in ``torch/distributed/tensor/parallel/style.py``, as torchtitan's
``parallelize_llama`` applies them):

* attention: ``q_proj``/``k_proj``/``v_proj`` are column-parallel: each rank holds
  ``n_heads / tp`` query heads and ``n_kv_heads / tp`` key/value heads (whole heads), and the
  attention core runs on those heads only; ``o_proj`` is row-parallel;
* MLP: ``gate_proj``/``up_proj`` column-parallel (``ffn / tp`` columns each), ``down_proj``
  row-parallel;
* embedding, norms and head stay replicated (every rank holds them whole), unless
  ``vocab_parallel``: the embedding's rows and the head's rows are split over the vocabulary
  (``RowwiseParallel`` embedding: masked local lookup, then an all-reduce of its ``[b*s, h]``
  output; ``ColwiseParallel`` head; ``loss_parallel`` cross entropy,
  `loss_parallel_cross_entropy`).

So a rank replays the single-GPU step of a model with ``n_heads / tp``, ``n_kv_heads / tp``
and ``ffn / tp`` (head_dim and hidden unchanged): `rank_model`. The communication adds
tensors the single-GPU step does not have (measured under verify's tracker on gloo,
torch 2.13, ``_c10d_functional.all_reduce`` = clone + in-place all-reduce):

* forward, after each row-parallel linear: the partial sum ``[b*s, h]`` and its all-reduced
  copy are both alive until the partial dies (``Partial -> Replicate`` redistribute in
  ``RowwiseParallel._prepare_output_fn``): `all_reduce`;
* backward, at each column-parallel linear's input: its partial input gradient
  ``[b*s, h]`` is all-reduced into a new tensor (``_FromTorchTensor.backward`` redistributes
  ``Partial -> Replicate``): `enter_column`. q, k and v (and gate and up) each do it: one
  all-reduce per linear, their results then summed as usual.

GPT-2's fused ``c_attn`` is not modelled: `rank_model` raises ``NotImplementedError``
naming it. Sequence parallelism (``sp=True``) keeps this rank model (the head's rows are
then split too: torchtitan's plan makes the head ``ColwiseParallel``) and replaces the
communication: `calc.parallel.sequence`, measured against PyTorch's ``SequenceParallel``
plan (with ``vocab_parallel`` too: the embedding's partial output reduce-scattered).
"""

from __future__ import annotations

from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism, check_divisibility
from calc.replay import ops
from calc.replay.tape import Node, Size, Tape, Tensor


def rank_model(model: ModelSpec, parallel: Parallelism) -> ModelSpec:
    """The model one tensor-parallel rank runs: ``n_heads / tp``, ``n_kv_heads / tp`` and
    ``ffn / tp`` (Shoeybi et al. 2019, §3: column-parallel q/k/v and MLP up-projections,
    row-parallel output projections), with hidden, head_dim, vocabulary and layers unchanged.

    Every per-rank term then follows from the single-GPU replay: the q/k/v/o and MLP weights,
    their gradients and optimizer states are ``1/tp`` of the model's, the attention core and
    the MLP activations are those of ``a/tp`` heads and ``f/tp`` columns, while the residual
    stream, the norms, the embedding and the logits stay whole (Korthikanti et al. 2022,
    Table 2, "tensor parallel" row: ``sbh(10 + 24/t + 5as/(ht))`` per layer: the 10 sbh are
    the replicated norm/residual/dropout activations).

    Raises ``ValueError`` (divisibility) and ``NotImplementedError`` for what is not modelled.
    """
    tp = parallel.tp
    if tp == 1:
        return model
    if model.model_type == "gpt2":
        raise NotImplementedError(
            "tensor parallelism of gpt2's fused c_attn is not modelled (llama family only)"
        )
    check_divisibility(model, parallel)  # whole heads, KV groups, MLP columns (and vocab rows)
    vocab = model.vocab
    if parallel.vocab_parallel:
        if model.tied_embeddings:
            raise NotImplementedError("a vocabulary-parallel tied embedding/head is not modelled")
        vocab //= tp
    return model.with_overrides(
        name=f"{model.name}/tp{tp}",
        n_heads=model.n_heads // tp,
        n_kv_heads=model.n_kv_heads // tp,
        ffn=model.ffn // tp,
        vocab=vocab,
    )


def enter_column(tape: Tape, x: Tensor) -> Tensor:
    """``DTensor.from_local(x, [Replicate()])`` before a column-parallel linear: a view in the
    forward; in the backward the partial input gradient is all-reduced into a new tensor
    (``_FromTorchTensor.backward``: ``Partial -> Replicate``, ``funcol.all_reduce`` clones),
    and the partial one is freed when the node ends."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(g.numel, g.itemsize, "tp.grad_all_reduce") if g is not None else None]

    n = tape.node("FromLocal", rule, [x])
    return tape.alias(x, n)


def all_reduce(tape: Tape, partial: Tensor, name: str) -> Tensor:
    """``Partial -> Replicate`` after a row-parallel linear: a new tensor (the all-reduced
    copy); its backward hands the gradient on unchanged (``Redistribute.backward`` keeps a
    replicated gradient replicated)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g) if g is not None else None]

    n = tape.node("Redistribute", rule, [partial])
    return tape.output(tape.new(partial.numel, partial.itemsize, name), n)


def column_linear(
    tape: Tape, x: Tensor, w: Tensor, bias: Tensor | None, rows: Size, out: Size, name: str
) -> Tensor:
    """``ColwiseParallel`` around ``F.linear``: from_local (`enter_column`), the local linear,
    ``to_local`` (a view)."""
    xi = enter_column(tape, x)
    y = ops.linear(tape, xi, w, bias, rows, out, name)
    tape.drop(xi)
    local = ops.view(tape, y)
    tape.drop(y)
    return local


def row_linear(
    tape: Tape, x: Tensor, w: Tensor, bias: Tensor | None, rows: Size, out: Size, name: str
) -> Tensor:
    """``RowwiseParallel`` around ``F.linear``: from_local (a view), the local linear (a
    partial sum), its all-reduce (`all_reduce`), ``to_local`` (a view)."""
    xi = ops.view(tape, x)
    y = ops.linear(tape, xi, w, bias, rows, out, name)
    tape.drop(xi)
    r = all_reduce(tape, y, f"{name}.all_reduce")
    tape.drop(y)
    local = ops.view(tape, r)
    tape.drop(r)
    return local


def loss_parallel_cross_entropy(
    tape: Tape, logits: Tensor, rows: Size, vocab: Size, itemsize: int
) -> Tensor:
    """``F.cross_entropy`` on vocabulary-sharded logits under ``loss_parallel()``
    (``torch/distributed/tensor/parallel/loss.py``): ``log_softmax`` [rows, V/tp] (its
    max/sum all-reduces run inside DTensor's dispatch) and ``nll_loss`` (loss and total_weight,
    0-d). Backward: ``_nll_loss_backward_handler`` returns the whole log-softmax gradient
    ``(grad_input + exp(x)) * grad_output`` [rows, V/tp]; ``_log_softmax_backward_handler``
    hands it on as it is (``grad_output.to(dtype)``, no copy). Intermediates made inside
    DTensor's dispatch are not seen by the CPU tracker."""
    if tape.autocast_itemsize:
        raise NotImplementedError("loss_parallel under autocast is not modelled")

    def lsm_rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g) if g is not None else None]

    logp = tape.new(logits.numel, itemsize, "logp")
    n = tape.node("LogSoftmax", lsm_rule, [logits], saved=[logp])
    tape.output(logp, n)

    def nll_rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(rows * vocab, itemsize, "dlogp")]

    loss = tape.new(1, itemsize, "loss")
    total_weight = tape.new(1, itemsize, "total_weight")
    n2 = tape.node("NllLoss", nll_rule, [logp], saved=[logp, total_weight])
    tape.drop(total_weight)
    tape.drop(logp)
    return tape.output(loss, n2)
