"""The `reference` implementation (verify/models/reference.py) as a replay on a `Tape`.

Each function follows one method of the plain-PyTorch model line by line: the ops it calls,
in order, and the moment each Python local dies. Change the model, change this file.
"""

from __future__ import annotations

from collections.abc import Callable

from calc.models import attention_core
from calc.models.head import Head, finish
from calc.models.shape import Shape
from calc.parallel import sequence as sequence_parallel
from calc.parallel import tensor as tensor_parallel
from calc.replay import ops
from calc.replay.kinds import StorageKind
from calc.replay.tape import SavePolicy, Size, Tape, Tensor, divide


def _col(tape: Tape, sh: Shape, x: Tensor, w: Tensor, b: Tensor | None, n: Size, out: Size,
         name: str) -> Tensor:  # fmt: skip
    """A column-parallel linear under tensor parallelism, else ``F.linear``."""
    if sh.tp_comm:
        return tensor_parallel.column_linear(tape, x, w, b, n, out, name)
    return ops.linear(tape, x, w, b, n, out, name)


def _row(tape: Tape, sh: Shape, x: Tensor, w: Tensor, b: Tensor | None, n: Size, out: Size,
         name: str) -> Tensor:  # fmt: skip
    """A row-parallel linear under tensor parallelism, else ``F.linear``."""
    if sh.sp > 1:
        return sequence_parallel.row_linear(tape, x, w, b, n, out, name, sh.sp)
    if sh.tp_comm:
        return tensor_parallel.row_linear(tape, x, w, b, n, out, name)
    return ops.linear(tape, x, w, b, n, out, name)


class Weights:
    """The model's parameters as leaves on the tape, per layer, in ``parameters()`` order."""

    def __init__(self, tape: Tape, sh: Shape) -> None:
        w = sh.weight_itemsize
        h, a, k, d, f, V = sh.h, sh.a, sh.k, sh.d, sh.f, sh.V

        def leaf(numel: Size, name: str, tag: object) -> Tensor:
            return tape.existing(numel, w, name, StorageKind.WEIGHT, leaf=True, tag=tag)

        gpt2 = sh.model_type == "gpt2"
        self.embed = leaf(V * h, "embed", "embed")
        self.wpe = leaf(sh.P * h, "wpe", "embed") if gpt2 else None
        self.layers: list[dict[str, Tensor | None]] = []
        for j in range(sh.n_layers):
            lw: dict[str, Tensor | None] = {}
            if gpt2:
                lw["norm1"] = leaf(h, "ln_1", j)
                lw["norm1.b"] = leaf(h, "ln_1.b", j) if sh.norm_bias else None
                lw["qkv"] = leaf(3 * h * h, "c_attn", j)
                lw["qkv.b"] = leaf(3 * h, "c_attn.b", j) if sh.qkv_bias else None
                lw["o"] = leaf(h * h, "attn.c_proj", j)
                lw["o.b"] = leaf(h, "attn.c_proj.b", j) if sh.o_bias else None
                lw["norm2"] = leaf(h, "ln_2", j)
                lw["norm2.b"] = leaf(h, "ln_2.b", j) if sh.norm_bias else None
                lw["fc"] = leaf(f * h, "c_fc", j)
                lw["fc.b"] = leaf(f, "c_fc.b", j) if sh.mlp_bias else None
                lw["proj"] = leaf(f * h, "mlp.c_proj", j)
                lw["proj.b"] = leaf(h, "mlp.c_proj.b", j) if sh.mlp_bias else None
                self.layers.append(lw)
                continue
            lw["q"] = leaf(a * d * h, "q_proj", j)
            lw["q.b"] = leaf(a * d, "q_proj.b", j) if sh.qkv_bias else None
            lw["k"] = leaf(k * d * h, "k_proj", j)
            lw["k.b"] = leaf(k * d, "k_proj.b", j) if sh.qkv_bias else None
            lw["v"] = leaf(k * d * h, "v_proj", j)
            lw["v.b"] = leaf(k * d, "v_proj.b", j) if sh.qkv_bias else None
            lw["o"] = leaf(a * d * h, "o_proj", j)
            lw["o.b"] = leaf(h, "o_proj.b", j) if sh.o_bias else None
            if sh.qk_norm:
                lw["q_norm"] = leaf(d, "q_norm", j)
                lw["k_norm"] = leaf(d, "k_norm", j)
            lw["gate"] = leaf(f * h, "gate_proj", j)
            lw["up"] = leaf(f * h, "up_proj", j)
            lw["down"] = leaf(f * h, "down_proj", j)
            lw["norm1"] = leaf(h, "input_layernorm", j)
            lw["norm2"] = leaf(h, "post_attention_layernorm", j)
            self.layers.append(lw)
        self.norm = leaf(h, "norm", "head")
        self.norm_b = leaf(h, "norm.b", "head") if gpt2 and sh.norm_bias else None
        self.head = self.embed if sh.tied else leaf(divide(V * h, sh.head_split), "lm_head", "head")

    def shapes(self, sh: Shape) -> list[tuple]:
        """Each parameter's shape (``nn.Linear`` weights are [out, in]), in parameters() order."""
        h, a, k, d, f, V, P = sh.h, sh.a, sh.k, sh.d, sh.f, sh.V, sh.P
        two_d = {
            "embed": (V, h), "lm_head": (V / sh.head_split, h), "wpe": (P, h), "q_proj": (a * d, h),
            "k_proj": (k * d, h), "v_proj": (k * d, h), "o_proj": (h, a * d),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f), "c_attn": (3 * h, h),
            "attn.c_proj": (h, h), "c_fc": (f, h), "mlp.c_proj": (h, f),
        }  # fmt: skip
        return [two_d.get(p.name, (p.numel,)) for p in self.parameters()]

    def parameters(self) -> list[Tensor]:
        """In ``model.parameters()`` order (a tied head is the embedding, listed once)."""
        out = [self.embed] + ([self.wpe] if self.wpe is not None else [])
        for lw in self.layers:
            out.extend(t for t in lw.values() if t is not None)
        out.append(self.norm)
        if self.norm_b is not None:
            out.append(self.norm_b)
        if self.head is not self.embed:
            out.append(self.head)
        return out


def rmsnorm(tape: Tape, x: Tensor, w: Tensor, rows: Size) -> Tensor:
    """``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w``."""
    p = ops.pow2(tape, x, "norm.pow")
    m = ops.mean_last(tape, p, rows, "norm.mean")
    tape.drop(p)
    e = ops.add(tape, m, None, "norm.eps")
    tape.drop(m)
    r = ops.rsqrt(tape, e, "norm.rstd")
    tape.drop(e)
    xn = ops.mul(tape, x, r, "norm.xhat")
    y = ops.mul(tape, xn, w, "norm.out")
    tape.drop(xn, r)
    return y


def norm(tape: Tape, sh: Shape, x: Tensor, w: Tensor, bias: Tensor | None, rows: Size) -> Tensor:
    """The model's norm: decomposed RMSNorm or ``nn.LayerNorm``."""
    if sh.norm == "layernorm":
        return ops.layer_norm(tape, x, w, bias, rows)
    return rmsnorm(tape, x, w, rows)


def rope(tape: Tape, x: Tensor, cos: Tensor, sin: Tensor, name: str) -> Tensor:
    """``x * cos + rotate_half(x) * sin``."""
    t1 = ops.mul(tape, x, cos, f"{name}.cos")
    x1, x2 = ops.chunk2(tape, x)
    n2 = ops.neg(tape, x2, f"{name}.neg")
    rot = ops.cat2(tape, n2, x1, f"{name}.rot")
    tape.drop(n2, x1, x2)
    t2 = ops.mul(tape, rot, sin, f"{name}.sin")
    tape.drop(rot)
    out = ops.add(tape, t1, t2, f"{name}.rope")
    tape.drop(t1, t2)
    return out


def attention(
    tape: Tape, sh: Shape, x: Tensor, lw: dict, cos: Tensor | None, sin: Tensor | None
) -> Tensor:
    n = sh.b * sh.s
    if sh.model_type == "gpt2":
        return _attention_gpt2(tape, sh, x, lw)
    q = _col(tape, sh, x, lw["q"], lw["q.b"], n, sh.a * sh.d, "q")
    k = _col(tape, sh, x, lw["k"], lw["k.b"], n, sh.k * sh.d, "k")
    v = _col(tape, sh, x, lw["v"], lw["v.b"], n, sh.k * sh.d, "v")
    # q.view, k.view, [q/k norms], q.transpose, k.transpose, v.view.transpose: node order as
    # the model creates them. RoPE's outputs are contiguous in [b, a, s, d], so the gradients
    # of q and k reach their first view transposed and are copied there (and v's too, under
    # math/eager attention): `attention_core.view_grad_copies`.
    gq, gk, gv = attention_core.view_grad_copies(sh)
    qv = ops.view(tape, q, copy_back=gq)
    kv = ops.view(tape, k, copy_back=gk)
    tape.drop(q, k)
    if sh.qk_norm:
        qn = rmsnorm(tape, qv, lw["q_norm"], n * sh.a)
        kn = rmsnorm(tape, kv, lw["k_norm"], n * sh.k)
        tape.drop(qv, kv)
        qv, kv = qn, kn
    qt, kt = ops.view(tape, qv), ops.view(tape, kv)
    tape.drop(qv, kv)
    vv = ops.view(tape, v, copy_back=gv)
    vt = ops.view(tape, vv)
    tape.drop(v, vv)
    # ``rope[0].to(q.dtype)``: a no-op unless autocast made q 16-bit over fp32 tables.
    assert cos is not None and sin is not None  # RoPE models (gpt2 takes the other path)
    cq = ops.to_dtype(tape, cos, qt.itemsize, "rope_cos.cast")
    sq = ops.to_dtype(tape, sin, qt.itemsize, "rope_sin.cast")
    qr = rope(tape, qt, cq, sq, "q")
    tape.drop(qt)
    kr = rope(tape, kt, cq, sq, "k")
    tape.drop(kt)
    read = (
        tape.kv_hook(tape, kr, vt) if tape.kv_hook is not None else None
    )  # calc.compress.kv_quant
    out = _core(tape, sh, qr, *(read or (kr, vt)))
    o = attention_core.merge_heads(tape, sh, out)
    tape.drop(out)
    y = _row(tape, sh, o, lw["o"], lw["o.b"], n, sh.h, "o")
    tape.drop(o, qr, kr, vt, cq, sq, *(read or ()))
    return y


def _core(tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``Attention.core``, checkpointed under selective recomputation."""
    if sh.recompute == "selective":
        return tape.checkpoint(lambda: _sdpa(tape, sh, q, k, v), [q, k, v])
    return _sdpa(tape, sh, q, k, v)


def _sdpa(tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The attention core; under autocast SDPA casts fp32 inputs first (k, q, v as traced)."""
    casts = []
    if tape.autocast_itemsize and sh.attention != "eager":
        kc = ops.autocast_cast(tape, k, "k.cast")
        qc = ops.autocast_cast(tape, q, "q.cast")
        vc = ops.autocast_cast(tape, v, "v.cast")
        q, k, v = qc, kc, vc
        casts = [qc, kc, vc]
    out = attention_core.core(tape, sh, q, k, v, "attn")
    tape.drop(*casts)
    return out


def _attention_gpt2(tape: Tape, sh: Shape, x: Tensor, lw: dict) -> Tensor:
    """Fused ``c_attn`` split into q, k, v views (no RoPE), SDPA, ``c_proj``."""
    n = sh.b * sh.s
    qkv = ops.linear(tape, x, lw["qkv"], lw["qkv.b"], n, 3 * sh.h, "qkv")
    q, k, v = ops.split3(tape, qkv)
    tape.drop(qkv)
    gq, gk, gv = attention_core.view_grad_copies(sh)
    qv, kv = ops.view(tape, q, copy_back=gq), ops.view(tape, k, copy_back=gk)
    tape.drop(q, k)
    qt, kt = ops.view(tape, qv), ops.view(tape, kv)
    tape.drop(qv, kv)
    vv = ops.view(tape, v, copy_back=gv)
    vt = ops.view(tape, vv)
    tape.drop(v, vv)
    out = _core(tape, sh, qt, kt, vt)
    o = attention_core.merge_heads(tape, sh, out)
    tape.drop(out)
    y = ops.linear(tape, o, lw["o"], lw["o.b"], n, sh.h, "o")
    tape.drop(o, qt, kt, vt)
    return y


def mlp(tape: Tape, sh: Shape, x: Tensor, lw: dict) -> Tensor:
    n = sh.b * sh.s
    if sh.mlp == "gelu":
        fc = _col(tape, sh, x, lw["fc"], lw["fc.b"], n, sh.f, "fc")
        act = ops.unary(tape, fc, "gelu", saves="input")
        tape.drop(fc)
        y = _row(tape, sh, act, lw["proj"], lw["proj.b"], n, sh.h, "proj")
        tape.drop(act)
        return y
    g = _col(tape, sh, x, lw["gate"], None, n, sh.f, "gate")
    sg = ops.unary(tape, g, "silu", saves="input")
    tape.drop(g)
    u = _col(tape, sh, x, lw["up"], None, n, sh.f, "up")
    m = ops.mul(tape, sg, u, "swiglu")
    tape.drop(sg, u)
    y = _row(tape, sh, m, lw["down"], None, n, sh.h, "down")
    tape.drop(m)
    return y


def _maybe_dropout(tape: Tape, sh: Shape, x: Tensor, p: float, name: str) -> Tensor:
    """``F.dropout(x, p) if p > 0 else x``; the input reference is consumed."""
    if p <= 0:
        return x
    out = ops.dropout(tape, x, name, sh.device)
    tape.drop(x)
    return out


def _gather(tape: Tape, sh: Shape, x: Tensor, name: str) -> Tensor:
    """``PrepareModuleInput(Shard(1) -> Replicate)`` under sequence parallelism, else ``x``."""
    if sh.sp == 1:
        return ops.view(tape, x)
    return sequence_parallel.gather(tape, x, sh.b * sh.s * sh.h, name)


def block(
    tape: Tape, sh: Shape, x: Tensor, lw: dict, cos: Tensor | None, sin: Tensor | None
) -> Tensor:
    n = sh.local_rows
    n1 = norm(tape, sh, x, lw["norm1"], lw.get("norm1.b"), n)
    g1 = _gather(tape, sh, n1, "sp.attn_in")
    att = attention(tape, sh, g1, lw, cos, sin)
    tape.drop(n1, g1)
    att = _maybe_dropout(tape, sh, att, sh.hidden_dropout, "attn.drop")
    x2 = ops.add(tape, x, att, "resid1")
    tape.drop(att)
    n2 = norm(tape, sh, x2, lw["norm2"], lw.get("norm2.b"), n)
    g2 = _gather(tape, sh, n2, "sp.mlp_in")
    ff = mlp(tape, sh, g2, lw)
    tape.drop(n2, g2)
    ff = _maybe_dropout(tape, sh, ff, sh.hidden_dropout, "mlp.drop")
    x3 = ops.add(tape, x2, ff, "resid2")
    tape.drop(ff, x2)
    return x3


def forward(
    tape: Tape, sh: Shape, w: Weights, cos: Tensor | None, sin: Tensor | None,
    head: Head | None = None, held: list[Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """``ReferenceLM.forward(ids, targets)``; returns the loss tensor. ``head``/``held``:
    another loop or loss (`calc.models.head.finish`; the model's cross-entropy is
    ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())``)."""
    if head is not None and not head.default:
        tp = sh.sp > 1 or sh.tp_vocab  # the head a tensor-parallel plan splits

        def linear(t: Tape, x: Tensor, rows: Size, name: str) -> Tensor:
            if tp:
                return head_logits(t, sh, w, x)
            return ops.linear(t, x, w.head, None, rows, sh.V, name)

        return finish(
            tape, sh, head, hidden(tape, sh, w, cos, sin), None, linear,
            lambda t, lg: cross_entropy(t, sh, lg), [] if held is None else held,
        )  # fmt: skip
    out = logits(tape, sh, w, cos, sin)
    loss = cross_entropy(tape, sh, out)
    tape.drop(out)
    return loss


def cross_entropy(tape: Tape, sh: Shape, logits: Tensor) -> Tensor:
    """``F.cross_entropy(logits.flatten(0, 1), targets.flatten())``; on vocabulary-sharded
    logits ``loss_parallel``'s (`calc.parallel.tensor.loss_parallel_cross_entropy`)."""
    flat = ops.view(tape, logits)
    n = sh.b * sh.s
    if sh.tp_vocab:  # loss_parallel's cross entropy over the vocabulary shards
        loss = tensor_parallel.loss_parallel_cross_entropy(tape, flat, n, sh.V, logits.itemsize)
    else:
        loss = ops.cross_entropy(tape, flat, n, sh.V, logits.itemsize)
    tape.drop(flat)
    return loss


def embed_no_grad(tape: Tape, sh: Shape, w: Weights) -> tuple[Tensor, Tensor | None]:
    """``ReferenceLM.hidden_states``' embedding with grad off (inference, a distillation
    teacher): ``(x, positions)``. GPT-2's ``torch.arange`` positions (int64) stay alive as a
    local of ``hidden_states`` until it returns (the caller drops them); no other model has
    them (``None``)."""
    n = sh.b * sh.s
    if sh.model_type != "gpt2":
        return ops.embedding(tape, w.embed, n, sh.h, "embed_out"), None
    pos = tape.new(sh.s, 8, "positions")
    tok = ops.embedding(tape, w.embed, n, sh.h, "wte_out")
    assert w.wpe is not None  # gpt2 has its learned position table
    pe = ops.embedding(tape, w.wpe, sh.s, sh.h, "wpe_out")
    x = ops.add(tape, tok, pe, "embed_out")
    tape.drop(tok, pe)
    return x, pos


def logits(tape: Tape, sh: Shape, w: Weights, cos: Tensor | None, sin: Tensor | None) -> Tensor:
    """``F.linear(ReferenceLM.hidden_states(ids), head_weight())``: the logits ``[b*s, V]``
    (what ``forward`` feeds the loss; distillation's student, `calc.compress.distill`)."""
    hid = hidden(tape, sh, w, cos, sin)
    out = head_logits(tape, sh, w, hid)
    tape.drop(hid)
    return out


def head_logits(tape: Tape, sh: Shape, w: Weights, hid: Tensor) -> Tensor:
    """The head called as a module on the final hidden states ``hid`` (kept: the caller drops
    it): a plain linear, or the tensor-parallel plan's ``ColwiseParallel`` head, its logits
    vocabulary-sharded for ``loss_parallel`` or all-gathered, its input all-gathered over the
    sequence under sequence parallelism (``verify/dist/tp_plans.py``)."""
    n = sh.b * sh.s
    if sh.sp > 1:  # ColwiseParallel(input_layouts=Shard(1)) head, logits all-gathered
        g = sequence_parallel.gather(tape, hid, n * sh.h, "sp.head_in", grad="reduce_scatter")
        if sh.tp_vocab:  # logits stay vocabulary-sharded for loss_parallel
            out = ops.linear(tape, g, w.head, None, n, sh.V, "logits")
            tape.drop(g)
            return out
        part = ops.linear(tape, g, w.head, None, n, divide(sh.V, sh.sp), "logits.local")
        out = sequence_parallel.gather(tape, part, n * sh.V, "logits")
        tape.drop(part, g)
        return out
    if sh.tp_vocab:  # ColwiseParallel head: logits [n, V / tp]
        return tensor_parallel.column_linear(tape, hid, w.head, None, n, sh.V, "logits")
    return ops.linear(tape, hid, w.head, None, n, sh.V, "logits")


def layers(
    tape: Tape,
    sh: Shape,
    weights: list[dict],
    x: Tensor,
    run: Callable[[Tensor, dict], Tensor],
    early_stop: bool = True,
    policy: SavePolicy | None = None,
    checkpointed: Callable[[int], bool] = lambda j: True,
) -> Tensor:
    """The decoder layers on ``x`` (``run(x, layer_weights)`` replays one), each its own tape
    segment, each checkpointed (non-reentrant ``torch.utils.checkpoint``, with ``early_stop``)
    under ``recompute="full"`` (the layers ``j`` that ``checkpointed(j)`` says), and by op with
    ``policy`` under ``recompute="op"``; each input dies as the next layer's output is bound
    to its name."""
    for j, lw in enumerate(weights):
        tape.segment = j
        if sh.recompute == "op" or (sh.recompute == "full" and checkpointed(j)):

            def one(x: Tensor = x, lw: dict = lw) -> Tensor:
                return run(x, lw)

            by_op = policy if sh.recompute == "op" else None
            x_next = tape.checkpoint(one, [x], early_stop, by_op)
        else:
            x_next = run(x, lw)
        tape.drop(x)
        x = x_next
    return x


def hidden(tape: Tape, sh: Shape, w: Weights, cos: Tensor | None, sin: Tensor | None) -> Tensor:
    """``ReferenceLM.hidden_states(ids)``: the final norm's output (this rank's rows)."""
    n = sh.b * sh.s
    tape.segment = "embed"
    if sh.model_type == "gpt2":
        pos = tape.new(sh.s, 8, "positions")  # torch.arange(s), saved by wpe's embedding
        tok = ops.embedding(tape, w.embed, n, sh.h, "wte_out")
        assert w.wpe is not None  # gpt2's learned positions
        pe = ops.embedding(tape, w.wpe, sh.s, sh.h, "wpe_out", indices=pos)
        tape.drop(pos)
        x = ops.add(tape, tok, pe, "embed_out")
        tape.drop(tok, pe)
    elif sh.tp_vocab:  # RowwiseParallel embedding: masked local lookup, then all-reduce
        if sh.sp > 1:
            part = sequence_parallel.vocab_embedding(tape, w.embed, n, sh.h, "embed_out", sh.sp)
        else:
            part = ops.embedding(tape, w.embed, n, sh.h, "embed_out")
        if sh.sp > 1:  # output_layouts=Shard(1): reduce-scattered over the sequence instead
            x = sequence_parallel.reduce_scatter(
                tape, part, sh.local_rows * sh.h, "embed.reduce_scatter"
            )
        else:
            x = tensor_parallel.all_reduce(tape, part, "embed.all_reduce")
        tape.drop(part)
    else:
        x = ops.embedding(tape, w.embed, n, sh.h, "embed_out")
    if sh.sp > 1 and not sh.tp_vocab:  # replicated output cut to the local sequence
        full = x
        x = sequence_parallel.local_slice(tape, full, sh.local_rows * sh.h, "sp.embed_local")
        tape.drop(full)
    x = _maybe_dropout(tape, sh, x, sh.embed_dropout, "embed.drop")
    x = layers(tape, sh, w.layers, x, lambda x, lw: block(tape, sh, x, lw, cos, sin))
    tape.segment = "head"
    hid = norm(tape, sh, x, w.norm, w.norm_b, sh.local_rows)
    tape.drop(x)
    return hid
