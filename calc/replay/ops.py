"""The ops the modelled code runs, each with what it allocates, saves and frees in backward.

Each function mirrors one ATen op and its entry in PyTorch's ``tools/autograd/derivatives.yaml``
(torch 2.13): which inputs or outputs autograd saves (only those the backward formula needs,
and only when the gradient they serve is required: ``should_compute_output`` guards), and which
tensors the backward formula allocates, in order. Temporaries of one C++ expression live until
its end. Views allocate nothing.
"""

from __future__ import annotations

import sympy as sp

from calc.replay.tape import Node, Size, Tape, Tensor


def _grad_like(tape: Tape, t: Tensor, name: str) -> Tensor:
    return tape.new(t.numel, t.itemsize, name)


def _rule_view(tape: Tape, node: Node, grads: list) -> list:
    """A view's backward: the incoming gradient viewed back, or copied when its layout cannot
    be viewed to the input's shape (``reshape`` of a transposed contiguous gradient clones)."""
    g = grads[0]
    if g is None:
        return [None]
    if node.info["copy_back"]:
        return [tape.new(g.numel, g.itemsize, "dview.clone")]
    return [tape.alias(g)]


def view(tape: Tape, x: Tensor, copy_back: bool = False) -> Tensor:
    """``view``/``transpose``/``flatten`` (same storage). ``copy_back``: the gradient reaching
    this view in backward has a layout that ``reshape`` must copy."""
    n = tape.node("View", _rule_view, [x], copy_back=copy_back)
    return tape.alias(x, n)


def to_dtype(tape: Tape, x: Tensor, itemsize: int, name: str) -> Tensor:
    """``x.to(dtype)`` (``_to_copy``): a new tensor; backward casts the gradient back."""
    if itemsize == x.itemsize:
        return tape.alias(x, x.grad_fn, x.out_index)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(g.numel, node.info["src_itemsize"], f"d{name}->src") if g else None]

    n = tape.node("ToCopy", rule, [x], src_itemsize=x.itemsize)
    return tape.output(tape.new(x.numel, itemsize, name), n)


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


def numel_ge(p: Size, q: Size) -> bool:
    """``p >= q`` for sizes; symbolic sizes are compared at a generic point (every symbol 7):
    broadcasting is structural, so the larger operand is larger at any non-degenerate point."""
    if isinstance(p, int) and isinstance(q, int):
        return p >= q
    point = {sym: 7 for sym in (sp.sympify(p) - sp.sympify(q)).free_symbols}
    return bool(sp.sympify(p).subs(point) >= sp.sympify(q).subs(point))


def add(
    tape: Tape, x: Tensor, y: Tensor | None, name: str, out_numel: Size | None = None
) -> Tensor:
    """``x + y`` (y may be a Python scalar: None). Saves nothing; backward hands the same
    gradient to both operands (reduced with ``sum_to_size`` for a broadcast one)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g) if need and g is not None else None for need in node.info["need"]]

    need = (tape.needs_grad(x), tape.needs_grad(y))
    n = tape.node("Add", rule, [x, y], need=need)
    numel = out_numel if out_numel is not None else x.numel
    itemsize = max(x.itemsize, y.itemsize if y is not None else 0)
    return tape.output(tape.new(numel, itemsize, name), n)


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


def pow2(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x.pow(2)``: saves x; backward ``grad * (2 * x.pow(1))``: three same-size tensors."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        p1 = tape.new(x.numel, x.itemsize, f"{name}.pow1")
        two = tape.new(x.numel, x.itemsize, f"{name}.x2")
        out = tape.new(x.numel, x.itemsize, f"d{name}")
        tape.drop(two, p1)
        del g
        return [out]

    n = tape.node("Pow", rule, [x], saved=[x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def rsqrt(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``rsqrt``: saves its result; backward ``-0.5 * grad * result.pow(3)``."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        p3 = tape.new(x.numel, x.itemsize, f"{name}.pow3")
        m = tape.new(x.numel, x.itemsize, f"{name}.mul")
        out = tape.new(x.numel, x.itemsize, f"d{name}")
        tape.drop(m, p3)
        return [out]

    out = tape.new(x.numel, x.itemsize, name)
    n = tape.node("Rsqrt", rule, [x], saved=[out])
    return tape.output(out, n)


def mean_last(tape: Tape, x: Tensor, rows: Size, name: str) -> Tensor:
    """``x.mean(-1, keepdim=True)``: saves nothing; backward ``grad.expand(x) / n`` (one full)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, x.itemsize, f"d{name}")]

    n = tape.node("Mean", rule, [x])
    return tape.output(tape.new(rows, x.itemsize, name), n)


def linear(
    tape: Tape,
    x: Tensor,
    w: Tensor,
    bias: Tensor | None,
    rows: Size,
    out_features: Size,
    name: str,
) -> Tensor:
    """``F.linear(x, w, b)`` on a contiguous input, as ``mm``/``addmm`` on its 2-D view.

    Saves the input (for the weight's gradient) and the weight (for the input's gradient).
    Backward allocates the weight gradient, the input gradient and the bias gradient
    (``grad.sum(0)``); ``mm_mat2_backward`` gives the weight gradient in the weight's layout.
    """
    hook = tape.linear_hooks.get(id(w.storage))
    if (
        hook is not None
    ):  # LoRA-adapted or quantized weight (calc.compress.lora, calc.compress.quant)
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
        gb = tape.new(bias.numel, bias.itemsize, f"d{bias.name}") if need_b else None
        return [gx, gw, gb]

    need_b = tape.needs_grad(bias)
    n = tape.node(
        "Linear", rule, [x, w, bias], saved=[x if need_w else None, w if need_x else None]
    )
    return tape.output(tape.new(rows * out_features, x.itemsize, name), n)


def autocast_cast(tape: Tape, t: Tensor, name: str) -> Tensor:
    """Autocast's cast of an op input to the lower precision: parameters (leaves that need
    grad) through the per-context cache (``cached_casts``, cleared on autocast exit), other
    tensors every time; a tensor already in that dtype is used as it is."""
    ac = tape.autocast_itemsize
    if t.itemsize == ac:
        return tape.alias(t, t.grad_fn, t.out_index)
    if t.leaf:
        hit = tape.autocast_cache.get(id(t.storage))
        if hit is None:
            hit = to_dtype(tape, t, ac, f"{t.name}.cast")
            tape.autocast_cache[id(t.storage)] = hit
        return tape.alias(hit, hit.grad_fn, hit.out_index)
    return to_dtype(tape, t, ac, name)


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
    saved_autocast, tape.autocast_itemsize = tape.autocast_itemsize, 0
    out = linear(tape, cx, cw, cb, rows, out_features, name)
    tape.autocast_itemsize = saved_autocast
    tape.drop(cw, cx, cb)
    return out


def embedding(
    tape: Tape, w: Tensor, rows: Size, hidden: Size, name: str, indices: Tensor | None = None
) -> Tensor:
    """``F.embedding``: saves the indices (``indices``, when the replay allocated them);
    backward ``embedding_dense_backward`` allocates a dense gradient of the table."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(w.numel, w.itemsize, f"d{w.name}")]

    n = tape.node("Embedding", rule, [w], saved=[indices])
    return tape.output(tape.new(rows * hidden, w.itemsize, name), n)


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


def layer_norm(tape: Tape, x: Tensor, w: Tensor, bias: Tensor | None, rows: Size) -> Tensor:
    """``native_layer_norm``: output, fp32 mean and rstd [rows]; saves input, mean, rstd
    (and the affine weight/bias). Backward ``native_layer_norm_backward``: dx, dw, db."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        gx = tape.new(x.numel, x.itemsize, "dln.in") if tape.needs_grad(x) else None
        gw = tape.new(w.numel, w.itemsize, "dln.w")
        gb = tape.new(bias.numel, bias.itemsize, "dln.b") if bias is not None else None
        return [gx, gw, gb]

    out = tape.new(x.numel, x.itemsize, "ln.out")
    mean = tape.new(rows, 4, "ln.mean")
    rstd = tape.new(rows, 4, "ln.rstd")
    n = tape.node("LayerNorm", rule, [x, w, bias], saved=[x, mean, rstd])
    tape.drop(mean, rstd)
    return tape.output(out, n)


def split3(tape: Tape, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``x.split(n, -1)`` into three views; backward concatenates the three gradients."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, x.itemsize, "dsplit")]

    n = tape.node("Split", rule, [x], n_outputs=3)
    third = x.numel / 3
    return tuple(tape.alias(x, n, i, numel=third) for i in range(3))  # type: ignore[return-value]


def chunk2(tape: Tape, x: Tensor) -> tuple[Tensor, Tensor]:
    """``x.chunk(2, -1)``: two views; backward concatenates the two gradients (one full)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, x.itemsize, "dchunk")]

    n = tape.node("Split", rule, [x], n_outputs=2)
    half = x.numel / 2
    return tape.alias(x, n, 0, numel=half), tape.alias(x, n, 1, numel=half)


def neg(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``-x``: saves nothing; backward ``grad.neg()``."""
    return unary(tape, x, name, saves="none")


def cat2(tape: Tape, x: Tensor, y: Tensor, name: str) -> Tensor:
    """``torch.cat((x, y), -1)``: backward hands each input a narrowed view of the gradient."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g, numel=x.numel), tape.alias(g, numel=y.numel)]

    n = tape.node("Cat", rule, [x, y])
    return tape.output(tape.new(x.numel + y.numel, x.itemsize, name), n)


def sdpa_flash(tape: Tape, q: Tensor, k: Tensor, v: Tensor, lse_numel: Size, name: str) -> Tensor:
    """Flash-style SDPA: output like q, fp32 logsumexp [b, a, s]; saves q, k, v, out, lse.

    Backward allocates dq, dk, dv (``_scaled_dot_product_flash_attention_for_cpu_backward``,
    ``_flash_attention_backward``); kernel-internal buffers are not tensors.
    """

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [
            tape.new(q.numel, q.itemsize, "dq"),
            tape.new(k.numel, k.itemsize, "dk"),
            tape.new(v.numel, v.itemsize, "dv"),
        ]

    out = tape.new(q.numel, q.itemsize, name)
    lse = tape.new(lse_numel, 4, f"{name}.lse")
    n = tape.node("SDPA", rule, [q, k, v], saved=[q, k, v, out, lse])
    tape.drop(lse)
    return tape.output(out, n)


def cross_entropy(tape: Tape, logits: Tensor, rows: Size, vocab: Size, itemsize: int) -> Tensor:
    """``F.cross_entropy`` = ``log_softmax`` (saves its output) + ``nll_loss``.

    ``nll_loss_forward`` returns the loss and ``total_weight`` (both 0-d; NllLossBackward saves
    total_weight). Backward: ``nll_loss_backward`` [N, V], then ``_log_softmax_backward_data``.
    """
    up = None
    if tape.autocast_itemsize:  # cross_entropy runs in fp32 under autocast: one cast copy
        up = to_dtype(tape, logits, 4, "logits.float")
        logp = _log_softmax(tape, up, 4)
    else:
        logp = _log_softmax(tape, logits, itemsize)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(rows * vocab, logp.itemsize, "dlogp")]

    loss = tape.new(1, logp.itemsize, "loss")
    total_weight = tape.new(1, logp.itemsize, "total_weight")
    n = tape.node("NllLoss", rule, [logp], saved=[logp, total_weight])
    tape.drop(total_weight)
    tape.drop(logp, up)
    return tape.output(loss, n)


def _log_softmax(tape: Tape, x: Tensor, itemsize: int) -> Tensor:
    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, out_itemsize, "dlogits")]

    out_itemsize = itemsize
    out = tape.new(x.numel, itemsize, "logp")
    n = tape.node("LogSoftmax", rule, [x], saved=[out])
    return tape.output(out, n)
