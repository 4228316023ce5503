"""torchtune's Llama (``implementation="torchtune"``) as a replay: the reference graph
(`calc.models.reference`) with the ops where torchtune 0.6.1's code differs.

verify runs a faithful copy of torchtune's model code (``verify/models/torchtune_llama.py``,
which cites each upstream line and is compared with the library where it installs); this file
follows that copy line by line:

* RMSNorm in fp32: ``F.rms_norm(x.float(), ...).to(x.dtype)`` (`rms_norm`): on CPU torch 2.13
  runs ``rms_norm`` as a composite (``pow``, ``mean``, an in-place ``add_`` of eps, ``rsqrt``,
  two ``mul``), on CUDA ``_fused_rms_norm`` (output and an fp32 ``rstd`` [rows]; saves input and
  ``rstd``: ``torch/_decomp/decompositions.py`` ``_fused_rms_norm``, derivatives.yaml);
* interleaved RoPE in fp32 over one shared fp32 cache [max_seq_len, d/2, 2] (`rope`), applied in
  the ``[b, s, heads, d]`` layout before the transpose;
* grouped k/v expanded to every query head before SDPA (copies: ``expand(...).flatten(1, 2)``),
  no ``enable_gqa``;
* the logits upcast by the model (``output(h).float()``), or ``h.chunk(k, dim=1)`` chunks for
  ``CEWithChunkedOutputLoss`` (each chunk a strided view whose ``linear`` copies it when the
  batch is more than one sequence), and the recipe's ``_loss_step`` around it (`finish`).

The parameters are torchtune's, in its order (`Weights`). torchtune trains in pure bf16 (or
fp32) without autocast, recomputes whole layers (``enable_activation_checkpointing``) and calls
SDPA: `check` refuses the rest. LoRA is torchtune's ``LoRALinear`` (modules/peft/lora.py,
``forward``: ``F.linear`` of the frozen base, ``lora_b(lora_a(dropout(x)))`` times
``alpha / rank``, the sum): the op sequence of `calc.compress.lora.lora_linear`, the adapters in
``q, k, v, output_proj, w1, w2, w3`` order (`LORA_ORDER`). FSDP2 is the distributed recipes'
(`check`), its root hooks where the model returns the logits.
"""

from __future__ import annotations

from dataclasses import replace

from calc.config.jobs import Training
from calc.models import attention_core
from calc.models import reference as ref
from calc.models.head import RootHooks, divide_by_count, root_pre_backward
from calc.models.shape import Shape
from calc.parallel.data import ReplayPlan
from calc.replay import ops
from calc.replay.tape import Node, Size, Tape, Tensor, divide

FP32 = 4
INT64 = 8
MLP_ORDER = ("gate", "down", "up")
"""``FeedForward``'s parameters in registration order: ``w1`` (gate), ``w2`` (down), ``w3``."""
LORA_ORDER = ("q", "k", "v", "o", *MLP_ORDER)
"""The decoder linears in torchtune's registration order (LoRA's adapters follow it)."""


class Weights(ref.Weights):
    """The reference model's parameters in torchtune's ``parameters()`` order: per layer the
    attention projections, ``w1``, ``w2``, ``w3``, then ``sa_norm`` and ``mlp_norm``."""

    def __init__(self, tape: Tape, sh: Shape) -> None:
        super().__init__(tape, sh)
        order = ("q", "q.b", "k", "k.b", "v", "v.b", "o", "o.b", *MLP_ORDER, "norm1", "norm2")
        self.layers = [{key: lw[key] for key in order if key in lw} for lw in self.layers]


def check(sh: Shape, job: Training, dp: ReplayPlan | None) -> None:
    """Raise ``NotImplementedError`` for what the torchtune replay does not model. Data
    parallelism is its distributed recipes' (``full_finetune_distributed``,
    ``lora_finetune_distributed``): FSDP2 ``fully_shard`` per layer and root, no
    ``MixedPrecisionPolicy`` (the model is bf16 or fp32 itself), no offload."""
    if job.pruning is not None or job.distill is not None:
        raise NotImplementedError(
            "implementation='torchtune' is modelled without pruning and distillation (LoRA "
            "and QLoRA are: torchtune's LoRALinear and FrozenNF4Linear)"
        )
    # a quantized base (QLoRA) is checked by calc.compress.nf4_torchao.check_job
    if job.lora is not None and job.lora.adapter_dtype is not None:
        raise NotImplementedError(
            "implementation='torchtune' LoRA with adapter_dtype: torchtune builds the adapters "
            "in the model's dtype"
        )
    fsdp2 = dp is not None and dp == ReplayPlan(
        fsdp=True, shard_world=dp.shard_world, reshard_after_forward=dp.reshard_after_forward,
        cast_forward_inputs=dp.cast_forward_inputs,
    )  # fmt: skip
    if dp is not None and not fsdp2:
        raise NotImplementedError(
            "implementation='torchtune' under data parallelism is modelled as its distributed "
            "recipes run: fsdp=True (fully_shard per layer and root) without "
            "fsdp_param_dtype (torchtune trains the model in its own dtype) and without offload"
        )
    loop, loss = job.loop, job.loss
    if sh.model_type not in ("llama", "mistral", "qwen2") or sh.qk_norm:
        raise NotImplementedError(
            f"implementation='torchtune' is modelled for llama, mistral and qwen2 (model_type="
            f"{sh.model_type!r}{', q/k norms' if sh.qk_norm else ''})"
        )
    if sh.autocast_itemsize:
        raise NotImplementedError(
            "implementation='torchtune' under autocast: torchtune's recipes train in pure "
            "precision; use precision='bf16' or 'fp32'"
        )
    if sh.attention not in ("flash", "efficient"):
        raise NotImplementedError(
            f"implementation='torchtune' with the {sh.attention!r} attention kernel: modelled "
            "with SDPA's fused kernels (flash, efficient)"
        )
    if sh.recompute == "selective":
        raise NotImplementedError(
            "implementation='torchtune' checkpoints whole layers: recompute='full' or 'none'"
        )
    if max(sh.attn_dropout, sh.hidden_dropout, sh.embed_dropout) > 0:
        raise NotImplementedError("implementation='torchtune' with dropout (use dropout=0)")
    if sh.tp_comm or sh.sp > 1:
        raise NotImplementedError("implementation='torchtune' with tensor parallelism")
    if loop != "del-logits" or loss not in ("cross-entropy", "chunked-ce"):
        raise NotImplementedError(
            f"implementation='torchtune' with loop={loop!r}, loss={loss!r}: the recipe's loop "
            "is loop='del-logits' (its ``del logits``), its losses 'cross-entropy' "
            "(torch.nn.CrossEntropyLoss) and 'chunked-ce' (CEWithChunkedOutputLoss)"
        )


def buffers(tape: Tape, sh: Shape, max_positions: int) -> Tensor:
    """The shared RoPE module's fp32 buffers, ``theta`` [d/2] and ``cache`` [max_positions,
    d/2, 2] (``max_positions`` a number: part of the structure, as the tables of the planner
    hold no size for it); the cache is returned."""
    tape.existing(divide(sh.d, 2), FP32, "rope_theta", "buffer")
    return tape.existing(max_positions * sh.d, FP32, "rope_cache", "buffer")


def rms_norm(tape: Tape, sh: Shape, x: Tensor, w: Tensor, rows: Size) -> Tensor:
    """``F.rms_norm(x.float(), (h,), weight=w, eps=eps).to(x.dtype)``."""
    xf = ops.to_dtype(tape, x, FP32, "norm.float")
    if sh.device == "cuda" and w.itemsize == FP32:  # fp32 input and weight: the fused kernel
        y = fused_rms_norm(tape, xf, w, rows)
    else:  # the composite: eps added in place to the mean (no allocation)
        p = ops.pow2(tape, xf, "norm.pow")
        m = ops.mean_last(tape, p, rows, "norm.mean")
        r = ops.rsqrt(tape, m, "norm.rstd")
        tape.drop(m, p)  # temporaries of one C++ expression: freed at its end, last made first
        xn = ops.mul(tape, xf, r, "norm.xhat")
        tape.drop(r)
        y = ops.mul(tape, xn, w, "norm.out")
        tape.drop(xn)
    out = ops.to_dtype(tape, y, x.itemsize, "norm.cast")
    tape.drop(y, xf)
    return out


def fused_rms_norm(tape: Tape, x: Tensor, w: Tensor, rows: Size) -> Tensor:
    """CUDA's ``_fused_rms_norm``: output and fp32 ``rstd`` [rows]; saves input, weight and
    ``rstd``; backward ``_fused_rms_norm_backward``: the input's then the weight's gradient."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        gx = tape.new(x.numel, x.itemsize, "dnorm.in") if tape.needs_grad(x) else None
        return [gx, tape.new(w.numel, w.itemsize, "dnorm.w")]

    out = tape.new(x.numel, x.itemsize, "norm.out")
    rstd = tape.new(rows, FP32, "norm.rstd")
    n = tape.node("FusedRmsNorm", rule, [x, w], saved=[x, w, rstd])
    tape.drop(rstd)
    return tape.output(out, n)


def _sub(tape: Tape, x: Tensor, y: Tensor, name: str) -> Tensor:
    """``x - y``: saves nothing; backward hands ``grad`` to x and ``-grad`` (new) to y."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g), tape.new(y.numel, g.itemsize, f"d{name}.neg")]

    n = tape.node("Sub", rule, [x, y])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def rope(tape: Tape, x: Tensor, cache: Tensor, name: str) -> Tensor:
    """``RotaryPositionalEmbeddings.forward(x)`` on ``x`` [b, s, heads, d]: ``x.float()``
    paired on the last dimension, ``stack([x0*c - x1*s, x1*c + x0*s], -1)`` (each product and
    difference a temporary of its expression), ``flatten(3).type_as(x)``."""
    xf = ops.to_dtype(tape, x, FP32, f"{name}.float")  # ``xshaped``: a local until return
    xs = ops.view(tape, xf)
    c = tape.alias(cache)  # views of the buffer: cache[:s][..., 0] and [..., 1]
    # ``xs[..., i]`` selects half the elements (a view) and its ``SelectBackward0`` fills an
    # input-sized zero tensor, as a slice of half the last dimension does: `ops.slice_half`
    x0 = ops.slice_half(tape, xs, f"{name}.x0")
    t1 = ops.mul(tape, x0, c, f"{name}.x0c", out_numel=x0.numel)
    x1 = ops.slice_half(tape, xs, f"{name}.x1")
    t2 = ops.mul(tape, x1, c, f"{name}.x1s", out_numel=x1.numel)
    real = _sub(tape, t1, t2, f"{name}.real")
    tape.drop(x0, t1, x1, t2)
    x1 = ops.slice_half(tape, xs, f"{name}.x1")
    t3 = ops.mul(tape, x1, c, f"{name}.x1c", out_numel=x1.numel)
    x0 = ops.slice_half(tape, xs, f"{name}.x0")
    t4 = ops.mul(tape, x0, c, f"{name}.x0s", out_numel=x0.numel)
    imag = ops.add(tape, t3, t4, f"{name}.imag")
    tape.drop(x1, t3, x0, t4, c)
    # stack([real, imag], -1): a new tensor of both; backward ``unbind`` hands each a view of
    # the gradient, as `ops.cat2`'s narrowed views do
    out = ops.cat2(tape, real, imag, f"{name}.rope")
    tape.drop(real, imag)
    flat = ops.view(tape, out)
    tape.drop(out)
    res = ops.to_dtype(tape, flat, x.itemsize, f"{name}.type_as")
    tape.drop(xs, xf, flat)  # the locals, in the order the frame holds them
    return res


def attention(tape: Tape, sh: Shape, x: Tensor, lw: dict, cache: Tensor) -> Tensor:
    """``MultiHeadAttention.forward(x, x)``."""
    n = sh.b * sh.s
    q = ops.linear(tape, x, lw["q"], lw["q.b"], n, sh.a * sh.d, "q")
    qv = ops.view(tape, q)
    tape.drop(q)
    qr = rope(tape, qv, cache, "q")
    tape.drop(qv)
    qt = ops.view(tape, qr, name="Transpose")
    tape.drop(qr)
    k = ops.linear(tape, x, lw["k"], lw["k.b"], n, sh.k * sh.d, "k")
    v = ops.linear(tape, x, lw["v"], lw["v.b"], n, sh.k * sh.d, "v")
    kv, vv = ops.view(tape, k), ops.view(tape, v)
    tape.drop(k, v)
    kr = rope(tape, kv, cache, "k")
    tape.drop(kv)
    kt, vt = ops.view(tape, kr, name="Transpose"), ops.view(tape, vv, name="Transpose")
    tape.drop(kr, vv)
    if sh.gqa:
        ke, ve = _expand_heads(tape, sh, kt, "k"), _expand_heads(tape, sh, vt, "v")
        tape.drop(kt, vt)
        kt, vt = ke, ve
    out = attention_core.core(tape, replace(sh, k=sh.a, gqa=False), qt, kt, vt, "attn")
    tape.drop(qt, kt, vt)
    o = attention_core.merge_heads(tape, sh, out)
    tape.drop(out)
    y = ops.linear(tape, o, lw["o"], lw["o.b"], n, sh.h, "o")
    tape.drop(o)
    return y


def _expand_heads(tape: Tape, sh: Shape, x: Tensor, name: str) -> Tensor:
    """``x.unsqueeze(2).expand(b, k, a/k, s, d).flatten(1, 2)``: a copy (``clone`` and
    ``_unsafe_view``), except with one kv head, whose size-1 dimension lets ``flatten`` view the
    expanded tensor; backward ``sum_to_size`` of the expand (one x-sized gradient)."""
    numel = sh.b * sh.a * sh.s * sh.d
    if not attention_core.known_one(sh.k):
        return ops.repeat_interleave(tape, x, numel, f"{name}.expand")
    u = ops.view(tape, x, name="Unsqueeze")
    e = ops.expand(tape, u, numel, f"{name}.expand")
    out = ops.view(tape, e, name="Flatten")
    tape.drop(u, e)
    return out


def block(tape: Tape, sh: Shape, x: Tensor, lw: dict, cache: Tensor) -> Tensor:
    """``TransformerSelfAttentionLayer.forward`` (modules/transformer.py:121-132): its local
    ``attn_out`` lives until it returns."""
    n = sh.b * sh.s
    h = rms_norm(tape, sh, x, lw["norm1"], n)
    att = attention(tape, sh, h, lw, cache)
    tape.drop(h)
    h2 = ops.add(tape, att, x, "resid1")
    m = rms_norm(tape, sh, h2, lw["norm2"], n)
    ff = ref.mlp(tape, sh, m, lw)
    tape.drop(m)
    out = ops.add(tape, h2, ff, "resid2")
    tape.drop(h2, ff, att)  # ``attn_out`` is a local of the whole forward
    return out


def hidden(tape: Tape, sh: Shape, w: Weights, cache: Tensor, ids: Tensor) -> Tensor:
    """``TransformerDecoder.forward`` up to the final norm's output, under the recipe's
    activation offloading when the tape has it (`calc.replay.offload`: from the embedding to
    the final norm; the output projection runs under its ``NoOpManager``)."""
    tape.segment = "embed"
    if tape.offload is not None:
        tape.offload.active = True
    x = ops.embedding(tape, w.embed, sh.b * sh.s, sh.h, "embed_out", indices=ids)
    x = ref.layers(tape, sh, w.layers, x, lambda x, lw: block(tape, sh, x, lw, cache))
    tape.segment = "head"
    hid = rms_norm(tape, sh, x, w.norm, sh.b * sh.s)
    tape.drop(x)
    if tape.offload is not None:
        tape.offload.active = False
    return hid


def forward(
    tape: Tape,
    sh: Shape,
    w: Weights,
    cache: Tensor,
    loss: str,
    chunks: int,
    one_sequence: bool,
    ids: Tensor,
    root: RootHooks | None = None,
) -> Tensor:
    """The recipe's ``_loss_step``: the model's logits, the labels shifted with
    ``torch.hstack`` (int64 [b, s]), the loss, ``del logits``; returns the loss.
    ``one_sequence``: a micro-batch of one sequence (the chunks of ``chunked-ce`` are then
    contiguous: no copies). ``root``: FSDP2's root, whose post-forward runs as the model
    returns its logits and whose pre-backward hook sits on each of them. ``ids``: the input
    token ids (the embedding saves them)."""
    n = sh.b * sh.s
    hid = hidden(tape, sh, w, cache, ids)
    if loss == "chunked-ce":
        logits = _chunked_logits(tape, sh, w, hid, chunks, one_sequence)
    else:
        out = ops.linear(tape, hid, w.head, None, n, sh.V, "logits")
        logits = [ops.to_dtype(tape, out, FP32, "logits.float")]
        tape.drop(out)
    tape.drop(hid)
    if root is not None:
        root.end_forward(tape)
        logits = [root_pre_backward(tape, x, root) for x in logits]
    labels = tape.new(n, INT64, "labels.hstack")
    if loss == "chunked-ce":
        result = _chunked_loss(tape, sh, logits, one_sequence)
    else:
        flat = ops.view(tape, logits[0])  # logits.reshape(-1, V)
        result = ops.cross_entropy(tape, flat, n, sh.V, FP32)
        tape.drop(flat)
    tape.drop(*logits, labels)
    return result


def _chunked_logits(
    tape: Tape, sh: Shape, w: Weights, hid: Tensor, k: int, one_sequence: bool
) -> list[Tensor]:
    """``[output(c) for c in h.chunk(k, dim=1)]``: ``split`` views (one ``SplitBackward0``:
    the gradients concatenated, one input-sized tensor); with more than one sequence a chunk
    [b, s/k, h] is not a view of [b*s/k, h], so ``linear`` folds it with a copy (``matmul``'s
    ``reshape``), saved for the weight's gradient."""
    rows = divide(sh.b * sh.s, k)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = next(g for g in grads if g is not None)
        return [tape.new(hid.numel, g.itemsize, "dsplit")]

    split = tape.node("Split", rule, [hid], n_outputs=k)
    pieces = [tape.alias(hid, split, i, numel=rows * sh.h) for i in range(k)]
    out = []
    for i, piece in enumerate(pieces):
        src = piece if one_sequence else ops.clone(tape, piece, f"hidden.{i}.fold")
        out.append(ops.linear(tape, src, w.head, None, rows, sh.V, f"logits.{i}"))
        if src is not piece:
            tape.drop(src)
    tape.drop(*pieces)
    return out


def _chunked_loss(tape: Tape, sh: Shape, chunks: list[Tensor], one_sequence: bool) -> Tensor:
    """``CEWithChunkedOutputLoss.forward``: ``(labels != -100).sum()``; each labels chunk
    ``reshape(-1)`` (a copy with more than one sequence); per chunk ``cross_entropy(
    chunk.float(), ..., reduction="sum")``: the first added to the Python float ``0.0`` (a new
    0-d tensor), the others in place (``+=`` on a tensor); ``total / count``."""
    n = sh.b * sh.s
    rows = divide(n, len(chunks))
    mask = tape.new(n, 1, "labels.ne")
    count = tape.new(1, INT64, "labels.count")
    tape.drop(mask)
    copies = 0 if one_sequence else len(chunks)
    targets = [tape.new(rows, INT64, f"labels.{i}") for i in range(copies)]
    total: Tensor | None = None
    for i, c in enumerate(chunks):
        up = ops.to_dtype(tape, c, FP32, f"logits.{i}.float")
        part = ops.cross_entropy(tape, up, rows, sh.V, FP32)
        tape.drop(up)
        if total is None:
            total = ops.add(tape, part, None, "loss.sum")
        else:
            total = _add_inplace(tape, total, part)
        tape.drop(part)
    assert total is not None
    loss = divide_by_count(tape, total, count)
    tape.drop(total, count, *targets)
    return loss


def _add_inplace(tape: Tape, x: Tensor, y: Tensor) -> Tensor:
    """``x += y`` on a tensor (``add_``): no allocation, x's history rebased on an
    ``AddBackward0`` that hands the gradient to both; the old reference is released."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g), tape.alias(g)]

    n = tape.node("Add", rule, [x, y])
    out = tape.alias(x, n)
    tape.drop(x)
    return out
