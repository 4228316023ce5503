"""Hugging Face transformers 5.24 ``GPT2LMHeadModel`` as a replay on a `Tape`.

Follows ``transformers/models/gpt2/modeling_gpt2.py`` (and ``pytorch_utils.Conv1D``,
``activations.NewGELUActivation``, ``integrations/sdpa_attention.py``,
``cache_utils.DynamicLayer``, ``loss/loss_utils.ForCausalLMLoss``) line by line: the ops in
order and the moment each Python local dies. The step replayed is ``loss = model(input_ids=ids,
labels=targets).loss; loss.backward(); del loss`` on a model in train mode with
``config.use_cache`` True (the harness's config), so ``GPT2Model.forward`` builds a
``DynamicCache`` even in training and every layer's keys and values are copied into it by
``torch.cat`` (the copies die with the output object, after the forward).

What differs from the plain reference GPT-2 (`calc.models.reference`), and so is modelled here:

* ``Conv1D`` is ``torch.addmm(bias, x.view(-1, in), weight)`` with the weight stored
  ``[in, out]``: ``AddmmBackward0`` allocates the input's gradient, the weight's, then the bias'
  (``sum_to`` in ``validate_outputs``), as `ops.linear`; under autocast ``addmm`` casts its
  arguments last to first (weight, input, bias);
* position ids are ``torch.arange(s) + past_seen_tokens`` (two int64 tensors), saved by the
  ``wpe`` embedding; ``inputs_embeds + position_embeds`` broadcasts, so wpe's gradient is
  reduced by ``sum_to`` in backward;
* the activation is ``gelu_new``: ``NewGELUActivation`` written out in Python,
  ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``: eight elementwise ops, five of
  which autograd sees as saving something;
* attention: SDPA with ``is_causal=True`` and no mask, or ``eager_attention_forward`` with the
  additive ``[b, 1, s, s]`` mask of ``create_causal_mask`` (in the embeddings' dtype);
* the attention output of each block (``attn_output, _ = self.attn(...)``) stays referenced
  until the block returns;
* the head runs on ``hidden_states[:, 0:, :]`` (``slice_logits_to_keep``: an ``alias``); the
  loss upcasts the logits and shifts padded labels (`hf.causal_lm_loss`).

Dropout (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``) is ``F.dropout``: with p = 0 it
returns its input (nothing allocated); with p > 0 on CPU a mask the input's size and dtype and
the product (`ops.dropout`). Attention dropout sends SDPA to the math backend on CPU
(`calc.models.attention.cpu_backend`).

``recompute='full'`` (``activation_checkpointing_enable``): each block runs under
non-reentrant checkpointing with no cache (``use_cache`` off, so ``create_causal_mask`` runs
its packed-sequence check on the position ids); the frame holds the block's hidden states,
mask and position ids. ``recompute='selective'`` does not exist in transformers.

Checked against the CPU allocation trace (tests/calc/models/test_hf_gpt2.py): every allocation's
live total equal for fp32, bf16 and amp-bf16, flash/math SDPA and eager, with and without
dropout and full recomputation.
"""

from __future__ import annotations

from collections.abc import Callable

from calc.models import attention_core as core
from calc.models import hf
from calc.models.head import Head, finish
from calc.models.reference import Shape, Weights
from calc.replay import ops
from calc.replay.tape import Size, Tape, Tensor

__all__ = ["Shape", "Weights", "check", "forward"]

INT64 = 8
FP32 = 4


def check(sh: Shape) -> None:
    """Raise ``NotImplementedError`` for a GPT-2 step this module does not replay."""
    if sh.recompute == "selective":
        raise NotImplementedError(
            "recompute='selective' with implementation='hf': transformers checkpoints whole "
            "layers only (gradient_checkpointing_enable); use recompute='full'"
        )
    if sh.attention not in ("flash", "efficient", "math", "eager"):
        raise NotImplementedError(f"attention {sh.attention!r} for hf gpt2")
    if sh.attention == "math" and sh.attn_dropout <= 0:
        # the math kernel without dropout is only reachable by forcing it; not measured
        raise NotImplementedError("hf gpt2 with the math SDPA kernel and no attention dropout")


# -- small pieces ---------------------------------------------------------------------------------
def dropout(tape: Tape, sh: Shape, x: Tensor, p: float, name: str) -> Tensor:
    """``nn.Dropout(p)`` in training: ``F.dropout`` returns its input when p == 0; else (CPU)
    ``x * (empty_like(x).bernoulli_(1 - p) / (1 - p))``. The caller's reference to ``x`` is
    consumed (the name is rebound)."""
    if p <= 0:
        return x
    out = ops.dropout(tape, x, name, sh.device)
    tape.drop(x)
    return out


def conv1d(
    tape: Tape,
    x: Tensor,
    w: Tensor,
    bias: Tensor,
    rows: Size,
    out_features: Size,
    name: str,
) -> Tensor:
    """``Conv1D.forward``: ``torch.addmm(self.bias, x.view(-1, nx), self.weight).view(...)``.

    The views allocate nothing (their backward views the contiguous gradients back). Under
    autocast ``addmm`` casts weight, input, bias (last argument first); the parameter casts
    are cached until autocast exits (`_param_cast`), the input's is a fresh copy each call."""
    x2 = ops.view(tape, x)
    if not tape.autocast_itemsize:
        y = ops.linear(tape, x2, w, bias, rows, out_features, name)
        tape.drop(x2)
    else:
        wc = _param_cast(tape, w)
        xc = hf.autocast_cast(tape, x2, f"{name}.in.lo")
        bc = _param_cast(tape, bias)
        with tape.autocast_paused():
            y = ops.linear(tape, xc, wc, bc, rows, out_features, name)
        tape.drop(xc, x2, wc, bc)
    out = ops.view(tape, y)
    tape.drop(y)
    return out


def _param_cast(tape: Tape, p: Tensor) -> Tensor:
    """Autocast's cast of a ``Conv1D`` parameter, held until autocast exits whether or not it
    is a leaf that needs grad (``cache_any``: a pruned weight's cast too)."""
    return ops.autocast_cast(tape, p, f"{p.name}.lo", f"{p.name}.lo", "", cache_any=True)


def scalar_add(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``python_scalar + x`` (``AddBackward1``): saves nothing, hands the gradient on."""
    return ops.add(tape, x, None, name)


def pow3(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``torch.pow(x, 3.0)``: saves x; backward ``grad * (3.0 * x.pow(2.0))`` (three
    x-sized tensors, the two temporaries freed at the end of the expression)."""
    return ops.pow2(tape, x, name)


def cuda_autocast_fp32(tape: Tape, sh: Shape, x: Tensor, name: str) -> Tensor | None:
    """Autocast's cast of ``x`` to fp32 for an op on CUDA's fp32 list, or None.

    ``aten/src/ATen/autocast_mode.cpp`` registers ``pow`` (fp32 policy) and ``softmax``
    (``fp32_set_opt_dtype``: ``dtype=float``, which ``at::softmax`` applies as
    ``input.toType(float)`` for bf16) for the CUDA key; the CPU key's fp32 list has neither
    (the torch.amp "autocast op reference": "CUDA Ops that can autocast to float32" lists
    pow and softmax, "CPU Ops that can autocast to float32" does not). So under CUDA autocast
    a 16-bit input is copied to fp32 first and the op's result is fp32."""
    if sh.device != "cuda" or not tape.autocast_itemsize or x.itemsize >= FP32:
        return None
    return ops.to_dtype(tape, x, FP32, name)


def new_gelu(tape: Tape, sh: Shape, x: Tensor) -> Tensor:
    """``NewGELUActivation.forward``:
    ``0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 *
    torch.pow(input, 3.0))))``, evaluated left to right; each temporary dies when its consumer
    has run (``tanh`` saves its result; the last ``mul`` saves both operands). On CUDA under
    autocast ``pow`` runs in fp32 (`cuda_autocast_fp32`), which promotes everything after it."""
    half = ops.scale(tape, x, "gelu.half")  # 0.5 * input
    x32 = cuda_autocast_fp32(tape, sh, x, "gelu.pow.in32")
    cube = pow3(tape, x if x32 is None else x32, "gelu.pow")  # torch.pow(input, 3.0)
    tape.drop(x32)
    c3 = ops.scale(tape, cube, "gelu.cube_c")  # 0.044715 * (...)
    tape.drop(cube)
    inner = ops.add(tape, x, c3, "gelu.inner")  # input + (...)
    tape.drop(c3)
    arg = ops.scale(tape, inner, "gelu.arg")  # sqrt(2/pi) * (...)
    tape.drop(inner)
    th = ops.unary(tape, arg, "gelu.tanh", saves="output")  # torch.tanh
    tape.drop(arg)
    one = scalar_add(tape, th, "gelu.one_plus")  # 1.0 + tanh(...)
    tape.drop(th)
    out = ops.mul_broadcast(tape, half, one, "gelu.out")
    tape.drop(half, one)
    return out


# -- attention ------------------------------------------------------------------------------------
def math_sdpa(
    tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor, kv_contiguous: bool
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, dropout_p=attn_pdrop, is_causal=True)`` through
    ``_scaled_dot_product_attention_math`` (see `attention_core.math_sdpa`), with GPT-2's
    layouts: q is a transposed view of the fused projection (its fold copies); k and v are
    the cache's contiguous copies when a cache is used (their folds are views)."""
    b, s, a, d = sh.b, sh.s, sh.a, sh.d
    out_itemsize = q.itemsize
    upcast = q.itemsize < FP32
    if upcast:
        qa = ops.to_dtype(tape, q, FP32, "attn.q32")
        ka = ops.to_dtype(tape, k, FP32, "attn.k32")
        va = ops.to_dtype(tape, v, FP32, "attn.v32")  # (``_to_copy`` keeps the layouts)
    else:
        qa, ka, va = q, k, v
    query = ops.scale(tape, qa, "attn.q_scaled")
    bias = ops.causal_bias(tape, s, qa.itemsize, "attn.mask")
    kt = ops.view(tape, ka, name="Transpose")
    ks = ops.scale(tape, kt, "attn.k_scaled")
    tape.drop(kt)
    scores = ops.matmul(tape, query, False, ks, kv_contiguous, b * a * s * s, "attn.qk", False)
    tape.drop(ks)
    biased = ops.add(tape, scores, bias, "attn.scores")
    tape.drop(scores)
    attn = ops.softmax(tape, biased, "attn.probs")
    tape.drop(biased)
    if sh.attn_dropout > 0:
        dropped = ops.dropout(tape, attn, "attn.probs_drop", sh.device)
        tape.drop(attn)
        attn = dropped
    second = ops.to_dtype(tape, attn, out_itemsize, "attn.probs_out") if upcast else None
    out = ops.matmul(tape, attn, True, va, kv_contiguous, b * a * s * d, "attn.pv", True)
    if upcast:
        cast = ops.to_dtype(tape, out, out_itemsize, "attn.out")
        tape.drop(out)
        out = cast
    tape.drop(attn, query, bias)
    if upcast:
        tape.drop(va, ka, qa)
    tape.drop(second)
    return out


def eager_attention(
    tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, kv_contiguous: bool
) -> tuple[Tensor, Tensor]:
    """``eager_attention_forward`` (GPT-2's own): ``matmul(q, k^T) * scaling + mask``,
    ``softmax`` (in the promoted dtype), ``.type(value.dtype)``, dropout, ``matmul(., v)``;
    returns ``attn_output.transpose(1, 2)`` (a view of the contiguous [b, a, s, d] product)
    and the attention weights (after dropout), which the callers keep referenced."""
    b, s, a, d = sh.b, sh.s, sh.a, sh.d
    kt = ops.view(tape, k, name="Transpose")
    prod = ops.matmul(tape, q, False, kt, kv_contiguous, b * a * s * s, "attn.qk", False)
    tape.drop(kt)
    sc = ops.scale(tape, prod, "attn.scaled")  # * scaling
    tape.drop(prod)
    masked = ops.add_cast_in_formula(tape, sc, mask, "attn.masked")  # + attention_mask (no grad)
    tape.drop(sc)
    m32 = cuda_autocast_fp32(tape, sh, masked, "attn.softmax.in32")
    probs = ops.softmax(tape, masked if m32 is None else m32, "attn.probs")
    tape.drop(masked, m32)
    pv = ops.to_dtype(
        tape, probs, v.itemsize, "attn.probs_cast", grad_suffix=""
    )  # .type(value.dtype)
    tape.drop(probs)
    if sh.attn_dropout > 0:
        dropped = ops.dropout(tape, pv, "attn.probs_drop", sh.device)
        tape.drop(pv)
        pv = dropped
    out = ops.matmul(tape, pv, True, v, kv_contiguous, b * a * s * d, "attn.pv", True)
    ot = ops.view(tape, out, name="Transpose")
    tape.drop(out)
    return ot, pv


def attention(
    tape: Tape, sh: Shape, x: Tensor, lw: dict, mask: Tensor | None, use_cache: bool
) -> tuple[Tensor, list, Tensor | None]:
    """``GPT2Attention.forward`` (self-attention): the output (after ``resid_dropout``), the
    cache's key and value copies, and the eager attention weights (None for SDPA): returned as
    ``attn_weights``, they stay referenced (``attn_output, _ = self.attn(...)``) until the
    block returns, which matters when they are not saved (under checkpointing)."""
    n = sh.b * sh.s
    qkv = conv1d(tape, x, lw["qkv"], lw["qkv.b"], n, 3 * sh.h, "c_attn")
    q, k, v = ops.split3(tape, qkv)
    tape.drop(qkv)
    gq, gk, gv = core.view_grad_copies(sh)
    # key_states.view(shape_kv).transpose(1, 2), value_states likewise, then the query
    heads = []
    for t, copy in ((k, gk), (v, gv), (q, gq)):
        v1 = ops.view(tape, t, copy_back=copy)
        tape.drop(t)
        heads.append(ops.view(tape, v1, name="Transpose"))
        tape.drop(v1)
    kt, vt, qt = heads
    cache: list = []
    if use_cache:  # DynamicLayer.update: torch.cat([empty, states], dim=-2) for keys, values
        kc = ops.cat_onto_empty(tape, kt, "cache.k")
        vc = ops.cat_onto_empty(tape, vt, "cache.v")
        cache = [tape.alias(kc), tape.alias(vc)]
        tape.drop(kt, vt)
        kt, vt = kc, vc
    if sh.attention == "eager":
        assert mask is not None
        ao, weights = eager_attention(tape, sh, qt, kt, vt, mask, use_cache)
        # attn_output.reshape(b, s, -1): the transposed product is not viewable: a copy
        o = ops.clone(tape, ao, "attn.merge")
        tape.drop(ao)
    else:
        weights = None
        if sh.attention == "math":
            out = math_sdpa(tape, sh, qt, kt, vt, use_cache)
            # reshape (a view), then .transpose(1, 2).contiguous(): the math output is
            # contiguous in [b, a, s, d], so contiguous() copies
            o = core.merge_heads(tape, sh, out)
        else:
            out = core.fused(tape, sh, qt, kt, vt, "attn")
            # the CPU flash output is laid out [b, s, a, d]: reshape, transpose, contiguous
            # and the reshape to [b, s, h] are views
            o = ops.view(tape, out)
        tape.drop(out)
    y = conv1d(tape, o, lw["o"], lw["o.b"], n, sh.h, "attn.c_proj")
    tape.drop(o)
    y = dropout(tape, sh, y, sh.hidden_dropout, "resid_drop")
    tape.drop(qt, kt, vt)  # the query/key/value locals die when forward returns
    return y, cache, weights


def mlp(tape: Tape, sh: Shape, x: Tensor, lw: dict) -> Tensor:
    """``GPT2MLP.forward``: c_fc, gelu_new, c_proj, dropout."""
    n = sh.b * sh.s
    h = conv1d(tape, x, lw["fc"], lw["fc.b"], n, sh.f, "c_fc")
    act = new_gelu(tape, sh, h)
    tape.drop(h)
    y = conv1d(tape, act, lw["proj"], lw["proj.b"], n, sh.h, "mlp.c_proj")
    tape.drop(act)
    return dropout(tape, sh, y, sh.hidden_dropout, "mlp_drop")


Attend = Callable[[Tape, Shape, Tensor, dict], Tensor]
"""``attend(tape, shape, x, layer_weights)``: a ``GPT2Attention.forward`` in place of
`attention` (generation's, over a cache: `calc.models.hf_generate`)."""


def block(
    tape: Tape, sh: Shape, x: Tensor, lw: dict, mask: Tensor | None, use_cache: bool,
    attend: Attend | None = None,
) -> tuple[Tensor, list]:  # fmt: skip
    """``GPT2Block.forward``; ``x`` stays the caller's."""
    n = sh.b * sh.s
    n1 = ops.layer_norm(tape, x, lw["norm1"], lw["norm1.b"], n)
    if attend is None:
        att, cache, weights = attention(tape, sh, n1, lw, mask, use_cache)
    else:
        att, cache, weights = attend(tape, sh, n1, lw), [], None
    x2 = ops.add_cast_in_formula(tape, att, x, "resid1")  # attn_output + residual
    tape.drop(n1)
    n2 = ops.layer_norm(tape, x2, lw["norm2"], lw["norm2.b"], n)
    ff = mlp(tape, sh, n2, lw)
    x3 = ops.add_cast_in_formula(tape, x2, ff, "resid2")  # residual + feed_forward_hidden_states
    tape.drop(n2)
    # returning frees the locals: attn_output, the weights, the residual, the MLP output
    tape.drop(att, weights, x2, ff)
    return x3, cache


def model(tape: Tape, sh: Shape, w: Weights, use_cache: bool) -> tuple[Tensor, list]:
    """``GPT2Model.forward(input_ids)``: ``ln_f``'s output and the cache's tensors."""
    n = sh.b * sh.s
    tape.segment = "embed"
    tok = ops.embedding(tape, w.embed, n, sh.h, "wte_out")  # inputs_embeds = self.wte(ids)
    ar = ops.plain(tape, sh.s, INT64, "arange")  # torch.arange(s) + past_seen_tokens
    pos = ops.plain(tape, sh.s, INT64, "position_ids")
    tape.drop(ar)
    assert w.wpe is not None  # GPT-2's learned positions
    pe = ops.embedding(tape, w.wpe, sh.s, sh.h, "wpe_out", indices=pos)
    x = ops.add_cast_in_formula(tape, tok, pe, "embed_out")  # inputs_embeds + position_embeds
    if not use_cache:  # (no DynamicCache: checkpointing turns use_cache off)
        hf._packed_sequence_check(tape, sh)
    # create_causal_mask: None for sdpa (is_causal), an additive float mask for eager
    mask = hf.causal_mask(tape, sh, tok.itemsize) if sh.attention == "eager" else None
    x = dropout(tape, sh, x, sh.embed_dropout, "embed_drop")
    cache: list = []
    for j, lw in enumerate(w.layers):
        tape.segment = j
        if sh.recompute == "full":
            # GradientCheckpointingLayer: the block runs under non-reentrant
            # torch.utils.checkpoint with cache=None; the frame holds its arguments (hidden
            # states, the mask) and the partial's keyword tensors (position_ids)
            def run(x: Tensor = x, lw: dict = lw) -> Tensor:
                return block(tape, sh, x, lw, mask, False)[0]

            held = [t for t in (x, mask, pos) if t is not None]
            x_next, c = tape.checkpoint(run, held), list[Tensor]()
        else:
            x_next, c = block(tape, sh, x, lw, mask, use_cache)
        cache += c
        tape.drop(x)
        x = x_next
    tape.segment = "head"
    hid = ops.layer_norm(tape, x, w.norm, w.norm_b, n)
    tape.drop(x)
    out = ops.view(tape, hid)  # hidden_states.view(output_shape)
    tape.drop(hid, tok, pe, pos, mask)
    return out, cache


def lm_head(tape: Tape, sh: Shape, x: Tensor, w: Tensor) -> Tensor:
    """``self.lm_head(hidden_states)`` (``nn.Linear``, no bias) on the 3-D hidden states:
    ``matmul`` folds them to 2-D (a view), ``mm``, and views the result back."""
    n = sh.b * sh.s
    return hf.linear(tape, x, w, None, n, sh.V, "logits")


def forward(
    tape: Tape, sh: Shape, w: Weights, use_cache: bool = True,
    head: Head | None = None, held: list[Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """``GPT2LMHeadModel.forward(input_ids=ids, labels=targets).loss``; returns the loss.

    With ``sh.autocast_itemsize`` the forward runs under ``torch.autocast`` (fp32 weights),
    left right after (its cast cache dies). The output object (logits, cache) dies before
    this returns, as in ``loss = model(...).loss``."""
    check(sh)
    if sh.autocast_itemsize:
        tape.autocast_enter(sh.autocast_itemsize)
    hid, cache = model(tape, sh, w, use_cache)
    tape.segment = "head"
    if head is not None and not head.default:  # the loop's head and loss: calc.models.head
        loss = finish(
            tape, sh, head, hid, cache, lambda t, x, rows, name: hf.linear(
                t, x, w.head, None, rows, sh.V, name), lambda t, lg: hf.causal_lm_loss(t, sh, lg),
            [] if held is None else held,
        )  # fmt: skip
        if sh.autocast_itemsize:
            tape.autocast_exit()
        return loss
    sl = ops.view(tape, hid)  # slice_logits_to_keep(hidden, 0): hidden[:, 0:, :] (an alias)
    tape.drop(hid)
    logits = lm_head(tape, sh, sl, w.head)
    loss = hf.causal_lm_loss(tape, sh, logits)
    tape.drop(sl, logits, *cache)
    if sh.autocast_itemsize:
        tape.autocast_exit()  # leaving ``torch.autocast``: the cast cache is cleared
    return loss
