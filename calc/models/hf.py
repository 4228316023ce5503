"""Hugging Face transformers 5.24 causal LMs (llama, mistral, qwen2, qwen3) as a replay on a `Tape`.

Each function follows one method of ``transformers/models/<family>/modeling_<family>.py`` (and
the shared pieces it calls: ``integrations/sdpa_attention.py``, ``loss/loss_utils.py``,
``cache_utils.DynamicLayer``) line by line: the ops in order and the moment each Python local
dies. The step replayed is ``loss = model(input_ids=ids, labels=ids).loss; loss.backward();
del loss`` on a model in train mode (``config.use_cache`` left at its default, True, so a
``DynamicCache`` is built and every layer's keys and values are copied into it by ``torch.cat``;
it dies with the output object, after the forward).

What differs from the plain reference model (`calc.models.reference`), and so is modelled here:

* RMSNorm upcasts (``.to(float32)``, a copy unless the input is fp32, saved by ``pow`` and the
  ``* rsqrt`` product) and multiplies ``weight * x.to(input_dtype)`` with the broadcast operand
  first (its gradient is reduced after both products exist: `ops.mul_broadcast`);
* the rotary embedding computes ``cos``/``sin`` [1, s, d] inside the forward from the position
  ids (activations, saved by the ``q * cos`` products, not buffers);
* ``rotate_half`` slices (``x[..., :d/2]``) instead of ``chunk``: each slice's backward
  allocates a zero-filled input-sized gradient;
* SDPA gets ``is_causal=True`` and no mask (``create_causal_mask`` returns None for sdpa), GQA
  through ``enable_gqa`` (no ``repeat_kv``); the key/value it sees are the cache's copies;
* the loss upcasts the logits (``logits.float()``), pads and shifts the labels (two int64
  tensors; the shifted copy is saved by ``nll_loss`` as its target) and reduces by mean.

Extra inputs beyond `reference.forward`: none (the input ids and labels are the same tensor,
alive before the step and not charged). ``use_cache`` mirrors ``config.use_cache``.
"""

from __future__ import annotations

from typing import Protocol

from calc.models import attention_core as core
from calc.models.head import Head, finish
from calc.models.reference import Shape, Weights
from calc.replay import ops
from calc.replay.tape import Size, Tape, Tensor

__all__ = ["Shape", "Weights", "forward", "shape_from_config", "step_options"]

INT64 = 8
FP32 = 4


class HFConfig(Protocol):
    """The attributes of a transformers ``PretrainedConfig`` (llama, mistral, qwen2, qwen3)
    this module reads; others (``head_dim``, ``attention_bias``, ``layer_types``, ...) are
    read with ``getattr`` defaults."""

    model_type: str
    num_attention_heads: int
    hidden_size: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool
    _attn_implementation: str


def shape_from_config(
    cfg: HFConfig,
    b: Size,
    s: Size,
    weight_itemsize: int = 4,
    autocast_itemsize: int = 0,
) -> Shape:
    """The `Shape` of one step of a HF llama/mistral/qwen2/qwen3 config (duck-typed)."""
    model_type = cfg.model_type
    a = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // a
    return Shape(
        b=b,
        s=s,
        h=cfg.hidden_size,
        a=a,
        k=cfg.num_key_value_heads,
        d=d,
        f=cfg.intermediate_size,
        V=cfg.vocab_size,
        P=0,
        n_layers=cfg.num_hidden_layers,
        model_type=model_type,
        mlp="swiglu",
        norm="rmsnorm",
        qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        o_bias=bool(getattr(cfg, "attention_bias", False)),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        norm_bias=False,
        qk_norm=model_type == "qwen3",
        tied=bool(cfg.tie_word_embeddings),
        weight_itemsize=weight_itemsize,
        act_itemsize=weight_itemsize,
        autocast_itemsize=autocast_itemsize,
        attention="flash" if cfg._attn_implementation == "sdpa" else cfg._attn_implementation,
    )


def step_options(cfg: HFConfig) -> dict:
    """The `forward` keywords a HF config implies: ``use_cache`` (``config.use_cache``) and
    ``sliding_layers``, the number of cache layers that are ``DynamicSlidingWindowLayer``s
    (``DynamicCache(config)``: one per ``sliding_attention`` layer type, or every layer when a
    config without ``layer_types`` has a ``sliding_window``, as mistral's 4096 default)."""
    use_cache = bool(getattr(cfg, "use_cache", True))
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        sliding = sum(t == "sliding_attention" for t in layer_types[: cfg.num_hidden_layers])
    elif getattr(cfg, "sliding_window", None) is not None:
        sliding = cfg.num_hidden_layers
    else:
        sliding = 0
    return {"use_cache": use_cache, "sliding_layers": sliding}


# -- LlamaRMSNorm -------------------------------------------------------------------------------
def rmsnorm(tape: Tape, x: Tensor, w: Tensor, rows: Size) -> Tensor:
    """``LlamaRMSNorm.forward`` (shared by the four families)."""
    in_isz = x.itemsize
    h = ops.to_dtype(tape, x, FP32, "norm.f32", grad_suffix="")  # hidden_states.to(torch.float32)
    p = ops.pow2(tape, h, "norm.pow")  # variance = hidden_states.pow(2).mean(-1, keepdim=True)
    var = ops.mean_last(tape, p, rows, "norm.mean")
    tape.drop(p)
    e = ops.add(tape, var, None, "norm.eps")  # torch.rsqrt(variance + eps)
    r = ops.rsqrt(tape, e, "norm.rstd")
    tape.drop(e)
    hn = ops.mul_broadcast(tape, h, r, "norm.xhat")  # hidden_states = hidden_states * rsqrt(...)
    tape.drop(r, h)
    hc = ops.to_dtype(
        tape, hn, in_isz, "norm.cast", grad_suffix=""
    )  # hidden_states.to(input_dtype)
    y = ops.mul_broadcast(tape, w, hc, "norm.out")  # self.weight * ...
    tape.drop(hc, hn, var)
    return y


# -- LlamaRotaryEmbedding -------------------------------------------------------------------------
def rotary(tape: Tape, sh: Shape, pos: Tensor, x_itemsize: int) -> tuple[Tensor, Tensor]:
    """``LlamaRotaryEmbedding.forward(x, position_ids)``: cos, sin [1, s, d] in x's dtype."""
    s, d = sh.s, sh.d
    half = d // 2 if isinstance(d, int) else d / 2
    pf = ops.plain(tape, s, FP32, "rope.pos_f")  # position_ids[..., None].float()
    inv = None
    if sh.weight_itemsize != FP32:  # self.inv_freq.to(dtype=torch.float): a copy of a bf16 buffer
        inv = ops.plain(tape, half, FP32, "rope.inv_f")
    freqs = ops.plain(tape, s * half, FP32, "rope.freqs")
    tape.drop(pf, inv)
    emb = ops.plain(tape, s * d, FP32, "rope.emb")  # torch.cat((freqs, freqs), dim=-1)
    c0 = ops.plain(tape, s * d, FP32, "rope.cos0")
    cos = ops.plain(tape, s * d, FP32, "rope.cos")  # emb.cos() * attention_scaling
    tape.drop(c0)
    s0 = ops.plain(tape, s * d, FP32, "rope.sin0")
    sin = ops.plain(tape, s * d, FP32, "rope.sin")
    tape.drop(s0)
    if x_itemsize != FP32:  # cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
        cos_c = ops.plain(tape, s * d, x_itemsize, "rope.cos_c")
        sin_c = ops.plain(tape, s * d, x_itemsize, "rope.sin_c")
        tape.drop(cos, sin)
        cos, sin = cos_c, sin_c
    tape.drop(freqs, emb)
    return cos, sin


# -- nn.Linear under autocast ---------------------------------------------------------------------
def autocast_cast(tape: Tape, t: Tensor, name: str) -> Tensor:
    """`ops.autocast_cast` as the Hugging Face graphs name its casts: ``<name>`` for a
    parameter's (cached) cast too, and the gradient cast back ``d<name>``."""
    return ops.autocast_cast(tape, t, name, leaf_name=name, grad_suffix="")


def linear(
    tape: Tape, x: Tensor, w: Tensor, bias: Tensor | None, rows: Size, out_features: Size, name: str
) -> Tensor:
    """``nn.Linear`` forward. Under autocast (``tape.autocast_itemsize``) ``F.linear(input,
    weight, bias)`` casts its arguments last to first (measured; the C++ wrapper's argument
    evaluation order): the bias, the weight (parameters: cached until autocast exits), then
    the input (a fresh copy at every call: q, k and v each copy the same normed input), and
    runs in the low precision (`autocast_cast`). A frozen weight's cast is made at every call
    and lives as long as a reference (mm saves it for the input's gradient). The casts are
    ``_to_copy`` nodes: backward casts each gradient back to fp32. A LoRA-adapted linear
    (``tape.linear_hooks``, `calc.compress.lora`) is `ops.linear`'s."""
    if not tape.autocast_itemsize or id(w.storage) in tape.linear_hooks:
        return ops.linear(tape, x, w, bias, rows, out_features, name)
    bc = autocast_cast(tape, bias, f"{bias.name}.lo") if bias is not None else None
    wc = autocast_cast(tape, w, f"{w.name}.lo")
    xc = autocast_cast(tape, x, f"{name}.in.lo")
    with tape.autocast_paused():
        y = ops.linear(tape, xc, wc, bc, rows, out_features, name)
    tape.drop(xc, wc, bc)
    return y


# -- apply_rotary_pos_emb -------------------------------------------------------------------------
def rotate_half(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``torch.cat((-x[..., d/2:], x[..., :d/2]), dim=-1)``."""
    x1 = ops.slice_half(tape, x, f"{name}.x1")
    x2 = ops.slice_half(tape, x, f"{name}.x2")
    n2 = ops.neg(tape, x2, f"{name}.neg")
    rot = ops.cat2(tape, n2, x1, f"{name}.rot")
    tape.drop(n2, x1, x2)
    return rot


def rope_one(tape: Tape, x: Tensor, cos: Tensor, sin: Tensor, name: str) -> Tensor:
    """``(x * cos) + (rotate_half(x) * sin)``."""
    t1 = ops.mul_broadcast(tape, x, cos, f"{name}.cos")
    rot = rotate_half(tape, x, name)
    t2 = ops.mul_broadcast(tape, rot, sin, f"{name}.sin")
    tape.drop(rot)
    out = ops.add(tape, t1, t2, f"{name}.rope")
    tape.drop(t1, t2)
    return out


# -- LlamaAttention / Qwen3Attention --------------------------------------------------------------
def attention(
    tape: Tape, sh: Shape, x: Tensor, lw: dict, cos: Tensor, sin: Tensor, use_cache: bool
) -> tuple[Tensor, list]:
    n = sh.b * sh.s
    # query_states = self.q_proj(hidden_states).view(hidden_shape)[-> q_norm].transpose(1, 2)
    # RoPE's outputs are contiguous in [b, heads, s, d], so the gradients reaching the first
    # view are transposed and reshape copies them there.
    heads = []
    for key, nh in (("q", sh.a), ("k", sh.k)):
        lin = linear(tape, x, lw[key], lw[f"{key}.b"], n, nh * sh.d, key)
        # (without a cache, k's gradient keeps the projection's layout: no copy; measured)
        v1 = ops.view(tape, lin, copy_back=key == "q" or use_cache)
        tape.drop(lin)
        if sh.qk_norm:
            nv = rmsnorm(tape, v1, lw[f"{key}_norm"], n * nh)
            tape.drop(v1)
            v1 = nv
        t = ops.view(tape, v1)
        tape.drop(v1)
        heads.append(t)
    qt, kt = heads
    vl = linear(tape, x, lw["v"], lw["v.b"], n, sh.k * sh.d, "v")
    # .view(hidden_shape).transpose(1, 2): flash SDPA's dv comes back in the [b, s, k, d]
    # layout (a view suffices); eager attention's and the math backend's is contiguous
    # [b, k, s, d] (reshape copies, unless k is 1: core.view_grad_copies)
    vt = ops.view(tape, vl, copy_back=core.view_grad_copies(sh)[2])
    tape.drop(vl)
    # apply_rotary_pos_emb: cos.unsqueeze(1), sin.unsqueeze(1) are views without grad
    qr = rope_one(tape, qt, cos, sin, "q")
    kr = rope_one(tape, kt, cos, sin, "k")
    tape.drop(qt, kt)
    if use_cache:  # cache.update: torch.cat([self.keys, key_states], dim=-2) on an empty tensor
        kc = ops.cat_onto_empty(tape, kr, "cache.k")
        vc = ops.cat_onto_empty(tape, vt, "cache.v")
        cache = [tape.alias(kc), tape.alias(vc)]
        tape.drop(kr, vt)
        kr, vt = kc, vc
    else:
        cache = []
    if sh.attention == "eager":
        out = eager_attention(tape, sh, qr, kr, vt)
    elif tape.autocast_itemsize:
        # autocast casts SDPA's fp32 operands (RoPE promoted q and k to fp32: bf16 * fp32 cos),
        # last argument first as for linear: value (bf16 already), key, query
        vl2 = autocast_cast(tape, vt, "attn.v.lo")
        kl = autocast_cast(tape, kr, "attn.k.lo")
        ql = autocast_cast(tape, qr, "attn.q.lo")
        out = core.core(tape, sh, ql, kl, vl2, "attn")
        tape.drop(kl, ql, vl2)
    else:  # SDPA: the fused kernels, or the math backend (enable_gqa repeats k/v inside)
        out = core.core(tape, sh, qr, kr, vt, "attn")
    # attn_output.transpose(1, 2).contiguous(), then reshape(*input_shape, -1): the CPU/flash
    # output is laid out [b, s, a, d], so contiguous() copies nothing; the math backend's is
    # [b, a, s, d] and contiguous() copies it (core.merge_heads)
    o = core.merge_heads(tape, sh, out) if sh.attention == "math" else ops.view(tape, out)
    tape.drop(out)
    y = linear(tape, o, lw["o"], lw["o.b"], n, sh.h, "o")
    tape.drop(o, qr, kr, vt)
    return y, cache


def repeat_kv(tape: Tape, sh: Shape, x: Tensor) -> Tensor:
    """``x[:, :, None].expand(b, k, a/k, s, d).reshape(b, a, s, d)``: the reshape copies."""
    if sh.a == sh.k:
        return tape.alias(x, x.grad_fn, x.out_index)
    u = ops.view(tape, x)
    e = ops.expand(tape, u, sh.b * sh.a * sh.s * sh.d, "expand.sum")
    tape.drop(u)
    r = ops.clone(tape, e, "repeat_kv")
    tape.drop(e)
    return r


def eager_attention(tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``eager_attention_forward`` (no dropout): the output [b, s, a, d], contiguous."""
    ks = repeat_kv(tape, sh, k)
    vs = repeat_kv(tape, sh, v)
    # torch.matmul(query, key_states.transpose(2, 3)): RoPE's output has q's transposed layout,
    # so matmul's reshape to 3-D copies it; the transposed keys fold as a view
    qc = ops.clone(tape, q, "q.bmm_in")
    sc3 = ops.bmm(tape, qc, ks, sh.b * sh.a * sh.s * sh.s, "scores", grad_names=("x", "y"))
    sc = ops.view(tape, sc3)  # _unsafe_view to [b, a, s, s]
    tape.drop(qc, sc3)
    sm = ops.scale(tape, sc, "scores.scaled")  # * scaling
    tape.drop(sc)
    am = ops.add(tape, sm, None, "scores.masked")  # + attention_mask (no grad)
    tape.drop(sm)
    # softmax(dim=-1, dtype=torch.float32) (an fp32 copy of the scores first unless they are
    # fp32), then .to(query.dtype)
    # (attn_weights is rebound only when the statement ends)
    a32 = ops.to_dtype(tape, am, FP32, "scores.f32", grad_suffix="")
    p32 = ops.softmax(tape, a32, "probs")
    tape.drop(a32)
    pr = ops.to_dtype(tape, p32, q.itemsize, "probs.cast", grad_suffix="")
    tape.drop(p32, am)
    # dropout(p=0.0): returns its input
    o3 = ops.bmm(tape, pr, vs, sh.b * sh.a * sh.s * sh.d, "pv", grad_names=("x", "y"))
    # _unsafe_view to [b, a, s, d]: its gradient arrives transposed (from the contiguous
    # [b, s, a, d] copy below), and reshape to 3-D copies it
    o = ops.view(tape, o3, copy_back=True)
    tape.drop(pr, o3)
    oc = ops.clone(tape, o, "attn.contig")  # attn_output.transpose(1, 2).contiguous()
    tape.drop(o, ks, vs)
    return oc


def causal_mask(tape: Tape, sh: Shape, itemsize: int) -> Tensor:
    """``create_causal_mask`` for eager attention: a [b, 1, s, s] additive float mask built
    from index vectors (``le`` gives the bool [1, 1, s, s], ``where`` the float mask)."""
    ab = ops.plain(tape, sh.b, INT64, "mask.batch_idx")
    ah = ops.plain(tape, 1, INT64, "mask.head_idx")
    idx = []
    for nm in ("q_idx", "kv_idx"):
        ar = ops.plain(tape, sh.s, INT64, f"mask.{nm}.arange")
        idx.append(ops.plain(tape, sh.s, INT64, f"mask.{nm}"))
        tape.drop(ar)
    le = ops.plain(tape, sh.s * sh.s, 1, "mask.bool")
    tape.drop(ab, ah, *idx)
    z = ops.plain(tape, 1, itemsize, "mask.zero")
    mn = ops.plain(tape, 1, itemsize, "mask.min")
    mask = ops.plain(tape, sh.b * sh.s * sh.s, itemsize, "mask")
    tape.drop(mn, z, le)
    return mask


def mlp(tape: Tape, sh: Shape, x: Tensor, lw: dict) -> Tensor:
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""
    n = sh.b * sh.s
    g = linear(tape, x, lw["gate"], lw.get("gate.b"), n, sh.f, "gate")
    sg = ops.unary(tape, g, "silu", saves="input")
    tape.drop(g)
    u = linear(tape, x, lw["up"], lw.get("up.b"), n, sh.f, "up")
    m = ops.mul_broadcast(tape, sg, u, "swiglu")
    tape.drop(sg, u)
    y = linear(tape, m, lw["down"], lw.get("down.b"), n, sh.h, "down")
    tape.drop(m)
    return y


def decoder_layer(
    tape: Tape, sh: Shape, x: Tensor, lw: dict, cos: Tensor, sin: Tensor, use_cache: bool
) -> tuple[Tensor, list]:
    n = sh.b * sh.s
    n1 = rmsnorm(tape, x, lw["norm1"], n)
    att, cache = attention(tape, sh, n1, lw, cos, sin, use_cache)
    tape.drop(n1)
    x2 = ops.add_cast_in_formula(tape, x, att, "resid1")  # residual + hidden_states
    tape.drop(att)
    n2 = rmsnorm(tape, x2, lw["norm2"], n)
    ff = mlp(tape, sh, n2, lw)
    tape.drop(n2)
    x3 = ops.add_cast_in_formula(tape, x2, ff, "resid2")
    tape.drop(ff, x2)
    return x3, cache


def _packed_sequence_check(tape: Tape, sh: Shape) -> None:
    """Without a cache, ``create_causal_mask`` looks for packed sequences in the position ids
    (``find_packed_sequence_indices`` in ``masking_utils.py``): ``diff`` with a prepended
    column, ``!= 1``, ``cumsum``, ``(... == 0).all()``; all freed before the layers run."""
    b, s = sh.b, sh.s
    first = ops.plain(tape, b, INT64, "packed.first")  # position_ids[:, :1] - 1
    cat = ops.plain(tape, b * (s + 1), INT64, "packed.cat")  # diff's prepend
    diff = ops.plain(tape, b * s, INT64, "packed.diff")
    tape.drop(cat)
    ne = ops.plain(tape, b * s, 1, "packed.ne")
    csum = ops.plain(tape, b * s, INT64, "packed.cumsum")
    tape.drop(ne)
    eq = ops.plain(tape, b, 1, "packed.eq")
    all_ = ops.plain(tape, 1, 1, "packed.all")
    tape.drop(eq, all_, first, diff, csum)


def model(
    tape: Tape, sh: Shape, w: Weights, use_cache: bool, sliding_layers: int
) -> tuple[Tensor, list]:
    """``LlamaModel.forward(input_ids)``: the final norm's output and the cache's tensors."""
    n = sh.b * sh.s
    tape.segment = "embed"
    emb = ops.embedding(tape, w.embed, n, sh.h, "embed_out")  # inputs_embeds
    cache: list = []
    if use_cache and sh.device == "cuda":
        # DynamicCache(config): a DynamicSlidingWindowLayer holds torch.tensor(sliding_window)
        # (made outside the dispatcher), moved to the device at its first update: a 0-d int64
        # allocation on CUDA, the same CPU tensor on the CPU (invisible to the CPU tracker;
        # measured: a held mistral output is 1,024 B below a replay that counted them there)
        cache = [ops.plain(tape, 1, INT64, "cache.window") for _ in range(sliding_layers)]
    ar = ops.plain(tape, sh.s, INT64, "arange")  # torch.arange(s) + past_seen_tokens
    pos = ops.plain(tape, sh.s, INT64, "position_ids")
    tape.drop(ar)
    if not use_cache:
        _packed_sequence_check(tape, sh)
    # create_causal_mask: None for sdpa without padding (SDPA gets is_causal=True)
    mask = causal_mask(tape, sh, emb.itemsize) if sh.attention == "eager" else None
    cos, sin = rotary(tape, sh, pos, emb.itemsize)
    x = tape.alias(emb, emb.grad_fn, emb.out_index)  # hidden_states = inputs_embeds
    for j, lw in enumerate(w.layers):
        tape.segment = j
        if sh.recompute == "full":
            # gradient_checkpointing_enable(): GradientCheckpointingLayer runs each layer's
            # forward under non-reentrant torch.utils.checkpoint (transformers 5.24
            # modeling_layers.py / modeling_utils.py) and turns the cache off.
            def run(x: Tensor = x, lw: dict = lw) -> Tensor:
                return decoder_layer(tape, sh, x, lw, cos, sin, False)[0]

            # the checkpoint frame holds the layer's args and kwargs: hidden states,
            # position_embeddings (cos, sin) and position_ids, until the layer's backward
            x_next, c = tape.checkpoint(run, [x, cos, sin, pos]), list[Tensor]()
        else:
            x_next, c = decoder_layer(tape, sh, x, lw, cos, sin, use_cache)
        cache += c
        tape.drop(x)
        x = x_next
    tape.segment = "head"
    hid = rmsnorm(tape, x, w.norm, n)
    tape.drop(x, emb, pos, cos, sin, mask)
    return hid, cache


def causal_lm_loss(tape: Tape, sh: Shape, logits: Tensor) -> Tensor:
    """``ForCausalLMLoss(logits, labels, vocab_size)`` with ``num_items_in_batch=None``."""
    n = sh.b * sh.s
    lf = ops.to_dtype(tape, logits, FP32, "logits.f32", grad_suffix="")  # logits.float()
    padded = ops.plain(tape, sh.b * (sh.s + 1), INT64, "labels.pad")  # F.pad(labels, (0, 1))
    shift = ops.plain(tape, n, INT64, "labels.shift")  # labels[..., 1:].contiguous()
    flat = ops.view(tape, lf)  # logits.view(-1, vocab_size)
    loss = ops.cross_entropy(tape, flat, n, sh.V, flat.itemsize, target=shift)
    tape.drop(flat, lf, padded, shift)
    return loss


def forward(
    tape: Tape, sh: Shape, w: Weights, use_cache: bool = True, sliding_layers: int = 0,
    head: Head | None = None, held: list[Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """``LlamaForCausalLM.forward(input_ids=ids, labels=ids).loss``; returns the loss tensor.

    The output object (holding the logits and the cache) dies before this returns, as in
    ``loss = model(...).loss``. With ``sh.autocast_itemsize`` the forward runs under
    ``torch.autocast`` (fp32 weights), which is left right after (its cast cache dies).
    ``head``/``held``: another loop or loss (`calc.models.head.finish`).
    """
    if sh.attention == "eager" and (sh.autocast_itemsize or sliding_layers):
        # not replayed yet: autocast's casts inside eager attention, and the sliding-window
        # mask (create_sliding_window_causal_mask builds it from more index tensors)
        raise NotImplementedError("eager attention with autocast or a sliding-window cache")
    if sh.attention not in ("flash", "efficient", "eager", "math"):
        raise NotImplementedError(f"attention {sh.attention!r}")
    n = sh.b * sh.s
    if sh.autocast_itemsize:
        tape.autocast_enter(sh.autocast_itemsize)
    hid, cache = model(tape, sh, w, use_cache, sliding_layers)
    tape.segment = "head"
    if head is not None and not head.default:  # the loop's head and loss: calc.models.head
        loss = finish(
            tape, sh, head, hid, cache, lambda t, x, rows, name: linear(
                t, x, w.head, None, rows, sh.V, name), lambda t, lg: causal_lm_loss(t, sh, lg),
            [] if held is None else held,
        )  # fmt: skip
        if sh.autocast_itemsize:
            tape.autocast_exit()
        return loss
    logits = linear(tape, hid, w.head, None, n, sh.V, "logits")  # lm_head(hidden)
    loss = causal_lm_loss(tape, sh, logits)
    tape.drop(hid, logits, *cache)
    if sh.autocast_itemsize:
        tape.autocast_exit()  # leaving ``torch.autocast``: the cast cache is cleared
    return loss
