"""LoRA and QLoRA in the replay: a frozen (optionally quantized) base with low-rank adapters.

``compress_weights`` turns the model's parameters (`calc.models.reference.Weights`) into what
verify's ``compress.apply`` makes of the model:

* every base tensor is frozen (``requires_grad=False``): no gradient, no optimizer state, and
  autograd's guarded saves then keep less. ``mm`` saves its input only for the weight's
  gradient, ``mul`` saves an operand only for the other one's gradient (derivatives.yaml,
  ``grad_input_mask``; memory-facts §2.6/§2.9): a frozen linear keeps no input, a frozen
  norm weight makes ``x * rstd`` unsaved;
* with ``quant``, the decoder linears are stored quantized (`calc.compress.quant`) and run through
  `calc.compress.quant.quant_linear`;
* with ``lora``, each chosen linear gets ``A [r, in]`` and ``B [out, r]`` (trainable, in the
  adapter dtype) and runs `lora_linear`: ``base(x) + B(A(x)) * scaling``, whose ``A`` keeps the
  input ``x``: the adapted linears' inputs are what LoRA training still saves per layer.

The linears route through ``tape.linear_hooks`` (keyed by the weight's storage), so the graphs
that call ``ops.linear`` need no change. Source of the adapter: Hu et al. 2021 (arXiv
2106.09685), peft ``tuners/lora/layer.py`` ``Linear.forward``.
"""

from __future__ import annotations

from calc.compress import quant
from calc.config.compression import LoRA, Quant
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.models.reference import Shape, Weights
from calc.replay import ops
from calc.replay.tape import Size, Tape, Tensor

LINEAR_KEYS = ("q", "k", "v", "o", "gate", "up", "down")
"""The decoder-layer linears of the llama family, as `Weights` keys them (LoRA's names)."""


def linear_shape(sh: Shape, key: str) -> tuple[Size, Size]:
    """``(out_features, in_features)`` of one decoder linear."""
    h, a, k, d, f = sh.h, sh.a, sh.k, sh.d, sh.f
    return {
        "q": (a * d, h), "k": (k * d, h), "v": (k * d, h), "o": (h, a * d),
        "gate": (f, h), "up": (f, h), "down": (h, f),
    }[key]  # fmt: skip


def adapter_numels(model: ModelSpec, lora: LoRA) -> tuple[int, ...]:
    """Elements of one layer's adapters, ``A`` then ``B`` per module, for a ``calc.ModelSpec``
    (what 8-bit Adam's ``min_8bit_size`` decides on)."""
    h, a, k, d, f = model.hidden, model.n_heads, model.n_kv_heads, model.head_dim, model.ffn
    shapes = {"q": (a * d, h), "k": (k * d, h), "v": (k * d, h), "o": (h, a * d),
              "gate": (f, h), "up": (f, h), "down": (h, f)}  # fmt: skip
    out: list[int] = []
    for key in LINEAR_KEYS:
        if key in lora.modules:
            out_f, in_f = shapes[key]
            out += [lora.rank * in_f, out_f * lora.rank]
    return tuple(out)


def trainable_numels(model: ModelSpec, job: Training | Inference) -> list[int] | None:
    """Elements of every trainable parameter in ``model.parameters()`` order when ``job``
    trains LoRA adapters (per layer, `adapter_numels`), else None (all parameters train)."""
    if not isinstance(job, Training) or job.lora is None:
        return None
    return list(adapter_numels(model, job.lora)) * model.n_layers


def lora_linear(
    tape: Tape, x: Tensor, base: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, rank: Size,
    rows: Size, out_features: Size, name: str, dropout_on: str | None = None,
) -> Tensor:  # fmt: skip
    """``result = base(x); result = result + lora_B(lora_A(dropout(x))) * scaling`` (peft
    order; ``dropout_on``: the device whose dropout runs (`calc.replay.ops.dropout`), ``None``
    for ``lora_dropout=0``, peft's ``nn.Identity``). The dropped copy is an argument of
    ``lora_A``, released when it returns (``A`` saves it).

    ``x`` is first cast to the adapters' dtype (peft's ``_cast_input_dtype``; a no-op for one
    dtype, skipped under autocast); ``lora_A(x)`` saves ``x`` (A needs a gradient) and ``A``
    when ``x`` needs one; ``lora_B`` saves ``A``'s output and ``B``; ``* scaling`` (a Python
    float, also when 1.0) saves nothing and allocates its output; the sum allocates the result
    (fp32 when the adapters are), cast back to the base's dtype (``result.to(...)``). The
    intermediates die as the expression finishes: ``A(x)`` after ``lora_B`` ran, ``B(.)``
    after the product."""
    y = base_linear(tape, x, base, bias, rows, out_features, name)
    return lora_sum(tape, x, y, a, b, rank, rows, out_features, name, dropout_on)


def lora_sum(
    tape: Tape, x: Tensor, y: Tensor, a: Tensor, b: Tensor, rank: Size, rows: Size,
    out_features: Size, name: str, dropout_on: str | None = None, fold_copy: bool = False,
) -> Tensor:  # fmt: skip
    """``y + lora_B(lora_A(dropout(x))) * scaling`` on the frozen base's output ``y``, as
    `lora_linear` describes. ``fold_copy``: without dropout ``x`` reaches ``@ lora_A.T`` as a
    strided slice whose fold to 2-D is a copy, kept by ``A`` (litgpt's head chunks,
    `calc.compress.litgpt_lora`)."""
    xa = x if tape.autocast_itemsize else ops.to_dtype(tape, x, a.itemsize, f"{name}.lora_in")
    xd = xa if dropout_on is None else ops.dropout(tape, xa, f"{name}.lora_dropout", dropout_on)
    if fold_copy and dropout_on is None:
        xd = ops.clone(tape, xa, f"{name}.lora_fold")
    ax = ops.linear(tape, xd, a, None, rows, rank, f"{name}.lora_A")
    if xd is not xa:
        tape.drop(xd)
    bx = ops.linear(tape, ax, b, None, rows, out_features, f"{name}.lora_B")
    tape.drop(ax)
    scaled = ops.unary(tape, bx, f"{name}.lora_scale", saves="none")
    tape.drop(bx)
    total = ops.add(tape, y, scaled, f"{name}.lora_sum")
    tape.drop(scaled)
    out = ops.to_dtype(tape, total, y.itemsize, f"{name}.lora_out")  # result.to(result dtype)
    tape.drop(total, y)
    if xa is not x:
        tape.drop(xa)
    return out


def base_linear(
    tape: Tape, x: Tensor, base: Tensor, bias: Tensor | None, rows: Size, out_features: Size,
    name: str,
) -> Tensor:  # fmt: skip
    """The frozen base ``F.linear(x, base, bias)``: a quantized matmul, or the dense linear
    with its hook (the adapter that called this) lifted."""
    key = id(base.storage)
    qw = tape.quantized.get(key)
    if isinstance(qw, quant.QWeight):
        return quant.quant_linear(tape, x, qw, bias, rows, out_features, name)
    hook = tape.linear_hooks.pop(key)
    try:
        return ops.linear(tape, x, base, bias, rows, out_features, name)
    finally:
        tape.linear_hooks[key] = hook


def compress_weights(
    tape: Tape,
    w: Weights,
    sh: Shape,
    lora: LoRA | None,
    q: Quant | None,
    compute: str,
    order: tuple[str, ...] = LINEAR_KEYS,
    library: quant.NF4Library = "bitsandbytes",
) -> tuple[list[Tensor], list[tuple]]:
    """Freeze, quantize and adapt ``w`` in place; return the trainable tensors and their
    shapes in ``model.parameters()`` order (LoRA: per layer ``A, B`` of each module in
    ``order``: the model's registration order of its decoder linears, Hugging Face's q, k, v,
    o, gate, up, down by default), or ``([], [])`` when nothing trains (inference).
    ``library``: whose nf4 format the quantized base keeps (``torchao`` for torchtune's QLoRA,
    `calc.compress.nf4_torchao`)."""
    if sh.model_type == "gpt2":
        raise NotImplementedError("LoRA/quantization of GPT-2 (fused c_attn Conv1D layers)")
    if q is not None and set(q.keep_16bit) != {"embed", "norm", "lm_head"}:
        raise NotImplementedError("quantized embeddings or LM head are not modelled")
    adapter = compute if lora is None or lora.adapter_dtype is None else lora.adapter_dtype
    if quant.ITEMSIZE[adapter] == quant.ITEMSIZE[compute] and adapter != compute:
        raise NotImplementedError(f"adapter_dtype={adapter!r} with {compute!r} activations")
    for t in w.parameters():  # frozen base: leaves no more
        t.leaf = False
        tape.leaves.pop(id(t.storage), None)
    params: list[Tensor] = []
    shapes: list[tuple] = []
    itemsize = quant.ITEMSIZE[adapter]
    for j, lw in enumerate(w.layers):
        for key in order:
            out_f, in_f = linear_shape(sh, key)
            if q is not None:
                dense = dict.__getitem__(lw, key)  # no pre-hook (prune_replay's dicts)
                assert dense is not None, key  # a decoder linear always has its weight
                lw[key] = quantize_linear(
                    tape, dense, q, (out_f, in_f), compute, j, sh.device, library
                )
            if lora is not None and key in lora.modules:
                a = tape.existing(lora.rank * in_f, itemsize, f"{key}.lora_A", "adapter", True, j)
                b = tape.existing(out_f * lora.rank, itemsize, f"{key}.lora_B", "adapter", True, j)
                params += [a, b]
                shapes += [(lora.rank, in_f), (out_f, lora.rank)]
                base = dict.__getitem__(lw, key)
                assert base is not None, key
                drop_on = sh.device if lora.dropout > 0 else None
                tape.linear_hooks[id(base.storage)] = _lora_hook(base, a, b, lora.rank, drop_on)
    return params, shapes


def quantize_linear(
    tape: Tape, dense: Tensor, q: Quant, shape: tuple[Size, Size], compute: str, tag: object,
    device: str, library: quant.NF4Library = "bitsandbytes",
) -> Tensor:  # fmt: skip
    """Replace the frozen linear weight ``dense`` (``[out, in]``, declared with
    ``Tape.existing``) by its quantized tensors (`calc.compress.quant.existing`) and return
    the values tensor, which stands for the weight from then on: a linear on it runs
    `calc.compress.quant.quant_linear`, and `base_linear` finds it under an adapter."""
    tape.forget_existing(dense)
    qw = quant.existing(tape, q, shape[0], shape[1], compute, tag, device, library)
    values = next(t for t in qw.stored if t.storage.kind == "weight")
    tape.quantized[id(values.storage)] = qw
    tape.linear_hooks[id(values.storage)] = _quant_hook(qw)
    return values


def _quant_hook(qw: quant.QWeight):
    def hook(tape: Tape, x: Tensor, bias: Tensor | None, rows: Size, out: Size, name: str):
        return quant.quant_linear(tape, x, qw, bias, rows, out, name)

    return hook


def _lora_hook(base: Tensor, a: Tensor, b: Tensor, rank: int, dropout_on: str | None):
    def hook(tape: Tape, x: Tensor, bias: Tensor | None, rows: Size, out: Size, name: str):
        return lora_linear(tape, x, base, bias, a, b, rank, rows, out, name, dropout_on)

    return hook


def check_parallel(job: Training | Inference, parallel: Parallelism) -> None:
    """Raise ``NotImplementedError`` unless ``job``'s compression under ``parallel`` (not a
    single GPU) is a combination the cost model covers and verify measured.

    Covered: LoRA or QLoRA (``job.lora``, optionally ``job.quant``) with plain data
    parallelism (DDP, ``zero=0``, either ``gradient_as_bucket_view``). The frozen base has
    ``requires_grad=False``, so DDP's reducer leaves it out of its buckets
    (``torch/nn/parallel/distributed.py``: ``_build_params_for_reducer`` keeps parameters
    with ``requires_grad`` only): the buckets hold the adapters' gradients, in the order they
    become ready, as for any trainable parameters (`calc.parallel.data`). LoRA (16-bit base,
    adapters in the base's dtype) under FSDP2 ``fully_shard`` per layer and root: the frozen
    base is sharded and all-gathered with the adapters, and only the parameters with a gradient
    (the adapters) are reduce-scattered (``FSDPParamGroup.post_backward``,
    ``fsdp_params_with_grad``; `calc.parallel.fsdp`). ZeRO-1/2 with sharded states (analytic,
    as for full fine-tuning): each rank's share of the adapters' states (and, ZeRO-2, of their
    gradients) is ``1/dp`` of each, DeepSpeed's flat partition (`calc.parallel.data.flat_share`);
    the frozen base stays whole on every rank.
    """
    if not isinstance(job, Training):
        raise NotImplementedError("compressed inference on several GPUs is not modelled")
    if job.pruning is not None or job.distill is not None:
        raise NotImplementedError(
            "parallelism together with pruning or distillation is not modelled yet"
        )
    if job.lora is None:
        raise NotImplementedError(
            "parallelism with a quantized base and no LoRA adapters is not modelled"
        )
    others = [f"{name}={getattr(parallel, name)}" for name in ("tp", "pp", "cp")
              if getattr(parallel, name) > 1]  # fmt: skip
    if others:
        raise NotImplementedError(
            f"LoRA/QLoRA with {', '.join(others)} is not modelled yet (data parallelism only)"
        )
    if parallel.offload != "none":
        raise NotImplementedError(f"LoRA/QLoRA with offload={parallel.offload!r} is not modelled")
    if parallel.fsdp and parallel.fsdp_version == 1 and not parallel.fsdp_use_orig_params:
        raise ValueError(
            "LoRA with fsdp_version=1 needs fsdp_use_orig_params=True: FSDP1 flattens a layer's "
            "parameters into one, which must all require grad or none (torch: 'has both "
            "parameters with requires_grad=True and False')"
        )
    if parallel.shard_level == 3:  # fsdp=True or zero=3: both replay FSDP2 (calc.parallel.fsdp)
        torchao = quant.library_of(job) == "torchao" and parallel.fsdp_version == 2
        if job.quant is not None and not torchao:
            raise NotImplementedError(
                "QLoRA with fsdp=True (or zero=3) is modelled for torchtune's recipe "
                "(implementation='torchtune': torchao's NF4Tensor, which FSDP2 shards and "
                "all-gathers); bitsandbytes' quantized base is buffers to fully_shard "
                "(replicated), as its FSDP support changes: use DDP (zero=0)"
            )
        return
