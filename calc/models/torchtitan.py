"""torchtitan's Llama 3 (``implementation="torchtitan"``) as a replay: the reference graph
(`calc.models.reference`) with the ops where torchtitan 0.2.2's code differs (its last release
whose language models run SDPA; 0.3.0 runs flex attention, which needs ``torch.compile``).

verify runs a faithful copy of torchtitan's model code and trainer step
(``verify/models/torchtitan_llama.py``, which cites each upstream line and is compared with the
library where it imports); this file follows that copy line by line:

* ``nn.RMSNorm`` (`rms_norm`): ``F.rms_norm`` of the input in its own dtype, weight of the same
  dtype; on CPU torch 2.13 runs the composite (an upcast copy of a 16-bit input, ``pow``,
  ``mean``, an in-place ``add_`` of eps, ``rsqrt``, two ``mul``, the cast back), on CUDA
  ``_fused_rms_norm`` (aten/src/ATen/native/layer_norm.cpp ``rms_norm_symint``: same dtypes
  dispatch to it);
* RoPE in fp32 complex arithmetic (`rope`): ``xq.float()`` (a copy of a 16-bit q), viewed as
  complex pairs, one ``mul`` by the root's complex64 ``freqs_cis`` buffer (which needs no
  gradient: the product saves only the buffer), viewed back, ``type_as(xq)``; q's and k's
  temporaries live until ``apply_rotary_emb`` returns;
* SDPA with ``enable_gqa`` on the ``[b, heads, s, d]`` transposes of RoPE's ``[b, s, heads, d]``
  outputs, ``.transpose(1, 2).contiguous().view(b, s, -1)``, ``wo``;
* ``h = x + attention(attention_norm(x))``, ``h + feed_forward(ffn_norm(h))``: no local outlives
  its expression;
* the trainer's step (`forward`): the count of valid tokens before the forward, the logits
  returned in the compute dtype, the loss ``cross_entropy(pred.flatten(0, 1).float(), ...,
  reduction="sum")`` (the upcast copy of 16-bit logits a temporary of the loss function) divided
  by the count, ``del pred``.

The parameters are torchtitan's, in its order (torchtune's order: `calc.models.torchtune.Weights`).
torchtitan trains an fp32 model: under FSDP2 with or without its ``MixedPrecisionPolicy``, or
alone or under its DDP (``replicate`` with 100 MiB buckets: `ddp_parallel`) under autocast
(``maybe_enable_amp``: ``precision="amp-bf16"``; the linears' bf16 outputs meet the fp32
residual stream, so every norm runs on fp32 input, as CUDA's autocast would make it) or in fp32
(`check`).
"""

from __future__ import annotations

from dataclasses import replace

from calc.config.jobs import Training
from calc.config.parallelism import Parallelism
from calc.models import attention_core, torchtune
from calc.models import reference as ref
from calc.models.head import RootHooks, divide_by_count, root_pre_backward
from calc.models.shape import Shape
from calc.parallel.data import ReplayPlan
from calc.replay import ops
from calc.replay.tape import Size, Tape, Tensor

RECOMPUTES: tuple[str, ...] = ("none", "full", "op")
"""The recomputations `check` accepts: none, ``apply_ac``'s whole blocks and its op policy."""
DDP_BUCKET_MIB = 100
"""``apply_ddp``'s ``replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)`` (torchtitan 0.2.2,
models/llama3/infra/parallelize.py)."""
FP32 = 4
BOOL = 1
INT64 = 8
WHAT = "implementation='torchtitan'"


def check(sh: Shape, job: Training, dp: ReplayPlan | None) -> None:
    """Raise ``NotImplementedError`` for what the torchtitan replay does not model."""
    _check_model(sh)
    if job.lora is not None or job.quant is not None or job.pruning is not None:
        raise NotImplementedError(f"{WHAT} is modelled for full training (no LoRA, QLoRA, pruning)")
    if job.distill is not None:
        raise NotImplementedError(f"{WHAT} with distillation is not modelled")
    sharded = dp is not None and dp.fsdp
    if job.precision not in ("fp32", "amp-bf16") or (sharded and job.precision != "fp32"):
        raise NotImplementedError(
            f"{WHAT} with precision={job.precision!r}: torchtitan keeps an fp32 model, trained "
            "in bf16 by FSDP2's MixedPrecisionPolicy (precision='fp32', fsdp=True, "
            "fsdp_param_dtype='bf16') or, on one GPU or under DDP, by autocast "
            "(precision='amp-bf16', its maybe_enable_amp)"
        )
    if sh.recompute not in RECOMPUTES:
        raise NotImplementedError(
            f"{WHAT} with recompute={sh.recompute!r}: modelled with whole-block checkpointing "
            "(recompute='full', torchtitan's activation_checkpoint.mode='full'), by op "
            "(recompute='op', selective_ac_option='op') or none"
        )
    if sh.recompute == "op" and job.precision != "fp32":
        raise NotImplementedError(
            f"{WHAT} with recompute='op' is modelled for precision='fp32' (alone or with "
            "FSDP2's MixedPrecisionPolicy), not under autocast"
        )
    if max(sh.attn_dropout, sh.hidden_dropout, sh.embed_dropout) > 0:
        raise NotImplementedError(f"{WHAT}: torchtitan's Llama 3 has no dropout (use dropout=0)")
    if sh.tp_comm or sh.sp > 1:
        raise NotImplementedError(f"{WHAT} with tensor parallelism is not modelled yet")
    if job.loop != "del-logits" or job.loss != "cross-entropy":
        raise NotImplementedError(
            f"{WHAT} with loop={job.loop!r}, loss={job.loss!r}: its trainer's loop is "
            "loop='del-logits' (``del pred``) with loss='cross-entropy'"
        )
    if job.optimizer_in_backward or job.offload_activations:
        raise NotImplementedError(
            f"{WHAT} without optimizer_in_backward and offload_activations (torchtune's)"
        )
    if dp is not None:
        _check_data_parallel(dp)


def _check_data_parallel(dp: ReplayPlan) -> None:
    """torchtitan's data parallelism: FSDP2 over ``dp_shard`` (``apply_fsdp``) or DDP over
    ``dp_replicate`` (``apply_ddp``: ``replicate(..., bucket_cap_mb=100)``, no other option),
    without ZeRO-1/2 or CPU offload."""
    ddp_only = not dp.fsdp and (dp.grads_in_buckets or dp.shard_states or dp.shard_grads)
    if dp.offload != "none" or dp.optimizer_params is not None or ddp_only:
        raise NotImplementedError(
            f"{WHAT} under data parallelism is modelled as FSDP2 (fsdp=True, torchtitan's "
            "dp_shard) without CPU offload, or as its DDP (dp_replicate: zero=0, "
            "gradient_as_bucket_view=False)"
        )


def ddp_parallel(parallel: Parallelism) -> Parallelism:
    """``parallel`` with torchtitan's bucket cap (`DDP_BUCKET_MIB`) where it leaves DDP's
    ``bucket_cap_mb`` to the default (None); a cap that is set stays."""
    if parallel.ddp_bucket_mib is not None:
        return parallel
    return replace(parallel, ddp_bucket_mib=DDP_BUCKET_MIB)


def _check_model(sh: Shape) -> None:
    """torchtitan's Llama 3: no biases, q/k norms or tied head; SDPA's cuDNN/flash/math."""
    biases = sh.qkv_bias or sh.o_bias or sh.mlp_bias
    if sh.model_type not in ("llama", "mistral") or sh.qk_norm or biases:
        raise NotImplementedError(
            f"{WHAT} is modelled for torchtitan's Llama 3 (model_type 'llama' or 'mistral', no "
            f"biases, no q/k norms; got model_type={sh.model_type!r})"
        )
    if sh.tied:
        raise NotImplementedError(f"{WHAT}: torchtitan's Llama 3 has no tied embeddings")
    if sh.attention not in ("flash", "math"):
        raise NotImplementedError(
            f"{WHAT} with the {sh.attention!r} attention kernel: torchtitan allows SDPA's cuDNN, "
            "flash and math kernels (attention='sdpa')"
        )


def buffers(tape: Tape, sh: Shape) -> Tensor:
    """The root's complex64 ``freqs_cis`` [s, d/2] (its ``max_seq_len`` is the training
    sequence length): ``s * d / 2`` complex numbers, kept here as ``s * d`` fp32 elements."""
    return tape.existing(sh.s * sh.d, FP32, "freqs_cis", "buffer")


def rms_norm(tape: Tape, sh: Shape, x: Tensor, w: Tensor, rows: Size) -> Tensor:
    """``nn.RMSNorm(x)``: ``F.rms_norm(x, (h,), weight, eps)`` with x and the weight in one
    dtype: CUDA's fused kernel, CPU's composite (module docstring)."""
    if sh.device == "cuda":
        return torchtune.fused_rms_norm(tape, x, w, rows)
    return torchtune.rms_norm(tape, sh, x, w, rows)


def _complex_mul(tape: Tape, xc: Tensor, freqs: Tensor, name: str) -> Tensor:
    """``x_ * freqs_cis`` (complex; the buffer needs no gradient, so only it is saved);
    backward ``grad * freqs_cis.conj()``, a new tensor of x's size."""
    return ops.mul(tape, xc, freqs, name, out_numel=xc.numel)


def rope(tape: Tape, sh: Shape, q: Tensor, k: Tensor, freqs: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rotary_emb(xq, xk, freqs_cis)`` on ``[b, s, heads, d]`` views; the gradients
    reaching the flattened products come transposed out of the math kernel, and
    ``view_as_real``'s backward makes them contiguous (a copy each)."""
    gq, gk, _ = attention_core.view_grad_copies(sh)
    transposed = sh.attention == "math"
    fq = ops.to_dtype(tape, q, FP32, "q.float")  # xq_ (a view of it) lives until return
    cq = ops.view(tape, fq)
    fk = ops.to_dtype(tape, k, FP32, "k.float")
    ck = ops.view(tape, fk)
    f = tape.alias(freqs)  # freqs_cis[0:seqlen].view(...)
    mq = _complex_mul(tape, cq, f, "q.rope")
    rq = ops.view(tape, mq, copy_back=transposed and gq)  # view_as_real(...).flatten(3)
    mk = _complex_mul(tape, ck, f, "k.rope")
    rk = ops.view(tape, mk, copy_back=transposed and gk)
    tq = ops.to_dtype(tape, rq, q.itemsize, "q.type_as")
    tk = ops.to_dtype(tape, rk, k.itemsize, "k.type_as")
    tape.drop(cq, fq, ck, fk, f, mq, rq, mk, rk)  # the locals, as the frame releases them
    return tq, tk


def attention(tape: Tape, sh: Shape, x: Tensor, lw: dict, freqs: Tensor) -> Tensor:
    """``Attention.forward(x, freqs_cis)``."""
    n = sh.b * sh.s
    q = ops.linear(tape, x, lw["q"], None, n, sh.a * sh.d, "q")
    k = ops.linear(tape, x, lw["k"], None, n, sh.k * sh.d, "k")
    v = ops.linear(tape, x, lw["v"], None, n, sh.k * sh.d, "v")
    _, _, gv = attention_core.view_grad_copies(sh)
    qv, kv = ops.view(tape, q), ops.view(tape, k)
    vv = ops.view(tape, v, copy_back=gv)
    tape.drop(q, k, v)
    qr, kr = rope(tape, sh, qv, kv, freqs)
    tape.drop(qv, kv)
    qt, kt, vt = (ops.view(tape, t, name="Transpose") for t in (qr, kr, vv))
    tape.drop(qr, kr, vv)
    out = attention_core.core(tape, sh, qt, kt, vt, "attn")
    o = attention_core.merge_heads(tape, sh, out)
    tape.drop(out)
    y = ops.linear(tape, o, lw["o"], None, n, sh.h, "o")
    tape.drop(o, qt, kt, vt)
    return y


def block(tape: Tape, sh: Shape, x: Tensor, lw: dict, freqs: Tensor) -> Tensor:
    """``TransformerBlock.forward``."""
    n = sh.b * sh.s
    xn = rms_norm(tape, sh, x, lw["norm1"], n)
    att = attention(tape, sh, xn, lw, freqs)
    tape.drop(xn)
    h = ops.add(tape, x, att, "resid1")
    tape.drop(att)
    m = rms_norm(tape, sh, h, lw["norm2"], n)
    ff = ref.mlp(tape, sh, m, lw)
    tape.drop(m)
    out = ops.add(tape, h, ff, "resid2")
    tape.drop(ff, h)
    return out


def op_policy(op: str, n: int) -> bool:
    """``_apply_op_sac``'s ``_custom_policy`` (distributed/activation_checkpoint.py) with
    llama3's ``_op_sac_save_list``: a fused SDPA kernel's outputs kept, and the n-th ``mm`` of
    the block's pass for odd n (every second one recomputed); the rest is recomputed. Of the
    list, Llama 3's block runs ``mm`` and the SDPA kernels (the math kernel is a composite:
    its ``bmm`` and softmax are recomputed)."""
    return op == "sdpa" or (op == "mm" and n % 2 == 1)


def layer_checkpointed(sh: Shape, j: int) -> bool:
    """Whether block ``j`` (from 0) is checkpointed under ``recompute="full"``: every block, or
    with ``recompute_every=n`` (``selective_ac_option="n"``, ``_apply_layer_sac``) those whose
    count from 1 in ``apply_ac``'s loop is a multiple of n: blocks n-1, 2n-1, ... (its counter
    is global to the process; torchtitan builds one model per process)."""
    return (j + 1) % sh.recompute_every == 0


def hidden(tape: Tape, sh: Shape, w: ref.Weights, freqs: Tensor, ids: Tensor) -> Tensor:
    """``Transformer.forward`` up to the final norm's output; checkpointing as ``apply_ac``
    wraps each block (``ptd_checkpoint_wrapper`` with the config's ``early_stop=False``: the
    recomputation runs the whole block)."""
    tape.segment = "embed"
    x = ops.embedding(tape, w.embed, sh.b * sh.s, sh.h, "embed_out", indices=ids)
    x = ref.layers(
        tape, sh, w.layers, x, lambda x, lw: block(tape, sh, x, lw, freqs),
        early_stop=False, policy=op_policy, checkpointed=lambda j: layer_checkpointed(sh, j),
    )  # fmt: skip
    tape.segment = "head"
    hid = rms_norm(tape, sh, x, w.norm, sh.b * sh.s)
    tape.drop(x)
    return hid


def forward(
    tape: Tape, sh: Shape, w: ref.Weights, freqs: Tensor, ids: Tensor,
    root: RootHooks | None = None,
) -> Tensor:  # fmt: skip
    """The trainer's loss step: ``(labels != IGNORE_INDEX).sum()`` (a bool mask [b, s], then a
    0-d int64), ``pred = model(inputs)`` (``root``: FSDP2's root, whose post-forward runs as the
    model returns and whose pre-backward hook sits on the logits), the loss, ``del pred``;
    returns the loss."""
    n = sh.b * sh.s
    mask = tape.new(n, BOOL, "labels.ne")
    count = tape.new(1, INT64, "valid_tokens")
    tape.drop(mask)
    hid = hidden(tape, sh, w, freqs, ids)
    pred = ops.linear(tape, hid, w.head, None, n, sh.V, "logits")
    tape.drop(hid)
    if root is not None:
        root.end_forward(tape)
        pred = root_pre_backward(tape, pred, root)
    loss = trainer_loss(tape, sh, pred, count)
    tape.drop(count, pred)  # ``del pred``
    return loss


def trainer_loss(tape: Tape, sh: Shape, pred: Tensor, count: Tensor) -> Tensor:
    """``cross_entropy_loss(pred, labels) / global_valid_tokens`` (components/loss.py, train.py
    ``forward_backward_step``): ``pred.flatten(0, 1).float()`` (a copy of 16-bit logits, the
    same tensor of fp32 ones) alive beside the log-probabilities until the cross-entropy
    returns (``reduction="sum"`` makes the same tensors as the mean), then the division."""
    n = sh.b * sh.s
    flat = ops.view(tape, pred)
    up = ops.to_dtype(tape, flat, FP32, "logits.float")
    total = ops.cross_entropy(tape, up, n, sh.V, FP32)
    tape.drop(up, flat)
    loss = divide_by_count(tape, total, count)
    tape.drop(total)
    return loss
