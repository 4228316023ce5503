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

import sympy as sp

from calc.models.shape import Shape
from calc.replay import ops
from calc.replay.ops.attention import MASK_ITEMSIZE
from calc.replay.tape import Size, Tape, Tensor

FP32 = 4


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


def _repeat_kv(
    tape: Tape, sh: Shape, k: Tensor, v: Tensor, repeat: bool, contiguous: bool, name: str
) -> tuple[Tensor, Tensor, bool]:
    """GQA's ``repeat_interleave`` of k then v to the query heads (contiguous copies), or k and
    v as they are; with whether the key and value are contiguous."""
    if not repeat:
        return k, v, contiguous
    numel = sh.b * sh.a * sh.s * sh.d
    key = ops.repeat_interleave(tape, k, numel, f"{name}.k_rep")
    value = ops.repeat_interleave(tape, v, numel, f"{name}.v_rep")
    return key, value, True


# -- the two cores ----------------------------------------------------------------------------
def math_sdpa(
    tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor, name: str,
    gqa: bool | None = None, contiguous: bool = False,
) -> Tensor:  # fmt: skip
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
    query = ops.scale(tape, qa, f"{name}.q_scaled")
    bias = ops.causal_bias(tape, s, qa.itemsize, f"{name}.mask")
    key, value, kv_contiguous = _repeat_kv(tape, sh, ka, va, repeat, contiguous, name)
    kt = ops.view(tape, key, name="Transpose")
    ks = ops.scale(tape, kt, f"{name}.k_scaled")
    tape.drop(kt)
    scores = ops.matmul(
        tape, query, contiguous, ks, kv_contiguous, b * a * s * s, f"{name}.qk", False
    )
    tape.drop(ks)
    biased = ops.add(tape, scores, bias, f"{name}.scores")
    tape.drop(scores)
    attn = ops.softmax(tape, biased, f"{name}.probs")
    tape.drop(biased)
    if sh.attn_dropout > 0:
        dropped = ops.dropout(tape, attn, f"{name}.probs_drop", sh.device)
        tape.drop(attn)
        attn = dropped
    second = ops.to_dtype(tape, attn, out_itemsize, f"{name}.probs_out") if upcast else None
    out = ops.matmul(tape, attn, True, value, kv_contiguous, b * a * s * d, f"{name}.pv", True)
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
    tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor, name: str,
    gqa: bool | None = None, contiguous: bool = False,
) -> Tensor:  # fmt: skip
    """``_eager_attention(q, k, v, sh.attn_dropout)`` of verify/models/reference.py.

    Forward, in order: GQA's ``repeat_interleave`` of k then v; ``q @ k.transpose(-2, -1)``
    (q's fold copies; so does k^T's without GQA); ``* (1/sqrt(d))``, the product freed;
    ``ones(s, s, bool).triu(1)`` (the ones freed); ``masked_fill`` (saves the mask), the scaled
    scores freed; ``softmax`` (saves its output); ``F.dropout``; ``probs @ v``. Returning frees
    the function's locals: the repeated k and v (saved by the bmms), the masked scores."""
    b, s, a, d = sh.b, sh.s, sh.a, sh.d
    repeat = _is_gqa(sh, gqa)
    key, value, kv_contiguous = _repeat_kv(tape, sh, k, v, repeat, contiguous, name)
    kt = ops.view(tape, key, name="Transpose")
    prod = ops.matmul(tape, q, contiguous, kt, kv_contiguous, b * a * s * s, f"{name}.qk", False)
    tape.drop(kt)
    scores = ops.scale(tape, prod, f"{name}.scaled")
    tape.drop(prod)
    ones = tape.new(s * s, MASK_ITEMSIZE, f"{name}.ones")
    mask = tape.new(s * s, MASK_ITEMSIZE, f"{name}.mask")
    tape.drop(ones)
    masked = ops.masked_fill(tape, scores, mask, f"{name}.scores")
    tape.drop(scores)
    probs = ops.softmax(tape, masked, f"{name}.probs")
    if sh.attn_dropout > 0:
        dropped = ops.dropout(tape, probs, f"{name}.probs_drop", sh.device)
        tape.drop(probs)
        probs = dropped
    out = ops.matmul(tape, probs, True, value, kv_contiguous, b * a * s * d, f"{name}.pv", True)
    if repeat:
        tape.drop(key, value)
    tape.drop(masked, mask, probs)
    return out


def merge_heads(tape: Tape, sh: Shape, out: Tensor, copies: bool | None = None) -> Tensor:
    """The model's ``out.transpose(1, 2).reshape(b, s, a * d)`` on the core's output.

    Flash (and efficient) kernels return a tensor laid out as ``[b, s, a, d]`` for the
    transposed queries the models pass: both are views. The math and eager cores return one
    contiguous in ``[b, a, s, d]``: the reshape copies (``clone`` + ``_unsafe_view``; backward
    hands the gradient on, transposed). ``copies`` overrides the choice (a model whose queries
    reach the kernel contiguous: `calc.models.litgpt`). The caller keeps (and drops) ``out``."""
    if not (sh.attention in ("math", "eager") if copies is None else copies):
        return ops.view(tape, out)
    t = ops.view(tape, out, name="Transpose")
    c = ops.clone(tape, t, "attn.merge")
    tape.drop(t)
    o = ops.view(tape, c, name="UnsafeView")
    tape.drop(c)
    return o


def known_one(n: Size) -> bool:
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
    q_one, kv_one = known_one(sh.a), known_one(sh.k)
    q = (rope or unfused) and not q_one
    k = rope and not kv_one
    v = unfused and not kv_one
    return q, k, v


def core(tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor, name: str) -> Tensor:
    """The model's ``Attention.core`` for ``sh.attention``: eager, SDPA math, or a fused SDPA
    kernel (flash/efficient, `fused`)."""
    kind = sh.attention
    if kind == "eager":
        return eager(tape, sh, q, k, v, name)
    if kind == "math":
        return math_sdpa(tape, sh, q, k, v, name)
    return fused(tape, sh, q, k, v, name)


def round_up(n: Size, m: int) -> Size:
    """``(n + m - 1) / m * m`` (``round_multiple`` of the CUDA kernels)."""
    return -(-n // m) * m if isinstance(n, int) else m * sp.ceiling(n / m)


def fused(
    tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor, name: str,
    mask: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """SDPA's fused kernel on q [b, a, s, d], k, v [b, k, s, d] (`ops.sdpa_flash`), with an
    additive ``mask`` it saves for the backward (the CPU flash kernel, CUDA's efficient one).

    CPU (the tracker): the CPU flash kernel, logsumexp [b, a, s] fp32. CUDA, ``efficient``
    (``_efficient_attention_forward``, ``cuda/attention.cu``; meta kernel
    ``meta__scaled_dot_product_efficient_attention`` in the 2.13 wheel): output
    ``[b, s, a, d]``, logsumexp ``[b, a, ceil(s/32)*32]`` fp32 when ``compute_log_sumexp``
    (an input needs grad, grad mode on), else none; its philox seed and offset are host scalars
    outside CUDA-graph capture. Its backward's ``delta`` and workspace are not modelled yet.
    CUDA, ``flash``: logsumexp [b, a, s] and `ops.CudaFlash`'s rng state and backward
    temporaries (``softmax_d``, the fp32 ``dq_accum``, GQA's expanded dk, dv)."""
    b, a, s = sh.b, sh.a, sh.s
    if sh.device != "cuda":
        return ops.sdpa_flash(tape, q, k, v, b * a * s, name, mask=mask)
    if sh.attention == "efficient":
        grad = tape.grad_enabled and any(tape.needs_grad(t) for t in (q, k, v))
        lse = b * a * round_up(s, 32) if grad else 0
        return ops.sdpa_flash(tape, q, k, v, lse, name, mask=mask)
    assert mask is None, "CUDA's flash kernel takes no mask"
    s_r = round_up(s, 128)
    temps: list[tuple[Size, int]] = [
        (b * a * s_r, FP32),
        (b * s_r * a * (sh.d + sh.flash_head_pad), FP32),
    ]
    if sp.sympify(q.numel - k.numel) != 0:  # fewer kv heads: dk_expanded, dv_expanded
        temps += [(q.numel, q.itemsize), (q.numel, q.itemsize)]
    cuda = ops.CudaFlash(dropout=sh.attn_dropout > 0, backward_temps=tuple(temps))
    return ops.sdpa_flash(tape, q, k, v, b * a * s, name, cuda)
