"""LitGPT's LoRA fine-tuning (``implementation="litgpt"`` with ``lora``: litgpt 0.5.12
``finetune/lora.py``) as a replay.

verify runs a faithful copy (``verify/models/litgpt_lora.py``, compared with litgpt itself
through Fabric's wrapper in ``tests/verify/models/test_litgpt_lora.py``); this file follows it:

* `adapt`: every base parameter frozen; per block one ``lora_A [r E, h]`` and one ``lora_B
  [sum of the enabled widths, r]`` on the fused ``qkv`` (``E`` of q, k, v enabled), and
  ``LoRALinear`` pairs on ``attn.proj`` (``o``) and on ``fc_1``, ``fc_2``, ``proj`` (the MLP:
  all three or none), in ``parameters()`` order, in the model's dtype; with ``lm_head`` in
  the modules (``lora_head``) a ``LoRALinear`` pair on the head, first of all;
* `quantize` (QLoRA, ``--quantize bnb.nf4`` or ``bnb.nf4-dq``): every frozen linear and the
  head stored as bitsandbytes' NF4 and dequantized in each matmul (`calc.compress.quant`), and
  ``StableEmbedding`` in place of ``wte``, trainable outside the optimizer (its gradient
  sums over the run); bitsandbytes' ``PagedAdamW`` steps the adapters;
* `qkv_lora` (``LoRAQKVLinear.forward``): the frozen projection; ``after_A = F.linear(
  dropout(x), lora_A)``; ``conv1d`` of its transpose with ``lora_B.unsqueeze(-1)`` (grouped
  when ``n_head == n_query_groups``, else one per enabled part, concatenated); ``zero_pad``
  when one of q, k, v has no adapter (``new_zeros`` and ``index_copy_``); ``* scaling``; the
  sum. The other adapted linears are `calc.compress.lora.lora_linear`'s (the same ops);
* `loss_step` (``fit``): ``model(input_ids, lm_head_chunk_size=128)``, the frozen head on
  128-token slices of ``ln_f``'s output (``bmm`` on the strided slices: no copy), every chunk
  cast to fp32 by Fabric's ``bf16-true`` wrapper before the bf16 ones go;
  ``logits[-1][..., :-1, :]``; ``chunked_cross_entropy`` on the list (one loss chunk per
  head chunk; the targets' chunks copied for two or more sequences); the list and the loss
  held until the next iteration.

The chunks are symbolic in number: the replay walks at most three pieces, the whole chunks
before the last whole one together, the last whole one and the last chunk, as
`calc.models.litgpt` does for the loss. In the backward each chunk trades its gradient for a
smaller one (fp32 for bf16, then the vocabulary's width for the hidden size's), so the
first piece replays its own transients and the joined one releases before it allocates. A
joined piece's tensors are its chunks' bytes added up: whole 512-byte blocks each when the
micro-batch times the vocabulary (and the hidden size) is even, as in every real model.
With ``lora_head`` every chunk runs the adapter's ops and is replayed on its own
(``Regime.unrolled``: the structure holds the chunk count).
"""

from __future__ import annotations

import sympy as sp

from calc.compress import quant
from calc.compress.lora import base_linear, lora_linear, lora_sum, quantize_linear
from calc.config.compression import LoRA, Quant
from calc.config.jobs import Training
from calc.config.model_spec import ModelSpec
from calc.data.bitsandbytes import BNB_OPTIMIZERS
from calc.models import litgpt
from calc.models.shape import Shape
from calc.replay import ops
from calc.replay.kinds import StorageKind
from calc.replay.tape import Node, Size, Tape, Tensor

HEAD_CHUNK_TOKENS = 128
"""``finetune/lora.py``'s ``lm_head_chunk_size``."""
FP32, INT64 = litgpt.FP32, litgpt.INT64
NF4_BLOCK = 64
"""bitsandbytes ``Linear4bit``'s block size, which Lightning's plugin keeps."""
MLP_KEYS = ("gate", "up", "down")
HEAD = "lm_head"
"""``lora.modules``' name of the head's adapter (``lora_head``)."""
WHAT = "implementation='litgpt' with lora"


def check(sh: Shape, job: Training, model: ModelSpec) -> None:
    """Raise for what the LoRA replay does not model (``NotImplementedError``) or what
    litgpt cannot express or run (``ValueError``)."""
    lora = job.lora
    assert lora is not None
    _, padded = _widths(sh.a, sh.k, sh.d, lora)
    if padded and model.n_heads * model.head_dim != model.hidden:
        raise ValueError(
            f"lora.modules={lora.modules!r} with {WHAT} on {model.n_heads} heads of "
            f"{model.head_dim} (not n_embd={model.hidden}): litgpt 0.5.12's LoRAQKVLinear "
            "pads the update at indices counted from n_embd (lora_ind), and its index_copy_ "
            "fails; adapt all of q, k and v, or none"
        )
    if job.quant is not None:
        _check_quant(job)
    mlp = set(MLP_KEYS) & set(lora.modules)
    if mlp and len(mlp) != len(MLP_KEYS):
        raise ValueError(
            f"lora.modules={lora.modules!r}: litgpt's lora_mlp adapts fc_1, fc_2 and proj "
            "together; name 'gate', 'up' and 'down' all or none"
        )
    if lora.adapter_dtype is not None and lora.adapter_dtype != job.precision:
        raise NotImplementedError(
            f"{WHAT}: adapter_dtype={lora.adapter_dtype!r}; Fabric converts the whole model, "
            f"adapters included, to the precision's dtype (leave it None)"
        )
    if job.optimizer in BNB_OPTIMIZERS and job.quant is None:
        raise NotImplementedError(
            f"{WHAT} with optimizer={job.optimizer!r}: modelled with torch's optimizers "
            "(litgpt takes bitsandbytes' PagedAdamW only with --quantize)"
        )


def _check_quant(job: Training) -> None:
    """``--quantize bnb.nf4`` (or ``bnb.nf4-dq``): Lightning's ``BitsandbytesPrecision``
    makes every ``nn.Linear`` (the head too) bitsandbytes' NF4 ``Linear4bit`` (blocks of 64),
    and ``instantiate_bnb_optimizer`` takes ``bnb.optim.PagedAdamW`` (32-bit states)."""
    q = job.quant
    assert q is not None
    if q.method != "nf4" or q.group != NF4_BLOCK:
        raise NotImplementedError(
            f"{WHAT} with quant={q!r}: modelled for --quantize bnb.nf4 and bnb.nf4-dq "
            f"(method='nf4', group_size={NF4_BLOCK}; double_quant for nf4-dq)"
        )
    if "lm_head" in q.keep_16bit:
        raise ValueError(
            f"quant.keep_16bit={q.keep_16bit!r} with {WHAT}: Lightning's bitsandbytes plugin "
            "quantizes every nn.Linear, lm_head included; use keep_16bit=('embed', 'norm') "
            "(the CLI's --quant-lm-head)"
        )
    if job.optimizer is not None and (job.optimizer != "adam32bit" or not job.paged_optimizer):
        raise ValueError(
            f"optimizer={job.optimizer!r}, paged_optimizer={job.paged_optimizer} with {WHAT} "
            "and quant: finetune/lora.py --quantize steps bitsandbytes' PagedAdamW (32-bit "
            "states); use optimizer='adam32bit', paged_optimizer=True (the CLI's --optimizer "
            "adam32bit --paged-optimizer)"
        )


def _widths(a: Size, k: Size, d: Size, lora: LoRA) -> tuple[list[Size], bool]:
    """The enabled parts' widths of the fused output (q: ``a d``, k and v: ``k d`` each, for
    ``a`` heads, ``k`` kv heads of ``d``), and whether ``zero_pad`` runs (not all three)."""
    parts = (("q", a * d), ("k", k * d), ("v", k * d))
    widths = [width for key, width in parts if key in lora.modules]
    return widths, 0 < len(widths) < len(parts)


def adapt(
    tape: Tape, sh: Shape, w: litgpt.Weights, lora: LoRA, one_sequence: bool,
    q: Quant | None = None,
) -> tuple[list[Tensor], list[tuple]]:  # fmt: skip
    """Freeze ``w``, quantize it (``q``: `quantize`), add the adapters as leaves and hook the
    adapted linears; return the trainable tensors the optimizer steps and their shapes in
    ``parameters()`` order. On CUDA each padded ``qkv`` holds its ``_lora_ind`` index buffer
    (int64, one per enabled column), made by ``torch.tensor`` in the first forward and counted
    from the start here; the CPU tracker does not see it (made outside the dispatcher,
    `verify.measure.tracker`'s late storages)."""
    for t in w.parameters():  # mark_only_lora_as_trainable: the base is frozen
        t.leaf = False
        tape.leaves.pop(id(t.storage), None)
    if q is not None:
        quantize(tape, sh, w, q)
    isz, r = sh.weight_itemsize, lora.rank
    dropout_on = sh.device if lora.dropout > 0 else None
    widths, padded = _widths(sh.a, sh.k, sh.d, lora)
    others = _dense_adapted(lora, sh.mlp, sh.h, sh.a * sh.d, sh.f)
    params: list[Tensor] = []
    shapes: list[tuple] = []

    def leaf(numel: Size, name: str, j: object) -> Tensor:
        return tape.existing(numel, isz, name, StorageKind.ADAPTER, leaf=True, tag=j)

    if HEAD in lora.modules:  # lora_head: GPT registers lm_head first, its adapters before it
        a, b = leaf(r * sh.h, "lm_head.lora_A", "head"), leaf(sh.V * r, "lm_head.lora_B", "head")
        params += [a, b]
        shapes += [(r, sh.h), (sh.V, r)]
        w.head_lora = (a, b, r, dropout_on)
    for j, lw in enumerate(w.layers):
        if widths:
            e, width = len(widths), sum(widths)
            a, b = leaf(r * e * sh.h, "qkv.lora_A", j), leaf(width * r, "qkv.lora_B", j)
            params += [a, b]
            shapes += [(r * e, sh.h), (width, r)]
            if padded and sh.device == "cuda":
                tape.existing(width, INT64, "qkv._lora_ind", StorageKind.BUFFER, tag=j)
            base = lw["qkv"]
            assert base is not None
            tape.linear_hooks[id(base.storage)] = _qkv_hook(
                sh, base, a, b, r, widths, padded, one_sequence, dropout_on
            )
        for key, out_f, in_f in others:
            a, b = leaf(r * in_f, f"{key}.lora_A", j), leaf(out_f * r, f"{key}.lora_B", j)
            params += [a, b]
            shapes += [(r, in_f), (out_f, r)]
            dense = lw[key]
            assert dense is not None
            tape.linear_hooks[id(dense.storage)] = _linear_hook(dense, a, b, r, dropout_on)
    return params, shapes


def quantize(tape: Tape, sh: Shape, w: litgpt.Weights, q: Quant) -> None:
    """QLoRA (``finetune/lora.py --quantize``): every frozen linear, ``qkv``, ``proj``, the
    MLP's three and ``lm_head``, stored as bitsandbytes' NF4 (``Params4bit``: packed values,
    absmax, code; `calc.compress.quant.stored_tensors`) and dequantized in each matmul; then
    ``StableEmbedding`` in place of ``wte`` (`calc.models.litgpt.stable_embedding`): a new
    table and norm in the model's dtype, trainable but made after the optimizer, so nothing
    steps them and their gradients sum over the run (``optimizer.zero_grad`` never reaches
    them); the old ``wte`` stays, held by the optimizer's parameter list."""
    compute = "fp32" if sh.weight_itemsize == FP32 else "bf16"
    a, k, d = sh.a, sh.k, sh.d
    shapes = {"qkv": ((a + 2 * k) * d, sh.h), "o": (sh.h, a * d), "gate": (sh.f, sh.h),
              "up": (sh.f, sh.h), "down": (sh.h, sh.f)}  # fmt: skip
    for j, lw in enumerate(w.layers):
        for key, shape in shapes.items():
            dense = lw.get(key)  # GptNeoxMLP has no fc_1/fc_2 pair ("gate")
            if dense is not None:
                lw[key] = quantize_linear(tape, dense, q, shape, compute, j, sh.device)
    w.head = quantize_linear(tape, w.head, q, (sh.V, sh.h), compute, "head", sh.device)
    isz = sh.weight_itemsize

    def leaf(numel: Size, name: str) -> Tensor:
        t = tape.existing(numel, isz, name, StorageKind.WEIGHT, leaf=True, tag="embed")
        tape.unstepped.add(id(t.storage))
        return t

    w.stable = (leaf(sh.V * sh.h, "wte.stable"), leaf(sh.h, "wte.norm"),
                leaf(sh.h, "wte.norm.bias"))  # fmt: skip


def head_numels(model: ModelSpec, lora: LoRA) -> list[int]:
    """Elements of the head's adapters (``lora_head``: ``A [r, h]``, ``B [V, r]``), or none."""
    if HEAD not in lora.modules:
        return []
    return [lora.rank * model.hidden, model.vocab * lora.rank]


def trainable_numels(model: ModelSpec, lora: LoRA) -> list[int]:
    """Elements of every adapter in ``parameters()`` order: the head's, then each block's."""
    return head_numels(model, lora) + block_numels(model, lora) * model.n_layers


def block_numels(model: ModelSpec, lora: LoRA) -> list[int]:
    """Elements of one block's adapters in ``parameters()`` order (`adapt`): what a
    bitsandbytes optimizer decides its paging on."""
    h, a, k, d, f = model.hidden, model.n_heads, model.n_kv_heads, model.head_dim, model.ffn
    widths, _ = _widths(a, k, d, lora)
    r = lora.rank
    out: list[int] = []
    if widths:
        out += [r * len(widths) * h, int(sum(widths)) * r]
    for _, out_f, in_f in _dense_adapted(lora, model.mlp, h, a * d, f):
        out += [r * in_f, out_f * r]  # lora_A [r, in], lora_B [out, r]
    return out


def _dense_adapted(
    lora: LoRA, mlp: str, h: Size, attn_width: Size, f: Size
) -> list[tuple[str, Size, Size]]:
    """``(key, out, in)`` of a block's ``LoRALinear`` adapters in registration order: ``proj``
    (``o``, from ``attn_width`` = heads x head size), then the MLP's (``lora_mlp``: ``fc_1``,
    ``fc_2``, ``proj``; ``GptNeoxMLP``: ``fc``, ``proj``)."""
    out: list[tuple[str, Size, Size]] = [("o", h, attn_width)] if "o" in lora.modules else []
    if "gate" in lora.modules:
        gate = [("gate", f, h)] if mlp != "gelu" else []
        out += [*gate, ("up", f, h), ("down", h, f)]
    return out


def _linear_hook(base: Tensor, a: Tensor, b: Tensor, rank: int, dropout_on: str | None):
    def hook(tape: Tape, x: Tensor, bias: Tensor | None, rows: Size, out: Size, name: str):
        return lora_linear(tape, x, base, bias, a, b, rank, rows, out, name, dropout_on)

    return hook


def _qkv_hook(
    sh: Shape, base: Tensor, a: Tensor, b: Tensor, rank: int, widths: list[Size], padded: bool,
    one_sequence: bool, dropout_on: str | None,
):  # fmt: skip
    def hook(tape: Tape, x: Tensor, bias: Tensor | None, rows: Size, out: Size, name: str):
        return qkv_lora(tape, sh, x, (base, bias), (a, b), rank, widths, padded, one_sequence,
                        out, name, dropout_on)  # fmt: skip

    return hook


def qkv_lora(
    tape: Tape, sh: Shape, x: Tensor, linear: tuple[Tensor, Tensor | None],
    adapters: tuple[Tensor, Tensor], rank: int, widths: list[Size], padded: bool,
    one_sequence: bool, out_features: Size, name: str, dropout_on: str | None,
) -> Tensor:  # fmt: skip
    """``LoRAQKVLinear.forward`` on ``x`` [B, T, h] (module docstring). The transpose of
    ``after_A`` hands its gradient (conv1d's ``[B, r E, T]`` input gradient) to ``F.linear``'s
    ``_unsafe_view`` transposed, whose ``reshape`` copies it for two or more sequences."""
    a, b = adapters
    base, bias = linear  # the frozen projection and its bias (phi-2, GPT-NeoX), if any
    rows = sh.b * sh.s
    y = base_linear(tape, x, base, bias, rows, out_features, name)
    xd = x if dropout_on is None else ops.dropout(tape, x, f"{name}.lora_dropout", dropout_on)
    after_a = ops.linear(tape, xd, a, None, rows, rank * len(widths), f"{name}.lora_A")
    if xd is not x:
        tape.drop(xd)
    copies = not one_sequence and rank * len(widths) > 1
    at = ops.view(tape, after_a, copy_back=copies, name="Transpose")
    bu = ops.view(tape, b, name="Unsqueeze")
    if bool(sp.sympify(sh.a - sh.k) == 0):  # F.conv1d(..., groups=E)
        conv = _conv1d(tape, at, bu, rows * sum(widths), f"{name}.conv1d")
    else:
        conv = _conv1d_parts(tape, at, bu, widths, rows, rank, name)
    tape.drop(at, bu)
    after_b = ops.view(tape, conv, name="Transpose")
    tape.drop(conv)
    pad = _zero_pad(tape, after_b, rows * out_features, name) if padded else after_b
    lora = ops.scale(tape, pad, f"{name}.lora_scale")  # * self.scaling
    if pad is not after_b:
        tape.drop(pad)
    out = ops.add(tape, y, lora, f"{name}.lora_sum")
    tape.drop(y, after_a, after_b, lora)  # the method's locals
    return out


def _conv1d(tape: Tape, x: Tensor, w: Tensor, out_numel: Size, name: str) -> Tensor:
    """``F.conv1d(x, w)``: saves both; ``convolution_backward`` returns the input's and the
    weight's gradients (its workspaces are the kernel's own: the CPU tracker does not see
    them, and calc does not model cuDNN's)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        if grads[0] is None:
            return [None, None]
        return [tape.new(x.numel, x.itemsize, f"d{name}.input"),
                tape.new(w.numel, w.itemsize, f"d{name}.weight")]  # fmt: skip

    node = tape.node("Convolution", rule, [x, w], saved=[x, w])
    return tape.output(tape.new(out_numel, x.itemsize, name), node)


def _conv1d_parts(
    tape: Tape, x: Tensor, w: Tensor, widths: list[Size], rows: Size, rank: Size, name: str
) -> Tensor:
    """Grouped queries: ``input.chunk(E, 1)`` and ``weight.split(widths)`` (views; their
    backward concatenates the parts' gradients), one ``conv1d`` per part, ``torch.cat`` of the
    outputs (a copy; its backward hands each part a view)."""
    xs = litgpt.split_views(tape, x, [rows * rank] * len(widths), "Split", "dSplit.cat")
    ws = litgpt.split_views(
        tape, w, [width * rank for width in widths], "SplitWithSizes", "dSplitWithSizes.cat"
    )
    outs = [
        _conv1d(tape, xi, wi, rows * width, f"{name}.conv1d")
        for xi, wi, width in zip(xs, ws, widths, strict=True)
    ]

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g, numel=o.numel) if g is not None else None for o in outs]

    node = tape.node("Cat", rule, outs)
    cat = tape.output(tape.new(rows * sum(widths), x.itemsize, f"{name}.conv1d.cat"), node)
    tape.drop(*outs, *xs, *ws)
    return cat


def _zero_pad(tape: Tape, x: Tensor, out_numel: Size, name: str) -> Tensor:
    """``x.new_zeros(..., out_features).index_copy_(-1, lora_ind, x)``: the zeros need no
    gradient; ``IndexCopyBackward0`` saves the index (a buffer) and the source ``x`` (its
    formula reads ``source.dim()`` and ``expand_as(source)``, derivatives.yaml), so the
    conv1d output ``x`` views stays to the backward; it hands ``x`` its part of the gradient,
    ``index_select``'s new tensor."""
    zeros = ops.plain(tape, out_numel, x.itemsize, f"{name}.zero_pad")

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, g.itemsize, f"d{name}.index_select") if g is not None else None]

    return tape.output(zeros, tape.node("IndexCopy", rule, [x], saved=[x]))


class _Piece:
    """Chunks of the head walked as one: ``count`` chunks of ``tokens`` tokens per sequence,
    ``loss_tokens`` of them in the loss (one fewer in the last chunk); ``own`` replays its
    backward transients."""

    def __init__(self, count: Size, tokens: Size, loss_tokens: Size, own: bool) -> None:
        self.count, self.tokens, self.loss_tokens, self.own = count, tokens, loss_tokens, own


def _pieces(sh: Shape, regime: litgpt.Regime) -> list[_Piece]:
    """The whole chunks before the last whole one (joined), the last whole one, the last
    (in the loss unless the shift leaves it empty: one token, ``regime.last`` false). With an
    adapter on the head (``regime.unrolled``) every chunk is a piece of its own: each runs the
    adapter's ops, whose transients a joined piece could not stand for."""
    whole = sp.ceiling(sh.s / HEAD_CHUNK_TOKENS) - 1
    last = sh.s - HEAD_CHUNK_TOKENS * whole
    out: list[_Piece] = []
    if regime.unrolled:
        out += [_Piece(1, HEAD_CHUNK_TOKENS, HEAD_CHUNK_TOKENS, own=True)] * regime.whole
    else:
        if regime.whole >= 2:
            out.append(_Piece(whole - 1, HEAD_CHUNK_TOKENS, HEAD_CHUNK_TOKENS, own=False))
        if regime.whole >= 1:
            out.append(_Piece(1, HEAD_CHUNK_TOKENS, HEAD_CHUNK_TOKENS, own=True))
    out.append(_Piece(1, last, last - 1, own=True))
    return out


def loss_step(
    tape: Tape, sh: Shape, w: litgpt.Weights, cos: Tensor, sin: Tensor, ids: Tensor,
    held: list[Tensor], regime: litgpt.Regime,
) -> Tensor:  # fmt: skip
    """``finetune/lora.py``'s step (module docstring). ``held``: the previous iteration's
    chunks (the last one its sliced view) and loss, refilled with this one's."""
    pieces = _pieces(sh, regime)
    hid = litgpt.hidden(tape, sh, w, cos, sin, ids, regime)
    numels = [sh.b * p.tokens * p.count * sh.h for p in pieces]
    xs = litgpt.split_views(tape, hid, numels, "Split", "dSplit.cat")
    tape.drop(hid)
    # a slice folds as a view when it is [1, T, h], [b, 1, h] (a last chunk of one token:
    # the shift leaves it out of the loss) or all of x
    views = [regime.one_sequence or regime.whole == 0 for _ in pieces]
    views[-1] = views[-1] or not regime.last
    chunks = [_head(tape, sh, w, x, p, view) for x, p, view in zip(xs, pieces, views, strict=True)]
    tape.drop(*xs)
    if chunks[0].itemsize != FP32:  # Fabric's bf16-true wrapper: every chunk to fp32
        wide = [_cast(tape, c, p) for c, p in zip(chunks, pieces, strict=True)]
        tape.drop(*chunks)
        chunks = wide
    if held:
        if not regime.last:  # the chunk the shift left out: its graph dies with the list
            tape.free_graph(held[-2])
        tape.drop(*held[:-1])
    last = pieces[-1]
    sliced = litgpt.slice_logits(tape, chunks[-1], sh.b * last.loss_tokens * sh.V)
    tape.drop(chunks[-1])
    chunks[-1] = sliced
    loss = _chunked_cross_entropy(tape, sh, chunks, pieces, regime)
    if held:
        tape.drop(held[-1])
    held[:] = [*chunks, loss]
    return ops.scale(tape, loss, "loss.accum")  # fabric.backward(loss / accumulation)


def _head(
    tape: Tape, sh: Shape, w: litgpt.Weights, x: Tensor, p: _Piece, fold_view: bool
) -> Tensor:
    """``self.lm_head(x_i)`` on a piece's slices: the frozen head (`_frozen_head`), and with
    ``lora_head`` litgpt's ``LoRALinear`` on it (``lora_A``, ``lora_B`` on the dropped-out
    slice; `calc.compress.lora.lora_sum`). Without dropout the slice itself reaches
    ``@ lora_A.T``, whose fold is a ``reshape``: a copy of a slice of two or more sequences
    (its rows are not evenly strided), a view of one sequence's, of one token's or of the
    whole sequence (``fold_view``: then ``lora_A`` keeps ``ln_f``'s output, as long as the
    chunk's graph lives); with dropout the dropout's output, a new tensor, folds as a view."""
    pre = _frozen_head(tape, sh, w.head, x, p)
    if w.head_lora is None:
        return pre
    a, b, r, dropout_on = w.head_lora
    return lora_sum(tape, x, pre, a, b, r, sh.b * p.tokens, sh.V, "lm_head", dropout_on,
                    fold_copy=not fold_view)  # fmt: skip


def _frozen_head(tape: Tape, sh: Shape, head: Tensor, x: Tensor, p: _Piece) -> Tensor:
    """The frozen ``lm_head`` on a piece's slices. A slice ``[b, 128, h]`` of ``[b, s, h]``
    cannot be folded to 2-D without a copy, so ``matmul`` takes its batched path
    (``should_fold`` is false; the weight expanded, a view) and ``bmm`` makes the chunk: no
    copy. Saves nothing (the weight is frozen); backward gives the slices' gradients,
    ``grad.bmm(weight)``, a joined piece releasing its incoming gradients first (module
    docstring).

    An NF4 head (QLoRA) dequantizes its ``[V, h]`` weight for every chunk, in the forward and
    again in the backward (bitsandbytes' ``MatMul4Bit``; `calc.compress.quant.dequantize`),
    and frees it after the matmul. A joined piece dequantizes once: its chunks but the last
    stand in as one block while the weight is made, then give way to the piece's output, so
    its peak is that of its last chunk, as in the loop."""
    rows = sh.b * p.tokens
    isz = x.itemsize  # the model's dtype (an NF4 head's values are bytes)
    qw = tape.quantized.get(id(head.storage))
    assert qw is None or isinstance(qw, quant.QWeight)
    chunk = rows * sh.V

    def rule(tape: Tape, node: Node, grads: list) -> list:
        if grads[0] is None:
            return [None]
        if not p.own:
            tape.release_grad(grads, 0)
        weight = quant.dequantize(tape, qw) if qw is not None else None
        dx = tape.new(p.count * rows * sh.h, isz, "dhead.x")
        tape.drop(weight)
        return [dx]

    node = tape.node("HeadBmm", rule, [x])
    if qw is None:
        return tape.output(tape.new(p.count * chunk, isz, "logits.chunk"), node)
    grad_before, tape.grad_enabled = tape.grad_enabled, False
    try:
        before = None if p.own else tape.new((p.count - 1) * chunk, isz, "logits.chunks")
        weight = quant.dequantize(tape, qw)
        tape.drop(before)
        out = tape.new(p.count * chunk, isz, "logits.chunk")
        tape.drop(weight)
    finally:
        tape.grad_enabled = grad_before
    return tape.output(out, node)


def _cast(tape: Tape, x: Tensor, p: _Piece) -> Tensor:
    """A piece's chunks cast to fp32 (``_convert_fp_tensor``); backward casts the gradient
    back, a joined piece releasing the fp32 gradients first."""
    rows, src = x.numel, x.itemsize

    def rule(tape: Tape, node: Node, grads: list) -> list:
        if grads[0] is None:
            return [None]
        if not p.own:
            tape.release_grad(grads, 0)
        return [tape.new(rows, src, "dlogits.chunk->bf16")]

    node = tape.node("ToCopy", rule, [x])
    return tape.output(tape.new(rows, FP32, "logits.chunk.fp32"), node)


def _chunked_cross_entropy(
    tape: Tape, sh: Shape, chunks: list[Tensor], pieces: list[_Piece], regime: litgpt.Regime
) -> Tensor:
    """``chunked_cross_entropy`` on the list (``litgpt/utils.py`` lines 319-337): each chunk
    ``reshape(-1, V)`` (a view, but a copy of the sliced last chunk for two or more
    sequences), the targets ``targets[..., 1:].split(128, 1)`` each ``reshape(-1)`` (copies
    for two or more sequences, kept by ``nll_loss``), one ``cross_entropy(...,
    reduction="none")`` per chunk (`calc.models.litgpt.chunk_ce`), the mask's count, ``cat``,
    ``sum`` and the division. A last chunk of one token reshapes as views."""
    V, isz, one = sh.V, FP32, regime.one_sequence
    if not regime.last:  # an empty last chunk: zip(logit_chunks, target_chunks) drops it
        chunks, pieces = chunks[:-1], pieces[:-1]
    flat = []
    for chunk, p in zip(chunks, pieces, strict=True):
        sliced = regime.last and p is pieces[-1]  # the last chunk's strided slice
        if one or not sliced or regime.last_one_token:
            flat.append(ops.view(tape, chunk))
        else:
            flat.append(ops.clone(tape, chunk, "logits.last.reshape"))
    targets: list[Tensor | None] = []
    for p in pieces:
        view = one or (p is pieces[-1] and regime.last_one_token)
        numel = p.count * sh.b * p.loss_tokens
        targets.append(None if view else ops.plain(tape, numel, INT64, "targets.chunk"))
    outs = []
    for x, t, p in zip(flat, targets, pieces, strict=True):
        rows = sh.b * p.loss_tokens
        outs.append(litgpt.chunk_ce(tape, x, p.count * rows, p.count, V, isz, t, p.own))
    loss = litgpt.mean_of_chunks(tape, outs, sh.b * (sh.s - 1))
    tape.drop(*flat, *targets)
    return loss
