"""The attention core of verify/models/reference.py without a fused kernel, as a replay.

Two cores, each given q [b, a, s, d] and k, v [b, k, s, d] as the model hands them over:

* `math_sdpa`: ``F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal=True,
  enable_gqa=...)`` run by SDPA's math backend, ``_scaled_dot_product_attention_math``
  (``aten/src/ATen/native/transformers/attention.cpp``, torch 2.13), a composite of ATen ops:
  fp16/bf16 inputs upcast to fp32, ``q * sqrt(scale)``, the causal mask as
  ``ones(s, s, bool).tril()`` turned additive by ``where(mask, 0.0, scalar_tensor(-inf))``,
  GQA's ``repeat_interleave`` of k and v, ``matmul(q, k^T * sqrt(scale))``, ``add`` of the mask,
  ``_safe_softmax``, ``dropout``, ``matmul(attn, v)`` and the cast back to the input dtype;
* `eager`: ``Attention._eager_attention``: ``repeat_interleave`` for GQA,
  ``(q @ k^T) * scale``, ``masked_fill`` of ``ones(s, s, bool).triu(1)``, ``softmax``,
  ``F.dropout`` and ``probs @ v``.

Both return the ``[b, a, s, d]`` tensor that is contiguous in that order (the view of the last
``bmm``), so the model's ``out.transpose(1, 2).reshape(b, s, a * d)`` copies: `merge_heads`.

``matmul`` of two 4-D tensors folds the batch dimensions: ``expand`` (same size here) and
``reshape`` of each operand to 3-D (a copy, ``clone`` + ``_unsafe_view``, when its strides do not
allow a view), ``bmm``, and ``_unsafe_view`` of the result back to 4-D. Whether a reshape copies
depends on the layout, which the replay does not track: every q, k, v the model passes in is a
transposed view of a ``[b, s, heads, d]`` tensor (projections, their split views, RoPE and q/k
norm outputs, which keep their input's strides), so none of them is contiguous in
``[b, heads, s, d]``; ``repeat_interleave``'s ``clone`` is. ``contiguous=True`` replays inputs
that are.

All sizes may be sympy expressions; the structural choice (GQA or not) comes from ``gqa`` or
from the shape: ``sh.gqa`` when it has one, else ``sh.a != sh.k`` when those are numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy as sp

from calc.replay import ops
from calc.replay.tape import Node, Size, Tape, Tensor

if TYPE_CHECKING:  # reference.py calls this module
    from calc.models.reference import Shape

FP32 = 4
MASK_ITEMSIZE = 1  # torch.bool
SCALAR_ITEMSIZE = 4  # the 0-d ``scalar_tensor`` of the mask's fill values (one 512-byte block)


# -- small ops --------------------------------------------------------------------------------
def _pass_rule(tape: Tape, node: Node, grads: list) -> list:
    """Backward of a view, a same-size ``expand`` or a ``clone``: the gradient handed on."""
    g = grads[0]
    return [tape.alias(g) if g is not None else None]


def view(tape: Tape, x: Tensor, numel: Size | None = None, name: str = "View") -> Tensor:
    """A view (``transpose``, ``unsqueeze``, ``flatten``, a viewable ``reshape``, a same-size
    ``expand``) whose backward hands the gradient on without a copy."""
    n = tape.node(name, _pass_rule, [x])
    return tape.alias(x, n, numel=numel)


def clone(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x.clone(memory_format=contiguous)``: a new tensor; backward hands the gradient on."""
    n = tape.node("Clone", _pass_rule, [x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def expand(tape: Tape, x: Tensor, numel: Size, name: str) -> Tensor:
    """A broadcasting ``expand`` to ``numel`` elements; backward ``sum_to_size`` allocates a
    gradient of x's size."""

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


def scale(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x * c`` for a Python/Sym float c (``mul`` with a wrapped number, which allocates no
    tensor): saves nothing; backward ``grad * c`` (one gradient-sized)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, x.itemsize, f"d{name}") if g is not None else None]

    n = tape.node("MulScalar", rule, [x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def masked_fill(tape: Tape, x: Tensor, mask: Tensor, name: str) -> Tensor:
    """Out-of-place ``x.masked_fill(mask, value)``: saves the mask; backward
    ``grad.masked_fill(mask, 0)`` (one x-sized)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, x.itemsize, f"d{name}") if g is not None else None]

    n = tape.node("MaskedFill", rule, [x], saved=[mask])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def softmax(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``softmax``/``_safe_softmax`` on the last dimension: saves its output; backward
    ``_softmax_backward_data`` (one x-sized)."""
    return ops.unary(tape, x, name, saves="output")


def bmm(tape: Tape, x: Tensor, y: Tensor, out_numel: Size, name: str) -> Tensor:
    """``x.bmm(y)``: saves y for x's gradient and x for y's. Backward (traced order): y's
    gradient ``x^T.bmm(grad)``, then x's ``grad.bmm(y^T)``."""
    need_x, need_y = tape.needs_grad(x), tape.needs_grad(y)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        gy = tape.new(y.numel, y.itemsize, f"d{name}.mat2") if need_y and g is not None else None
        gx = tape.new(x.numel, x.itemsize, f"d{name}.self") if need_x and g is not None else None
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
    res = ops.view(tape, out, copy_back=grad_copy)
    tape.drop(out, yr, xr)
    return res


def causal_bias(tape: Tape, s: Size, itemsize: int, name: str) -> Tensor:
    """``convert_boolean_attn_mask(ones(s, s, bool).tril(), dtype)``: ``where(mask, 0.0,
    scalar_tensor(-inf))`` with both fill values as 0-d tensors; no autograd."""
    ones = tape.new(s * s, MASK_ITEMSIZE, f"{name}.ones")
    tril = tape.new(s * s, MASK_ITEMSIZE, f"{name}.tril")
    tape.drop(ones)
    neg_inf = tape.new(1, SCALAR_ITEMSIZE, f"{name}.neg_inf")
    zero = tape.new(1, SCALAR_ITEMSIZE, f"{name}.zero")
    bias = tape.new(s * s, itemsize, name)
    tape.drop(zero, neg_inf, tril)
    return bias


def _is_gqa(sh: Shape, gqa: bool | None) -> bool:
    if gqa is not None:
        return gqa
    flag = getattr(sh, "gqa", None)
    if flag is not None:
        return bool(flag)
    diff = sp.sympify(sh.a - sh.k)
    if diff.is_number:
        return bool(diff != 0)
    raise ValueError("symbolic heads: pass gqa= (n_kv_heads != n_heads) to the attention core")


# -- the two cores ----------------------------------------------------------------------------
def math_sdpa(
    tape: Tape,
    sh: Shape,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    name: str,
    gqa: bool | None = None,
    contiguous: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, dropout_p=sh.attn_dropout, is_causal=True,
    enable_gqa=gqa)`` through ``_scaled_dot_product_attention_math``.

    Forward, in order: fp16/bf16 q, k, v cast to fp32 (``query_acc``, ``key_acc``,
    ``value_acc``); ``query = query_acc * sqrt(scale)``; the additive causal mask; k and v
    repeated for GQA; ``attn = matmul(query, key^T * sqrt(scale))`` (``key^T * sqrt(scale)`` is
    a temporary: freed after the matmul unless bmm saved it); ``attn = attn.add(mask)``;
    ``_safe_softmax``; ``dropout``; ``attn.to(dtype)`` (the tuple's second element, evaluated
    first) and ``matmul(attn, value).to(dtype)``. Then the kernel's locals die (repeated k and
    v, query, mask, the fp32 casts) and, at the end of SDPA's return, the second element.
    The caller keeps q, k, v.
    """
    b, s, a, d = sh.b, sh.s, sh.a, sh.d
    repeat = _is_gqa(sh, gqa)
    out_itemsize = q.itemsize
    upcast = q.itemsize < FP32
    if upcast:
        qa = ops.to_dtype(tape, q, FP32, f"{name}.q32")
        ka = ops.to_dtype(tape, k, FP32, f"{name}.k32")
        va = ops.to_dtype(tape, v, FP32, f"{name}.v32")
    else:
        qa, ka, va = q, k, v
    query = scale(tape, qa, f"{name}.q_scaled")
    bias = causal_bias(tape, s, qa.itemsize, f"{name}.mask")
    if repeat:
        key = repeat_interleave(tape, ka, b * a * s * d, f"{name}.k_rep")
        value = repeat_interleave(tape, va, b * a * s * d, f"{name}.v_rep")
        kv_contiguous = True
    else:
        key, value, kv_contiguous = ka, va, contiguous
    kt = view(tape, key, name="Transpose")
    ks = scale(tape, kt, f"{name}.k_scaled")
    tape.drop(kt)
    scores = matmul(tape, query, contiguous, ks, kv_contiguous, b * a * s * s, f"{name}.qk", False)
    tape.drop(ks)
    biased = ops.add(tape, scores, bias, f"{name}.scores")
    tape.drop(scores)
    attn = softmax(tape, biased, f"{name}.probs")
    tape.drop(biased)
    if sh.attn_dropout > 0:
        dropped = ops.dropout(tape, attn, f"{name}.probs_drop", sh.device)
        tape.drop(attn)
        attn = dropped
    second = ops.to_dtype(tape, attn, out_itemsize, f"{name}.probs_out") if upcast else None
    out = matmul(tape, attn, True, value, kv_contiguous, b * a * s * d, f"{name}.pv", True)
    if upcast:
        cast = ops.to_dtype(tape, out, out_itemsize, f"{name}.out")
        tape.drop(out)
        out = cast
    # The kernel's locals, last declared first: attn, (key, value), query, the mask, the casts.
    tape.drop(attn)
    if repeat:
        tape.drop(key, value)
    tape.drop(query, bias)
    if upcast:
        tape.drop(va, ka, qa)
    tape.drop(second)
    return out


def eager(
    tape: Tape,
    sh: Shape,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    name: str,
    gqa: bool | None = None,
    contiguous: bool = False,
) -> Tensor:
    """``_eager_attention(q, k, v, sh.attn_dropout)`` of verify/models/reference.py.

    Forward, in order: GQA's ``repeat_interleave`` of k then v; ``q @ k.transpose(-2, -1)``
    (q's fold copies; so does k^T's without GQA); ``* (1/sqrt(d))``, the product freed;
    ``ones(s, s, bool).triu(1)`` (the ones freed); ``masked_fill`` (saves the mask), the scaled
    scores freed; ``softmax`` (saves its output); ``F.dropout``; ``probs @ v``. Returning frees
    the function's locals: the repeated k and v (saved by the bmms), the masked scores."""
    b, s, a, d = sh.b, sh.s, sh.a, sh.d
    repeat = _is_gqa(sh, gqa)
    if repeat:
        key = repeat_interleave(tape, k, b * a * s * d, f"{name}.k_rep")
        value = repeat_interleave(tape, v, b * a * s * d, f"{name}.v_rep")
        kv_contiguous = True
    else:
        key, value, kv_contiguous = k, v, contiguous
    kt = view(tape, key, name="Transpose")
    prod = matmul(tape, q, contiguous, kt, kv_contiguous, b * a * s * s, f"{name}.qk", False)
    tape.drop(kt)
    scores = scale(tape, prod, f"{name}.scaled")
    tape.drop(prod)
    ones = tape.new(s * s, MASK_ITEMSIZE, f"{name}.ones")
    mask = tape.new(s * s, MASK_ITEMSIZE, f"{name}.mask")
    tape.drop(ones)
    masked = masked_fill(tape, scores, mask, f"{name}.scores")
    tape.drop(scores)
    probs = softmax(tape, masked, f"{name}.probs")
    if sh.attn_dropout > 0:
        dropped = ops.dropout(tape, probs, f"{name}.probs_drop", sh.device)
        tape.drop(probs)
        probs = dropped
    out = matmul(tape, probs, True, value, kv_contiguous, b * a * s * d, f"{name}.pv", True)
    if repeat:
        tape.drop(key, value)
    tape.drop(masked, mask, probs)
    return out


def merge_heads(tape: Tape, sh: Shape, out: Tensor) -> Tensor:
    """The model's ``out.transpose(1, 2).reshape(b, s, a * d)`` on the core's output.

    Flash (and efficient) kernels return a tensor laid out as ``[b, s, a, d]``: both are views.
    The math and eager cores return one contiguous in ``[b, a, s, d]``: the reshape copies
    (``clone`` + ``_unsafe_view``; backward hands the gradient on, transposed). The caller
    keeps (and drops) ``out``."""
    if sh.attention not in ("math", "eager"):
        return ops.view(tape, out)
    t = view(tape, out, name="Transpose")
    c = clone(tape, t, "attn.merge")
    tape.drop(t)
    o = view(tape, c, name="UnsafeView")
    tape.drop(c)
    return o


def _known_one(n: Size) -> bool:
    """Whether a head count is 1 (a symbol is taken to be more)."""
    return bool(sp.sympify(n) == 1)


def view_grad_copies(sh: Shape) -> tuple[bool, bool, bool]:
    """Whether the gradients reaching the model's q, k, v head views (``x.view(b, s, heads,
    d)`` of the projection or of its split) must be copied by ``reshape`` (``ops.view``'s
    ``copy_back``): they do when they arrive laid out as ``[b, heads, s, d]``, which a
    ``[b, s, heads * d]`` view cannot take, unless ``heads`` is 1 (a size-1 dimension never
    blocks a view).

    RoPE's backward (llama-style) leaves q's and k's gradients contiguous in that layout
    whatever the core; the math and eager cores also hand v's so (``bmm`` or the GQA ``sum``),
    and q's without RoPE (gpt2) through matmul's copy of the folded q; k's reaches gpt2's view
    as the transpose of ``bmm``'s contiguous ``[b*a, d, s]`` gradient, which views. Fused
    kernels return gradients in their inputs' layout.
    """
    unfused = sh.attention in ("math", "eager")
    rope = sh.model_type != "gpt2"
    q_one, kv_one = _known_one(sh.a), _known_one(sh.k)
    q = (rope or unfused) and not q_one
    k = rope and not kv_one
    v = unfused and not kv_one
    return q, k, v


def core(tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor, name: str) -> Tensor:
    """The model's ``Attention.core`` for ``sh.attention``: eager, SDPA math, or a fused SDPA
    kernel (flash/efficient, `ops.sdpa_flash`)."""
    kind = sh.attention
    if kind == "eager":
        return eager(tape, sh, q, k, v, name)
    if kind == "math":
        return math_sdpa(tape, sh, q, k, v, name)
    return ops.sdpa_flash(tape, q, k, v, sh.b * sh.a * sh.s, name)
