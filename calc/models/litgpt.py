"""LitGPT's Llama (``implementation="litgpt"``) and its full fine-tuning loop as a replay.

verify runs a faithful copy of litgpt 0.5.12's model code and loop
(``verify/models/litgpt_llama.py``, which cites each upstream line and is compared with the
library where it imports); this file follows that copy line by line:

* parameters in registration order: ``lm_head``, ``wte``, per block ``norm_1``, the fused
  ``qkv``, ``proj``, ``norm_2``, ``fc_1``, ``fc_2``, ``proj``, then ``ln_f`` (`Weights`);
* its ``RMSNorm`` (`rms_norm`): ``x.float()`` (a copy of a 16-bit input), ``x * x``, ``mean``,
  ``+ eps``, ``rsqrt``, ``x * rsqrt``, ``weight.float()``, the product, ``.to(dtype)``; every
  local lives until the method returns;
* attention (`attention`): one ``qkv`` projection split into views; RoPE (`rope`) on each of q
  and k against fp32 ``cos``/``sin`` tables: ``cat((-x2, x1))``, ``x * cos + rotated * sin``
  promoted to fp32, ``.to(dtype)``; ``cat((q_roped, q[..., d:]))`` copies again (its empty
  second part's slice hands a zero gradient of q's size back); ``repeat_interleave`` of k
  and v for grouped queries; SDPA; the heads merged; ``proj``;
* the loop (`loss_step`): the whole logits, cast to float32 by Fabric's ``bf16-true`` wrapper
  (its ``convert_output``), ``chunked_cross_entropy`` on ``logits[..., :-1, :]`` in chunks of
  128 rows, the logits and the loss held by the loop until the next iteration replaces them.

Single device, ``precision="bf16"`` (Fabric's ``bf16-true``) or ``"fp32"`` (``32-true``), no
recomputation (`check`). The other configurations litgpt builds (`calc.models.litgpt_arch`:
parallel residual, ``LayerNorm``, ``GptNeoxMLP``/``GemmaMLP``, partial RoPE, biases, Gemma's
scaled embeddings and norm offset) run through the same functions, steered by `Regime.arch`;
a sliding window adds each block's mask (`sliding_window_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import sympy as sp

from calc.config.jobs import Training
from calc.config.model_spec import ModelSpec
from calc.models import attention_core
from calc.models import reference as ref
from calc.models.head import RootHooks, divide_by_count, root_pre_backward
from calc.models.litgpt_arch import LLAMA, Arch, arch_of
from calc.models.shape import Shape
from calc.parallel.data import ReplayPlan
from calc.replay import ops
from calc.replay.kinds import StorageKind
from calc.replay.tape import Node, Size, Tape, Tensor

FP32 = 4
INT64 = 8
BOOL = 1
MASK_ALIGNMENT = 16
"""``mem_eff_alignment`` of ``preprocess_mask`` (``aten/src/ATen/native/transformers/
attention.cpp``): the last dimension memory-efficient attention wants of its bias."""
CE_CHUNK_ROWS = 128
"""``chunked_cross_entropy``'s ``chunk_size`` (litgpt/utils.py)."""
WHAT = "implementation='litgpt'"


def _check_structure(sh: Shape) -> None:
    """``NotImplementedError`` for a model litgpt's configurations here do not build."""
    if sh.model_type not in ("llama", "mistral", "qwen2", "qwen3") or (
        sh.qk_norm != (sh.model_type == "qwen3")
    ):
        raise NotImplementedError(
            f"{WHAT} is modelled for litgpt's Llama-like configurations (model_type 'llama', "
            f"'mistral' or 'qwen2'; 'qwen3' with its per-head q/k norms), and for Phi-3/Phi-4, "
            f"phi-2, GPT-NeoX, Falcon and Gemma (`calc.models.litgpt_arch`); got "
            f"model_type={sh.model_type!r}, qk_norm={sh.qk_norm}"
        )
    if sh.tied:
        raise NotImplementedError(f"{WHAT}: litgpt's GPT has an untied head (lm_head)")
    one_flag = sh.o_bias == sh.mlp_bias and (sh.qkv_bias or not sh.o_bias)
    if not one_flag or sh.norm_bias != (sh.norm == "layernorm"):
        raise NotImplementedError(
            f"{WHAT}: litgpt's bias flag covers qkv, proj and the MLP alike, attn_bias qkv "
            "alone (Qwen2.5), and its LayerNorm has a bias (RMSNorm none)"
        )


def check(sh: Shape, job: Training, dp: ReplayPlan | None) -> None:
    """Raise ``NotImplementedError`` for what the litgpt replay does not model, ``ValueError``
    for a sequence too short for its shifted loss."""
    if job.seq_len < 2:
        raise ValueError(
            f"seq_len={job.seq_len} with {WHAT}: its loss compares logits[..., :-1, :] with "
            "targets[..., 1:], so seq_len must be at least 2"
        )
    _check_structure(sh)
    others = (job.pruning, job.distill)
    if any(x is not None for x in others) or sh.tp_comm or sh.sp > 1:
        raise NotImplementedError(
            f"{WHAT} is modelled for full fine-tuning (finetune/full.py) and LoRA "
            "(finetune/lora.py): no pruning, distillation, tensor or sequence parallelism"
        )
    if dp is not None and not (lightning_fsdp(dp) and job.lora is None):
        raise NotImplementedError(
            f"{WHAT} is modelled on one device and, for full fine-tuning, under Lightning's "
            "FSDPStrategy as finetune/full.py sets it up: calc.Parallelism(dp=N, fsdp=True, "
            "fsdp_version=1, fsdp_use_orig_params=True), no mixed-precision fields, no offload"
        )
    if job.quant is not None and job.lora is None:
        raise NotImplementedError(f"{WHAT}: a quantized base needs LoRA (finetune/lora.py)")
    if job.precision not in ("bf16", "fp32"):
        raise NotImplementedError(
            f"{WHAT} with precision={job.precision!r}: modelled for Fabric's 'bf16-true' "
            "(precision='bf16') and '32-true' (precision='fp32')"
        )
    if sh.recompute not in ("none", "full") or job.recompute_every != 1:
        raise NotImplementedError(
            f"{WHAT}: FSDPStrategy(activation_checkpointing_policy={{Block}}) checkpoints "
            "every block (recompute='full') or none (recompute='none')"
        )
    if max(sh.attn_dropout, sh.hidden_dropout, sh.embed_dropout) > 0:
        raise NotImplementedError(f"{WHAT}: its fine-tuning has no dropout (dropout=0)")
    if job.loop != "hold-output" or job.loss != "chunked-ce":
        raise NotImplementedError(
            f"{WHAT} with loop={job.loop!r}, loss={job.loss!r}: its loop is "
            "loop='hold-output' (logits and loss live until the next iteration) with "
            "loss='chunked-ce' (chunked_cross_entropy, 128-row chunks)"
        )
    if job.optimizer_in_backward or job.offload_activations:
        raise NotImplementedError(f"{WHAT} without optimizer_in_backward or offload_activations")
    if job.paged_optimizer and job.quant is None:
        raise NotImplementedError(
            f"{WHAT} with paged_optimizer: litgpt takes bitsandbytes' PagedAdamW only with "
            "--quantize (quant=calc.Quant('nf4', ...) with lora)"
        )
    if sh.attention not in ("flash", "efficient"):
        raise NotImplementedError(
            f"{WHAT} with the {sh.attention!r} attention kernel: modelled with SDPA's fused "
            "kernels (litgpt calls SDPA with is_causal=True on expanded heads)"
        )


def lightning_fsdp(dp: ReplayPlan) -> bool:
    """Whether ``dp`` is Lightning's ``FSDPStrategy`` as LitGPT sets it up
    (`calc.parallel.fsdp1`): FSDP1 over the dp ranks, ``use_orig_params``, ``FULL_SHARD``, its
    ``MixedPrecision`` the model's own dtypes (no policy fields), no offload."""
    return (
        dp.fsdp
        and dp.fsdp_version == 1
        and dp.use_orig_params
        and dp.reshard_after_forward
        and not (dp.param_itemsize or dp.reduce_itemsize or dp.replicated)
        and dp.offload == "none"
    )


class Weights(ref.Weights):
    """litgpt's parameters as leaves on the tape, in ``parameters()`` order: ``lm_head`` (and
    its bias), ``wte``, per block ``norm_1``, ``qkv``, ``proj``, ``norm_q`` and ``norm_k`` (Qwen3),
    ``norm_2`` (none when shared),
    the MLP (``fc_1``, ``fc_2``, ``proj``; ``GptNeoxMLP``: ``fc``, ``proj``), each weight
    followed by its bias where the configuration has them, then ``ln_f``."""

    def __init__(self, tape: Tape, sh: Shape, arch: Arch = LLAMA) -> None:
        isz = sh.weight_itemsize
        h, a, k, d, f, V = sh.h, sh.a, sh.k, sh.d, sh.f, sh.V

        def leaf(numel: Size, name: str, tag: object) -> Tensor:
            return tape.existing(numel, isz, name, StorageKind.WEIGHT, leaf=True, tag=tag)

        def bias(on: bool, numel: Size, name: str, tag: object) -> Tensor | None:
            return leaf(numel, f"{name}.bias", tag) if on else None

        self.head = leaf(V * h, "lm_head", "head")
        self.head_b = bias(arch.head_bias, V, "lm_head", "head")
        self.embed = leaf(V * h, "embed", "embed")
        self.wpe = None
        self.layers = []
        nb, lb = sh.norm_bias, sh.mlp_bias  # litgpt's bias; qkv also with attn_bias (Qwen2.5)
        for j in range(sh.n_layers):
            lw: dict[str, Tensor | None] = {
                "norm1": leaf(h, "norm_1", j), "norm1_b": bias(nb, h, "norm_1", j),
                "qkv": leaf((a + 2 * k) * d * h, "attn.qkv", j),
                "qkv_b": bias(sh.qkv_bias, (a + 2 * k) * d, "attn.qkv", j),
                "o": leaf(a * d * h, "attn.proj", j), "o_b": bias(sh.o_bias, h, "attn.proj", j),
            }  # fmt: skip
            if sh.qk_norm:  # norm_qk (Qwen3): an RMSNorm of head_size each, after proj
                lw |= {"q_norm": leaf(d, "attn.norm_q", j), "k_norm": leaf(d, "attn.norm_k", j)}
            if not arch.shared_attention_norm:
                lw |= {"norm2": leaf(h, "norm_2", j), "norm2_b": bias(nb, h, "norm_2", j)}
            if sh.mlp != "gelu":  # LLaMAMLP's fc_1; GptNeoxMLP has fc and proj alone
                lw |= {"gate": leaf(f * h, "fc_1", j), "gate_b": bias(lb, f, "fc_1", j)}
            up = "mlp.fc" if sh.mlp == "gelu" else "fc_2"
            lw |= {"up": leaf(f * h, up, j), "up_b": bias(lb, f, up, j),
                   "down": leaf(f * h, "mlp.proj", j), "down_b": bias(lb, h, "mlp.proj", j)}  # fmt: skip
            self.layers.append(lw)
        self.norm = leaf(h, "ln_f", "head")
        self.norm_b = bias(nb, h, "ln_f", "head")
        self.head_lora: tuple[Tensor, Tensor, int, str | None] | None = None
        """``lora_head``'s ``lora_A``, ``lora_B``, rank and the device of its dropout
        (``None``: none); ``None`` without it (`calc.compress.litgpt_lora.adapt`)."""
        self.stable: tuple[Tensor, Tensor, Tensor] | None = None
        """QLoRA's ``StableEmbedding`` (weight, norm weight, norm bias), which replaces
        ``wte`` after the optimizer is built (`stable_embedding`); ``None`` otherwise."""

    def shapes(self, sh: Shape) -> list[tuple]:
        """Each parameter's shape (``nn.Linear`` weights are [out, in])."""
        h, a, k, d, f, V = sh.h, sh.a, sh.k, sh.d, sh.f, sh.V
        two_d = {
            "lm_head": (V, h), "embed": (V, h), "attn.qkv": ((a + 2 * k) * d, h),
            "attn.proj": (h, a * d), "fc_1": (f, h), "fc_2": (f, h), "mlp.proj": (h, f),
            "mlp.fc": (f, h),
        }  # fmt: skip
        return [two_d.get(p.name, (p.numel,)) for p in self.parameters()]

    def parameters(self) -> list[Tensor]:
        """In ``model.parameters()`` order."""
        out = [self.head, *([self.head_b] if self.head_b is not None else []), self.embed]
        for lw in self.layers:
            out.extend(t for t in lw.values() if t is not None)
        out.append(self.norm)
        if self.norm_b is not None:
            out.append(self.norm_b)
        return out


def rope_width(sh: Shape, arch: Arch) -> Size:
    """``rope_n_elem = int(rotary_percentage * head_size)``: the columns RoPE rotates."""
    if arch.rope_fraction == 1:
        return sh.d
    frac = sp.Rational(arch.rope_fraction.numerator, arch.rope_fraction.denominator)
    return int(frac * sh.d) if isinstance(sh.d, int) else sp.floor(frac * sh.d)


def buffers(
    tape: Tape, sh: Shape, block_size: int, converted: bool, arch: Arch = LLAMA,
    cast: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The ``cos`` and ``sin`` tables [rows, rope_n_elem]: rebuilt in fp32 at the training
    sequence length by the ``max_seq_length`` setter, or (``converted``: the length is the
    block size, so the setter keeps them) Fabric's conversion of the ``block_size`` tables to
    the model's dtype (``block_size``: the model's ``max_positions``, part of the compile
    key). ``cast``: under Lightning's FSDPStrategy, FSDP1's lazy initialisation (the first
    forward) casts the buffers to the ``MixedPrecision`` buffer dtype, the model's
    (``_runtime_utils.py`` ``_lazy_init``, ``_cast_buffers_to_dtype_and_device``)."""
    width = rope_width(sh, arch)
    if converted:
        numel, isz = block_size * width, sh.weight_itemsize
    else:
        numel, isz = sh.s * width, sh.weight_itemsize if cast else FP32
    return (
        tape.existing(numel, isz, "rope_cos", StorageKind.BUFFER),
        tape.existing(numel, isz, "rope_sin", StorageKind.BUFFER),
    )


def rms_norm(tape: Tape, x: Tensor, w: Tensor, rows: Size, unit_offset: bool = False) -> Tensor:
    """litgpt's ``RMSNorm.forward`` (module docstring); ``unit_offset`` (Gemma): ``weight = 1 +
    self.weight`` (a new [h] in the weight's dtype, a local) before ``weight.float()``."""
    up = ops.to_dtype(tape, x, FP32, "norm.float")  # x = x.float(), a local
    sq = ops.mul(tape, up, up, "norm.sq")
    norm_x = ops.mean_last(tape, sq, rows, "norm.mean")
    tape.drop(sq)
    eps = ops.add(tape, norm_x, None, "norm.eps")
    r = ops.rsqrt(tape, eps, "norm.rsqrt")
    tape.drop(eps)
    x_normed = ops.mul_broadcast(tape, up, r, "norm.xhat")
    tape.drop(r)
    wo = ops.add(tape, w, None, "norm.w.offset") if unit_offset else w
    wf = wo if wo.itemsize == FP32 else ops.to_dtype(tape, wo, FP32, "norm.w.float")
    y = ops.mul_broadcast(tape, x_normed, wf, "norm.out")
    if wf is not wo:  # weight.float() of an fp32 weight is the weight itself
        tape.drop(wf)
    out = ops.to_dtype(tape, y, x.itemsize, "norm.to")
    tape.drop(y, up, norm_x, x_normed)  # the expression's temporary, then the locals
    if wo is not w:
        tape.drop(wo)
    return out


def norm(
    tape: Tape, sh: Shape, x: Tensor, w: Tensor, b: Tensor | None, rows: Size,
    arch: Arch = LLAMA,
) -> Tensor:  # fmt: skip
    """The configuration's ``norm_class``: litgpt's `rms_norm` (Gemma's with the unit offset),
    or ``torch.nn.LayerNorm`` (``native_layer_norm``; the CPU kernel keeps mean and rstd in a
    16-bit weight's dtype)."""
    if sh.norm != "layernorm":
        return rms_norm(tape, x, w, rows, arch.gemma)
    stats = FP32 if sh.device == "cuda" else w.itemsize
    return ops.layer_norm(tape, x, w, b, rows, stats_itemsize=stats)


def rope(tape: Tape, x: Tensor, cos: Tensor, sin: Tensor, name: str) -> Tensor:
    """``apply_rope(x, cos, sin)``: ``x`` a ``[B, heads, T, d]`` view, the tables fp32 (or the
    model's dtype) ``[1, T, d]`` views."""
    x1 = ops.slice_half(tape, x, f"{name}.x1")
    x2 = ops.slice_half(tape, x, f"{name}.x2")
    n2 = ops.neg(tape, x2, f"{name}.neg")
    rotated = ops.cat2(tape, n2, x1, f"{name}.rotated")
    tape.drop(n2)
    c, s = tape.alias(cos), tape.alias(sin)  # cos.view(...), sin.view(...)
    a = ops.mul_broadcast(tape, x, c, f"{name}.cos")
    b = ops.mul_broadcast(tape, rotated, s, f"{name}.sin")
    roped = ops.add(tape, a, b, f"{name}.sum")
    tape.drop(a, b)
    out = ops.to_dtype(tape, roped, x.itemsize, f"{name}.to")
    tape.drop(roped, x1, x2, rotated, c, s)
    return out


def split_views(
    tape: Tape, x: Tensor, numels: Sequence[Size], node_name: str, grad_name: str
) -> list[Tensor]:
    """``x.split(...)``/``chunk``: one view of ``x`` per part; the backward
    (``split_backward``) gives zeros to a part no gradient reached, then concatenates the
    parts' gradients into one of ``x``'s size."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        zeros = [tape.new(n, x.itemsize, f"{grad_name}.zeros")
                 for g, n in zip(grads, numels, strict=True) if g is None]  # fmt: skip
        out = tape.new(x.numel, x.itemsize, grad_name)
        tape.drop(*zeros)
        return [out]

    node = tape.node(node_name, rule, [x], n_outputs=len(numels))
    return [tape.alias(x, node, i, numel=n) for i, n in enumerate(numels)]


def _split_qkv(tape: Tape, sh: Shape, qkv: Tensor, n: Size) -> list[Tensor]:
    """``qkv.split((a d, k d, k d), -1)``: three views; ``SplitWithSizesBackward0`` concatenates
    the three gradients into one of qkv's size."""
    numels = [n * sh.a * sh.d, n * sh.k * sh.d, n * sh.k * sh.d]
    return split_views(tape, qkv, numels, "SplitWithSizes", "dqkv.split")


def _cat_tail(tape: Tape, roped: Tensor, x: Tensor, name: str) -> Tensor:
    """``torch.cat((roped, x[..., rope_n_elem:]), -1)``: a copy of x's size; backward hands
    ``roped`` and the slice ``x[..., rope_n_elem:]`` views of the gradient (the slice's empty
    under full RoPE), which ``SliceBackward0`` turns into a zero-filled gradient of ``x``'s
    size."""
    tail_numel = sp.sympify(x.numel - roped.numel)

    def tail_rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(x.numel, g.itemsize, f"d{name}.tail") if g is not None else None]

    tail_node = tape.node("Slice", tail_rule, [x])
    tail = tape.alias(x, tail_node, numel=tail_numel)

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g, numel=roped.numel), tape.alias(g, numel=tail_numel)]

    node = tape.node("Cat", rule, [roped, tail])
    out = tape.output(tape.new(x.numel, roped.itemsize, name), node)
    tape.drop(tail)
    return out


def sliding_window_mask(tape: Tape, sh: Shape, itemsize: int) -> Tensor:
    """The additive mask ``CausalSelfAttention.forward`` builds in each block of a configuration
    with ``sliding_window_size`` (litgpt/model.py lines 481-503, no ``input_pos``): ``ones(T,
    T)`` in q's dtype and its ``triu(diagonal=1)`` (the ones freed), ``masked_fill_`` where
    ``mask.bool()`` (a bool temporary), then ``full((T, T), -inf)``, zeroed one row slice at a
    time in place, which replaces the causal one. Its memory does not depend on the window."""
    n = sh.s * sh.s
    ones = tape.new(n, itemsize, "attn.mask.ones")
    causal = tape.new(n, itemsize, "attn.mask.causal")
    tape.drop(ones)
    flags = tape.new(n, BOOL, "attn.mask.bool")
    tape.drop(flags)
    window = tape.new(n, itemsize, "attn.mask")
    tape.drop(causal)
    return window


def _sdpa(tape: Tape, sh: Shape, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
          padded: bool) -> Tensor:  # fmt: skip
    """SDPA on the roped, expanded heads: causal, or with the sliding-window ``mask``, which
    rules out flash (``check_for_attn_mask``, ``sdp_utils.cpp``): CUDA runs memory-efficient,
    whose ``preprocess_mask`` (``attention.cpp``) expands the mask to ``[B, nh, T, T]`` and, when
    ``T`` is not a multiple of 16, pads that expansion into a new tensor (``pad_bias``) that
    the kernel saves; the CPU's flash kernel takes and saves the mask as it is."""
    if mask is None:
        return attention_core.core(tape, sh, q, k, v, "attn")
    if sh.device != "cuda":
        return attention_core.fused(tape, sh, q, k, v, "attn", mask=mask)
    bias = mask
    if padded:
        numel = sh.b * sh.a * sh.s * attention_core.round_up(sh.s, MASK_ALIGNMENT)
        bias = tape.new(numel, mask.itemsize, "attn.mask.padded")
    out = attention_core.fused(tape, replace(sh, attention="efficient"), q, k, v, "attn", bias)
    if bias is not mask:
        tape.drop(bias)
    return out


def attention(
    tape: Tape, sh: Shape, x: Tensor, lw: dict, cos: Tensor, sin: Tensor,
    regime: Regime | None = None,
) -> Tensor:  # fmt: skip
    """``CausalSelfAttention.forward`` (the sliding-window mask where ``regime.sliding``; RoPE
    on the first ``rope_n_elem`` columns of each head, a slice unless that is all of them)."""
    n = sh.b * sh.s
    arch = regime.arch if regime is not None else LLAMA
    qkv = ops.linear(tape, x, lw["qkv"], lw.get("qkv_b"), n, (sh.a + 2 * sh.k) * sh.d, "qkv")
    q, k, v = _split_qkv(tape, sh, qkv, n)
    many_q = not attention_core.known_one(sh.a)
    many_kv = not attention_core.known_one(sh.k)
    gqa = bool(sp.sympify(sh.a - sh.k) != 0)
    qh = ops.view(tape, q, copy_back=many_q)  # q.view(B, T, nh, hs): RoPE's gradient comes
    kh = ops.view(tape, k, copy_back=many_kv)  # back laid out [B, nh, T, hs]
    vh = ops.view(tape, v, copy_back=gqa and many_kv)  # repeat_interleave's too
    tape.drop(q, k, v)
    qt, kt, vt = (ops.view(tape, t, name="Transpose") for t in (qh, kh, vh))
    tape.drop(qh, kh, vh)
    if sh.qk_norm:  # norm_qk_type "default" (Qwen3): RMSNorm over each head's head_size
        qn = rms_norm(tape, qt, lw["q_norm"], sh.b * sh.a * sh.s)
        kn = rms_norm(tape, kt, lw["k_norm"], sh.b * sh.k * sh.s)
        tape.drop(qt, kt)  # q and k rebound to the norms' outputs
        qt, kt = qn, kn
    width = rope_width(sh, arch)
    if arch.rope_fraction == 1:  # q[..., :head_size] is q itself (no slice)
        q_in, k_in = qt, kt
    else:
        q_in = ops.slice_last(tape, qt, sh.b * sh.a * sh.s * width, "q.rope_in")
        k_in = ops.slice_last(tape, kt, sh.b * sh.k * sh.s * width, "k.rope_in")
    q_roped = rope(tape, q_in, cos, sin, "q.rope")
    k_roped = rope(tape, k_in, cos, sin, "k.rope")
    if q_in is not qt:
        tape.drop(q_in, k_in)
    qc = _cat_tail(tape, q_roped, qt, "q.cat")
    kc = _cat_tail(tape, k_roped, kt, "k.cat")
    tape.drop(qt, kt)
    if gqa:
        numel = sh.b * sh.a * sh.s * sh.d
        kr = ops.repeat_interleave(tape, kc, numel, "k_rep")
        vr = ops.repeat_interleave(tape, vt, numel, "v_rep")
        tape.drop(kc, vt)
        kc, vt = kr, vr
    sliding = regime is not None and regime.sliding
    mask = sliding_window_mask(tape, sh, qc.itemsize) if sliding else None
    out = _sdpa(tape, sh, qc, kc, vt, mask, regime is not None and regime.mask_padded)
    tape.drop(qc, kc, vt)
    # CUDA's fused kernels lay their output out [B, T, heads, d] (a view); the CPU flash
    # kernel lays it out as its query, here cat's contiguous [B, heads, T, d]: a copy
    o = attention_core.merge_heads(tape, sh, out, copies=sh.device != "cuda")
    tape.drop(out)
    y = ops.linear(tape, o, lw["o"], lw.get("o_b"), n, sh.h, "o")
    tape.drop(o, qkv, q_roped, k_roped, mask)  # the locals die as the method returns
    return y


def block(
    tape: Tape, sh: Shape, x: Tensor, lw: dict, cos: Tensor, sin: Tensor,
    regime: Regime | None = None,
) -> Tensor:  # fmt: skip
    """``Block.forward``: ``x + attn(norm_1(x))`` then ``+ mlp(norm_2(...))``, or with
    ``parallel_residual`` ``x_normed = norm_2(x)`` (or ``norm_1``'s, shared), ``x =
    attention_output + x``, ``mlp(x_normed) + x``; its locals live until it returns."""
    n = sh.b * sh.s
    arch = regime.arch if regime is not None else LLAMA
    xn = norm(tape, sh, x, lw["norm1"], lw.get("norm1_b"), n, arch)
    att = attention(tape, sh, xn, lw, cos, sin, regime)
    if arch.parallel_residual:
        if not arch.shared_attention_norm:
            xn2 = norm(tape, sh, x, lw["norm2"], lw.get("norm2_b"), n, arch)
            tape.drop(xn)  # x_normed rebound
            xn = xn2
        h = ops.add(tape, att, x, "resid1")
    else:
        h = ops.add(tape, att, x, "resid1")
        xn2 = norm(tape, sh, h, lw["norm2"], lw.get("norm2_b"), n, arch)
        tape.drop(xn)  # x_normed rebound
        xn = xn2
    ff = mlp(tape, sh, xn, lw, arch)
    out = ops.add(tape, ff, h, "resid2")
    tape.drop(ff, xn, h, att)  # attention_output, a local, lives until the block returns
    return out


def hidden(
    tape: Tape, sh: Shape, w: Weights, cos: Tensor, sin: Tensor, ids: Tensor,
    regime: Regime | None = None,
) -> Tensor:  # fmt: skip
    """``GPT.forward`` up to the head: ``wte``, the blocks, ``ln_f`` ([B, T, h]); the tables'
    views die as it returns (the caller's head runs inside the same method, after them)."""
    n = sh.b * sh.s
    tape.segment = "embed"
    c, s = tape.alias(cos), tape.alias(sin)  # cos[:T].unsqueeze(0), sin[...]: views
    if w.stable is not None:
        x = stable_embedding(tape, sh, w.stable, ids)
    else:
        x = ops.embedding(tape, w.embed, n, sh.h, "wte_out", indices=ids)
    arch = regime.arch if regime is not None else LLAMA
    if arch.gemma:  # x * torch.tensor(n_embd ** 0.5, dtype=x.dtype): a new x; the 0-d
        scaled = ops.scale(tape, x, "wte.scaled")  # factor is a host tensor (CPU on CUDA too)
        tape.drop(x)
        x = scaled
    x = ref.layers(tape, sh, w.layers, x, lambda x, lw: block(tape, sh, x, lw, c, s, regime))
    tape.segment = "head"
    hid = norm(tape, sh, x, w.norm, w.norm_b, n, arch)
    tape.drop(x, c, s)
    return hid


def stable_embedding(
    tape: Tape, sh: Shape, stable: tuple[Tensor, Tensor, Tensor], ids: Tensor
) -> Tensor:
    """bitsandbytes' ``StableEmbedding.forward`` (``bitsandbytes/nn/modules.py``), which
    ``finetune/lora.py`` puts in place of ``wte`` under ``--quantize``: ``F.embedding`` on its
    trainable weight (a dense gradient of the table in the backward), ``.to(torch.
    get_default_dtype())`` (the model's dtype under Fabric's ``forward_context``: no copy),
    ``LayerNorm`` in that dtype (its mean and rstd fp32 on CUDA, the input's dtype on the
    CPU), ``.to(weight.dtype)`` (no copy); the embedding's output is saved by the norm."""
    weight, norm_w, norm_b = stable
    rows = sh.b * sh.s
    emb = ops.embedding(tape, weight, rows, sh.h, "wte_out", indices=ids)
    stats = FP32 if sh.device == "cuda" else weight.itemsize
    out = ops.layer_norm(tape, emb, norm_w, norm_b, rows, stats_itemsize=stats)
    tape.drop(emb)
    return out


def logits(
    tape: Tape, sh: Shape, w: Weights, cos: Tensor, sin: Tensor, ids: Tensor,
    regime: Regime | None = None,
) -> Tensor:  # fmt: skip
    """``GPT.forward``: the whole logits [B, T, V]."""
    hid = hidden(tape, sh, w, cos, sin, ids, regime)
    out = ops.linear(tape, hid, w.head, w.head_b, sh.b * sh.s, sh.V, "logits")
    tape.drop(hid)
    return out


def mlp(tape: Tape, sh: Shape, x: Tensor, lw: dict, arch: Arch = LLAMA) -> Tensor:
    """``LLaMAMLP.forward``: ``fc_1`` and ``fc_2`` first, then ``silu(x_fc_1) * x_fc_2`` (the
    silu output a temporary of the product), ``proj``; the locals die as it returns.
    ``GptNeoxMLP.forward``: ``fc``, ``F.gelu`` (it saves its input), ``proj``."""
    n = sh.b * sh.s
    if sh.mlp == "gelu":
        up = ops.linear(tape, x, lw["up"], lw.get("up_b"), n, sh.f, "fc")
        act = ops.unary(tape, up, "gelu", saves="input")
        tape.drop(up)
        y = ops.linear(tape, act, lw["down"], lw.get("down_b"), n, sh.h, "proj")
        tape.drop(act)
        return y
    g = ops.linear(tape, x, lw["gate"], lw.get("gate_b"), n, sh.f, "fc_1")
    u = ops.linear(tape, x, lw["up"], lw.get("up_b"), n, sh.f, "fc_2")
    sg = ops.unary(tape, g, "gelu" if arch.gemma else "silu", saves="input")  # GemmaMLP
    m = ops.mul(tape, sg, u, "swiglu")
    tape.drop(sg)
    y = ops.linear(tape, m, lw["down"], lw.get("down_b"), n, sh.h, "proj")
    tape.drop(g, u, m)
    return y


@dataclass(frozen=True, slots=True)
class Regime:
    """The shape of ``chunked_cross_entropy`` for one job: ``N = b (s - 1)`` rows in chunks of
    128 (`CE_CHUNK_ROWS`), ``q = N // 128`` whole ones and ``r = N % 128`` rows in a last one;
    and where the RoPE tables are. Part of the compile key (`calc.estimate.core`): the replay
    walks ``q`` whole chunks as at most two pieces (`loss_step`)."""

    one_sequence: bool
    """``micro_batch == 1``: the reshapes of the shifted logits and targets are views."""
    whole: int
    """Whole chunks: 0, 1, or 2 for two or more."""
    last: bool
    """A last chunk of fewer than 128 rows."""
    converted: bool
    """``seq_len == max_positions``: the tables stay at the block size in the model's dtype."""
    head_chunks: bool = False
    """LoRA's loop (`calc.compress.litgpt_lora`): the head runs on 128-token chunks of the
    sequence and the loss takes one chunk per head chunk, so ``whole`` counts the chunks
    before the last one, ``ceil(s / 128) - 1``, and ``last`` says whether the last one
    (``s - 128 whole`` tokens, one fewer after the shift) reaches the loss: not when it holds
    a single token."""
    last_one_token: bool = False
    """LoRA's loop: the last chunk keeps one token after the shift (``s % 128 == 2``), so its
    ``[b, 1, V]`` slice and its ``[b, 1]`` targets reshape as views (a dimension of one has
    no stride to break), whatever the micro-batch."""
    unrolled: bool = False
    """LoRA's loop with an adapter on the head (``lora_head``): ``whole`` is the exact count
    of chunks before the last, each replayed on its own."""
    sliding: bool = False
    """The configuration has a ``sliding_window_size`` (litgpt's Mistral-7B-v0.1, Phi-3): every
    block builds an additive mask for SDPA (`sliding_window_mask`), whatever the length."""
    mask_padded: bool = False
    """With ``sliding``, a length that is not a multiple of 16 (`MASK_ALIGNMENT`): CUDA's
    memory-efficient kernel pads the expanded mask (`_sdpa`)."""
    arch: Arch = LLAMA
    """The residual layout, RoPE width and MLP of litgpt's configuration (`Arch`)."""

    @classmethod
    def of(
        cls, micro_batch: int, seq_len: int, max_positions: int, head_chunks: bool = False,
        unrolled: bool = False, sliding: bool = False, arch: Arch = LLAMA,
    ) -> Regime:  # fmt: skip
        """The regime of a job of ``micro_batch`` sequences of ``seq_len`` tokens."""
        converted = seq_len == max_positions
        padded = sliding and seq_len % MASK_ALIGNMENT != 0
        if head_chunks:
            whole = -(-seq_len // CE_CHUNK_ROWS) - 1
            one_token = seq_len % CE_CHUNK_ROWS == 2
            in_loss = seq_len % CE_CHUNK_ROWS != 1  # one token: empty after the shift
            count = whole if unrolled else min(whole, 2)
            return cls(micro_batch == 1, count, in_loss, converted, True, one_token, unrolled,
                       sliding, padded, arch)  # fmt: skip
        whole, rest = divmod(micro_batch * (seq_len - 1), CE_CHUNK_ROWS)
        return cls(micro_batch == 1, min(whole, 2), rest > 0, converted, sliding=sliding,
                   mask_padded=padded, arch=arch)  # fmt: skip

    @classmethod
    def of_job(cls, job: Training, model: ModelSpec) -> Regime:
        """The regime of ``job`` on ``model``: LoRA's loop chunks the head, ``lora_head``
        unrolls it; a sliding window adds the blocks' masks."""
        lora = job.lora
        return cls.of(job.micro_batch, job.seq_len, model.max_positions,
                      head_chunks=lora is not None,
                      unrolled=lora is not None and "lm_head" in lora.modules,
                      sliding=model.sliding_window is not None,
                      arch=arch_of(model))  # fmt: skip

    def key(self) -> tuple[bool | int | str, ...]:
        """The fields that decide the replay's structure."""
        return (self.one_sequence, self.whole, self.last, self.converted, self.head_chunks,
                self.last_one_token, self.unrolled, self.sliding, self.mask_padded,
                *self.arch.key())  # fmt: skip


def loss_step(
    tape: Tape, sh: Shape, w: Weights, cos: Tensor, sin: Tensor, ids: Tensor,
    held: list[Tensor], regime: Regime, root: RootHooks | None = None,
) -> Tensor:  # fmt: skip
    """The fine-tuning loop's step (``finetune/full.py``): ``logits = model(input_ids)`` (the
    previous iteration's logits released as the name is rebound) through Fabric's wrapper,
    whose ``bf16-true`` casts the bf16 logits to float32 and releases them (lightning 2.5
    ``_FabricModule.forward``, ``HalfPrecision.convert_output``: every floating output to the
    default dtype), so the loss below runs on fp32 logits; ``loss =
    chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])`` (the previous loss released
    then), and ``loss / accumulation`` handed to backward. ``held``: ``[logits, loss]`` of the
    previous iteration, refilled with this one's."""
    lg = logits(tape, sh, w, cos, sin, ids, regime)
    if root is not None:  # FSDP's root: its post-forward, its pre-backward hook on the logits
        root.end_forward(tape)
        lg = root_pre_backward(tape, lg, root)
    if lg.itemsize != FP32:  # Fabric's bf16-true wrapper hands back float32 logits
        lg32 = ops.to_dtype(tape, lg, FP32, "logits.fabric_output")
        tape.drop(lg)
        lg = lg32
    if held:
        tape.drop(held[0])
    loss = _chunked_cross_entropy(tape, sh, lg, regime)
    if held:
        tape.drop(held[1])
    held[:] = [lg, loss]
    return ops.scale(tape, loss, "loss.accum")  # fabric.backward(loss / accumulation)


def _chunked_cross_entropy(tape: Tape, sh: Shape, lg: Tensor, regime: Regime) -> Tensor:
    """``chunked_cross_entropy`` on ``logits[..., :-1, :]`` (litgpt/utils.py, lines 339-356).

    ``logits[..., :-1, :]`` is a view whose ``SliceBackward0`` makes a zero-filled gradient of
    the logits' size; its ``reshape(-1, V)`` is a view for one sequence and a copy otherwise
    (the targets' ``reshape(-1)`` likewise). The rows split in chunks of 128; each chunk's
    ``cross_entropy(..., reduction="none")``: ``log_softmax`` (its output saved by it and by
    ``nll_loss``), ``nll_loss`` (an output per row and a 0-d ``total_weight``, saved).
    Backward runs the chunks last to first: per chunk the ``nll_loss`` gradient, then
    ``log_softmax``'s, which stays for ``split``'s backward to concatenate. The whole chunks
    are replayed as two pieces: the last one (``q - 1``), with its own transients, whose step
    peaks highest of them (the most ``total_weight`` tensors still saved), and the other
    ``q - 1`` together, their log-probabilities turned into gradients without a transient
    (each byte of one replaced by the other)."""
    V, isz = sh.V, lg.itemsize
    rows = sh.b * (sh.s - 1)
    whole = sp.floor(rows / CE_CHUNK_ROWS)
    r = rows - CE_CHUNK_ROWS * whole
    sl = slice_logits(tape, lg, rows * V)
    if regime.one_sequence:
        flat = ops.view(tape, sl)
        tgt = None  # targets[..., 1:].reshape(-1): a view of the targets
    else:
        flat = ops.clone(tape, sl, "logits.reshape")
        tgt = ops.plain(tape, rows, INT64, "targets.reshape")
    tape.drop(sl)
    pieces: list[tuple[Size, bool]] = []  # (rows, replayed with its transients)
    if regime.whole >= 2:
        pieces.append(((whole - 1) * CE_CHUNK_ROWS, False))
    if regime.whole >= 1:
        pieces.append((CE_CHUNK_ROWS, True))
    if regime.last:
        pieces.append((r, True))
    views = _split_rows(tape, flat, [p for p, _ in pieces], V)
    outs: list[Tensor] = []
    for (n_rows, own), view in zip(pieces, views, strict=True):
        count = 1 if own else whole - 1  # chunks in the piece
        outs.append(chunk_ce(tape, view, n_rows, count, V, isz, tgt, own))
    tape.drop(*views)
    loss = mean_of_chunks(tape, outs, rows)
    tape.drop(flat, tgt)
    return loss


def mean_of_chunks(tape: Tape, outs: list[Tensor], rows: Size) -> Tensor:
    """The end of ``chunked_cross_entropy`` (``litgpt/utils.py`` lines 335-337, 354-356) on the
    pieces' fp32 losses ``outs`` (``rows`` in all): ``non_masked_elems = (targets !=
    ignore_index).sum()``, ``torch.cat(loss_chunks).sum() / non_masked_elems.maximum(
    torch.ones_like(non_masked_elems))``; the losses and the count released as it returns."""
    mask = ops.plain(tape, rows, BOOL, "targets.ne")
    count_t = ops.plain(tape, 1, INT64, "non_masked_elems")
    tape.drop(mask)
    cat = _cat_rows(tape, outs, rows, FP32)
    total = _sum(tape, cat, FP32)
    tape.drop(cat)
    ones = ops.plain(tape, 1, INT64, "ones_like")
    most = ops.plain(tape, 1, INT64, "maximum")
    tape.drop(ones)
    loss = divide_by_count(tape, total, most)
    tape.drop(total, most, count_t, *outs)
    return loss


def slice_logits(tape: Tape, lg: Tensor, numel: Size) -> Tensor:
    """``logits[..., :-1, :]`` (``numel`` elements): a view; ``SliceBackward0`` allocates a
    zero-filled gradient of the logits' size and copies into it."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(lg.numel, g.itemsize, "dlogits.slice") if g is not None else None]

    node = tape.node("Slice", rule, [lg])
    return tape.alias(lg, node, numel=numel)


def _split_rows(tape: Tape, flat: Tensor, rows: list[Size], vocab: Size) -> list[Tensor]:
    """``flat.split(128)``: one view per piece; ``SplitBackward0`` concatenates every chunk's
    gradient into one of ``flat``'s size."""
    return split_views(tape, flat, [n * vocab for n in rows], "Split", "dlogits.split")


def chunk_ce(
    tape: Tape, x: Tensor, rows: Size, count: Size, vocab: Size, isz: int,
    target: Tensor | None, own: bool,
) -> Tensor:  # fmt: skip
    """One piece of chunks through ``cross_entropy(..., reduction="none")``: the
    log-probabilities, the per-row losses and ``count`` 0-d ``total_weight`` tensors. ``own``: the piece replays
    its own backward transients; otherwise its log-probabilities give way to their gradients
    (`_chunked_cross_entropy`)."""
    logp = tape.new(rows * vocab, isz, "logp")
    held = [] if own else [logp]

    def ls_rule(tape: Tape, node: Node, grads: list) -> list:
        tape.drop(*held)  # the piece's log-probabilities, released before its gradients
        return [tape.new(rows * vocab, isz, "dlogits.chunk")]

    ls_node = tape.node("LogSoftmax", ls_rule, [x], saved=[logp] if own else [])
    tape.output(logp, ls_node)

    def nll_rule(tape: Tape, node: Node, grads: list) -> list:
        if own:
            return [tape.new(rows * vocab, isz, "dlogp")]
        return [tape.alias(grads[0], numel=rows * vocab)]  # a view: no transient

    # a piece of whole chunks: each chunk's fp32 losses fill whole 512-byte blocks (128 rows
    # or a multiple of them), and each 0-d total_weight takes a block of its own
    assert isz == FP32, "litgpt's loss runs on fp32 logits (Fabric's wrapper)"
    blocks = count * (512 // isz)
    out = tape.new(rows, isz, "nll")
    total_weight = tape.new(1 if own else blocks, isz, "total_weight")
    nll_node = tape.node("NllLoss", nll_rule, [logp],
                         saved=[logp if own else None, target, total_weight])  # fmt: skip
    tape.drop(total_weight)
    if own:
        tape.drop(logp)
    return tape.output(out, nll_node)


def _cat_rows(tape: Tape, outs: list[Tensor], rows: Size, isz: int) -> Tensor:
    """``torch.cat(loss_chunks)``: [N]; backward hands each chunk a view of the gradient."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.alias(g, numel=o.numel) for o in outs]  # narrow: views

    node = tape.node("Cat", rule, outs)
    return tape.output(tape.new(rows, isz, "loss_chunks.cat"), node)


def _sum(tape: Tape, x: Tensor, isz: int) -> Tensor:
    """``x.sum()``: 0-d; backward ``grad.expand(sizes)``, a view."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.alias(grads[0], numel=x.numel)]

    node = tape.node("Sum", rule, [x])
    return tape.output(tape.new(1, isz, "loss_sum"), node)
