"""Weight-only quantization: bytes per parameter, the stored tensors, and the dequantizing matmul.

A quantized linear ``[out, in]`` is stored as (``calc.Quant`` chooses):

=========  ===========================================  ==========================================
method     values                                       scales
=========  ===========================================  ==========================================
int8       int8 (uint8 with a zero point) ``[out,in]``  scale (and zero) ``[out, in/g]``, fp32*
int4       uint8 ``[out, in/2]``, two a byte            scale (and zero) ``[out, in/g]``, fp16*
nf4        uint8 ``[out*in/2]`` (bitsandbytes           fp32 absmax per block of ``g``; with
           ``Params4bit``)                              double quantization uint8 per block + fp32
                                                        per 256 blocks + fp32 offset; 16 fp32 code
fp8 e4m3   float8 ``[out, in]``                         fp32 ``[1]`` (tensor) or ``[out]`` (row)
=========  ===========================================  ==========================================

(* the defaults; ``scale_dtype`` chooses.) Sources: LLM.int8() (Dettmers et al. 2022, arXiv
2208.07339) for per-row int8; GPTQ (Frantar et al. 2023, arXiv 2210.17323) and AWQ (Lin et
al. 2024, arXiv 2306.00978) for 4-bit groups of 128 with fp16 scales and zero points; QLoRA
(Dettmers et al. 2023, arXiv 2305.14314, §3 "Double Quantization": 0.127 bits per parameter
of constants instead of 0.5) and bitsandbytes ``functional.quantize_4bit`` for NF4; the FP8
formats paper (Micikevicius et al. 2022, arXiv 2209.05433) for e4m3.

The matmul is `quant_linear`: `calc.derive.quantized`'s ``QuantMatmul`` (a custom autograd Function keeping no
activation) dequantizes the weight to the compute dtype, runs ``F.linear`` and frees the dense
weight, in forward and again in backward. `dequantize` replays its allocations exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import sympy as sp

from calc.compress import nf4_torchao
from calc.config.compression import NF4_NESTED_BLOCK, Quant
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.replay import ops
from calc.replay.tape import Node, Size, Tape, Tensor

NF4_CODE_ENTRIES = 16
"""Entries of the NF4 lookup table each quantized tensor keeps (fp32)."""
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the compute and scale dtypes."""
NF4Library = Literal["bitsandbytes", "torchao"]
"""Whose nf4 format a quantized linear keeps (`QWeight.library`)."""


def bytes_per_param(quant: Quant, in_features: int | None = None) -> sp.Rational:
    """Stored bytes per weight element, values plus scales (no per-tensor constants, no
    allocator rounding), as an exact rational: int4 values are 1/2 byte.

    ``in_features`` is needed for per-row scales (int8 default, fp8 ``row``). Examples:
    nf4 with double quantization ``1/2 + 1/64 + 4/(64*256) = 2113/4096`` (4.127 bits, QLoRA
    §3); int4 at groups of 128 with fp16 scale and zero ``1/2 + 4/128 = 17/32``."""
    return value_bytes_per_param(quant) + scale_bytes_per_param(quant, in_features)


def value_bytes_per_param(quant: Quant) -> sp.Rational:
    """Bytes of the quantized values alone: 1 (int8, fp8) or 1/2 (int4, nf4)."""
    return sp.Rational(1, 2) if quant.method in ("int4", "nf4") else sp.Integer(1)


def scale_bytes_per_param(quant: Quant, in_features: int | None = None) -> sp.Rational:
    """Bytes of scales, zero points and nested absmax per weight element (the overhead term)."""
    if quant.method == "nf4":
        block = _nf4_block(quant)
        if quant.double_quant:
            return sp.Rational(1, block) + sp.Rational(4, block * NF4_NESTED_BLOCK)
        return sp.Rational(4, block)
    if quant.method == "fp8" and quant.fp8_scaling == "tensor":
        return sp.Integer(0)
    g = quant.group if quant.method != "fp8" else None
    if g is None:
        if in_features is None:
            raise ValueError(f"in_features is needed for per-row scales of {quant.method}")
        g = in_features
    per_group = (
        4 if quant.method == "fp8" else quant.scale_bytes * (2 if quant.has_zero_point else 1)
    )
    return sp.Rational(per_group, g)


def _nf4_block(quant: Quant) -> int:
    """Elements per nf4 absmax block: the group in force, never None for nf4 (default 64)."""
    block = quant.group
    assert block is not None, quant
    return block


def _div(a: Size, b: Size) -> Size:
    """``a / b`` for sizes known to divide: an int for ints, else a sympy expression."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return sp.sympify(a) / b


def _nested_blocks(nb: Size) -> Size:
    """Second-level blocks of the double quantization: ``ceil(nb / 256)``."""
    if isinstance(nb, int):
        return -(-nb // NF4_NESTED_BLOCK)
    return sp.ceiling(nb / NF4_NESTED_BLOCK)


@dataclass(frozen=True, slots=True)
class Stored:
    """One tensor a quantized linear keeps: name, elements, bytes per element."""

    name: str
    numel: Size
    itemsize: int
    kind: str
    """``weight`` (the values) or ``qscale`` (scales, zeros, absmax, code: the overhead)."""


def check_divides(quant: Quant, out_features: int, in_features: int, where: str) -> None:
    """Raise ``ValueError`` unless the group size fits the linear ``[out, in]``."""
    g = quant.group
    if g is None:
        return
    if quant.method == "nf4":
        if (out_features * in_features) % g:
            raise ValueError(
                f"group_size={g} must divide the {out_features}x{in_features} weight of {where}"
            )
    elif in_features % g:
        raise ValueError(f"group_size={g} must divide in_features={in_features} of {where}")


def library_of(job: Training | Inference) -> NF4Library:
    """Whose nf4 format ``job`` quantizes with: torchao's for torchtune's QLoRA
    (``implementation="torchtune"``), bitsandbytes' otherwise."""
    return "torchao" if job.implementation == "torchtune" else "bitsandbytes"


def shards_of(parallel: Parallelism | None) -> int:
    """Ranks FSDP2 (or ZeRO-3) shards each parameter over under ``parallel``; 1 otherwise."""
    if parallel is None or parallel.shard_level != 3:
        return 1
    return parallel.shard_world


def check_fits(
    model: ModelSpec, quant: Quant, library: NF4Library = "bitsandbytes", shards: int = 1
) -> None:
    """Raise ``ValueError`` unless ``quant``'s group size divides every quantized linear of
    ``model`` (a ``calc.ModelSpec``; the llama family's q, k, v, o, gate, up, down), or, for
    torchao's nf4, ``to_nf4`` can quantize each and FSDP2 split it over ``shards`` ranks
    (`nf4_torchao.check_fits`)."""
    h, a, k, d, f = model.hidden, model.n_heads, model.n_kv_heads, model.head_dim, model.ffn
    shapes = {"q": (a * d, h), "k": (k * d, h), "v": (k * d, h), "o": (h, a * d),
              "gate": (f, h), "up": (f, h), "down": (h, f)}  # fmt: skip
    for name, (out_f, in_f) in shapes.items():
        where = f"the {name} projection of {model.name}"
        if library == "torchao":
            nf4_torchao.check_fits(out_f, in_f, where, shards)
        else:
            check_divides(quant, out_f, in_f, where)


def stored_tensors(quant: Quant, out_f: Size, in_f: Size) -> list[Stored]:
    """The tensors verify's ``QuantLinear`` registers for a ``[out_f, in_f]`` weight, each a
    separate allocation (so each is rounded on its own)."""
    m = quant.method
    if m == "nf4":
        n = out_f * in_f
        nb = _div(n, _nf4_block(quant))
        out = [Stored("nf4.packed", _div(n, 2), 1, "weight"),
               Stored("nf4.code", NF4_CODE_ENTRIES, 4, "qscale")]  # fmt: skip
        if quant.double_quant:
            n2 = _nested_blocks(nb)
            out += [Stored("nf4.qabsmax", nb, 1, "qscale"), Stored("nf4.absmax2", n2, 4, "qscale"),
                    Stored("nf4.offset", 1, 4, "qscale")]  # fmt: skip
        else:
            out.append(Stored("nf4.absmax", nb, 4, "qscale"))
        return out
    if m == "fp8":
        scales = out_f if quant.fp8_scaling == "row" else 1
        return [Stored("fp8.values", out_f * in_f, 1, "weight"),
                Stored("fp8.scale", scales, 4, "qscale")]  # fmt: skip
    groups = _div(in_f, quant.group or in_f)
    sb = quant.scale_bytes
    out = []
    if quant.has_zero_point:
        out.append(Stored(f"{m}.zero", out_f * groups, sb, "qscale"))
    out.append(Stored(f"{m}.scale", out_f * groups, sb, "qscale"))
    values = out_f * in_f if m == "int8" else _div(out_f * in_f, 2)
    out.append(Stored(f"{m}.values", values, 1, "weight"))
    return out


@dataclass(eq=False)
class QWeight:
    """A quantized linear on the tape: its stored tensors and what dequantizing needs."""

    quant: Quant
    out_f: Size
    in_f: Size
    compute: str
    """The compute dtype (``fp32``/``bf16``/``fp16``): activations and the dense weight."""
    stored: list[Tensor]
    device: str = "cpu"
    """``cpu``: verify's dequantization, op by op; ``cuda``: bitsandbytes' kernel for nf4."""
    library: NF4Library = "bitsandbytes"
    """Whose nf4 format: ``bitsandbytes`` (verify's copy on CPU, its kernel on CUDA) or
    ``torchao`` (torchtune's QLoRA, `calc.compress.nf4_torchao`: plain torch ops on any
    device)."""


def existing(
    tape: Tape, quant: Quant, out_f: Size, in_f: Size, compute: str, tag: object,
    device: str = "cpu", library: NF4Library = "bitsandbytes",
) -> QWeight:  # fmt: skip
    """Declare the stored tensors of one quantized linear (alive before the replay);
    ``library="torchao"``: an nf4 ``NF4Tensor`` in the compute dtype (`nf4_torchao.stored`)."""
    if library == "torchao":
        specs = [Stored(*s) for s in nf4_torchao.stored(out_f * in_f, ITEMSIZE[compute])]
    else:
        specs = stored_tensors(quant, out_f, in_f)
    tensors = [tape.existing(s.numel, s.itemsize, s.name, s.kind, tag=tag) for s in specs]
    return QWeight(quant, out_f, in_f, compute, tensors, device, library)


def dequantize(tape: Tape, qw: QWeight) -> Tensor:
    """``calc.derive.quantized.dequantize(module, dtype)``: the dense ``[out, in]`` weight
    in the compute dtype, with each temporary it makes (measured with ``verify.measure.trace``).

    ``.to(dtype)`` to the dtype a tensor already has returns it (no allocation); in-place
    ``sub_``/``mul_``/``div_``/``add_`` allocate nothing."""
    q, cd = qw.quant, qw.compute
    it = ITEMSIZE[cd]
    n = qw.out_f * qw.in_f
    if qw.library == "torchao":
        return nf4_torchao.dequantize(tape, n, it)
    if q.method == "nf4":
        return _dequantize_nf4(tape, qw, n, it)
    if q.method == "fp8":
        w = tape.new(n, it, "dq.w")
        if cd != "fp32":
            scales = qw.out_f if q.fp8_scaling == "row" else 1
            tape.drop(tape.new(scales, it, "dq.scale"))
        return w
    if q.method == "int8":
        w = tape.new(n, it, "dq.w")
    else:  # unpack: lo = packed & 15, hi = packed >> 4, stack, cast
        lo = tape.new(_div(n, 2), 1, "dq.lo")
        hi = tape.new(_div(n, 2), 1, "dq.hi")
        stacked = tape.new(n, 1, "dq.stack")
        tape.drop(lo, hi)
        w = tape.new(n, it, "dq.w")
        tape.drop(stacked)
    groups = _div(qw.out_f * qw.in_f, q.group or qw.in_f)
    sdt = q.scale_dtype or ("fp32" if q.method == "int8" else "fp16")
    for part in (("zero",) if q.has_zero_point else ()) + ("scale",):
        if sdt != cd:
            tape.drop(tape.new(groups, it, f"dq.{part}"))
    return w


def _dequantize_nf4(tape: Tape, qw: QWeight, n: Size, it: int) -> Tensor:
    q, cd = qw.quant, qw.compute
    nb = _div(n, _nf4_block(q))
    if qw.device == "cuda":
        # bitsandbytes ``functional.dequantize_4bit``: with nested statistics the absmax is
        # dequantized first (``dequantize_blockwise`` -> fp32 [nb], ``+= offset`` in place),
        # then one ``empty(shape, dtype)`` the kernel fills. Not measured on a GPU here.
        absmax = tape.new(nb, 4, "dq.absmax") if q.double_quant else None
        w = tape.new(n, it, "dq.w")
        tape.drop(absmax)
        return w
    absmax = None
    if q.double_quant:
        qa = tape.new(nb, 4, "dq.absmax")  # qabsmax.to(float32)
        n2 = _nested_blocks(nb)
        tape.drop(tape.new(n2 * NF4_NESTED_BLOCK, 4, "dq.absmax2"))  # repeat_interleave
        if cd != "fp32":
            absmax = tape.new(nb, it, "dq.absmax.cast")
            tape.drop(qa)
        else:
            absmax = qa
    elif cd != "fp32":
        absmax = tape.new(nb, it, "dq.absmax.cast")
    hi = tape.new(_div(n, 2), 1, "dq.hi")
    lo = tape.new(_div(n, 2), 1, "dq.lo")
    stacked = tape.new(n, 1, "dq.stack")
    tape.drop(hi, lo)
    idx = tape.new(n, 4, "dq.idx32")
    tape.drop(stacked)
    code = tape.new(NF4_CODE_ENTRIES, it, "dq.code") if cd != "fp32" else None
    w = tape.new(n, it, "dq.w")
    tape.drop(idx, code, absmax)
    return w


def quant_linear(
    tape: Tape, x: Tensor, qw: QWeight, bias: Tensor | None, rows: Size, out_features: Size,
    name: str,
) -> Tensor:  # fmt: skip
    """``QuantMatmul.apply(x, module)`` (`calc.derive.quantized`): forward with grad mode off
    (dequantize, ``F.linear``, free the dense weight); the node keeps no tensor. Backward
    (only when ``x`` needs a gradient): dequantize again, ``grad.matmul(w)``, free ``w``."""
    if tape.autocast_itemsize:
        raise NotImplementedError("quantized weights under autocast (amp-*) are not modelled")

    def rule(tape: Tape, node: Node, grads: list) -> list:
        w = dequantize(tape, qw)
        gx = tape.new(x.numel, x.itemsize, f"d{name}.in")
        tape.drop(w)
        return [gx]

    n = tape.node("QuantMatmul", rule, [x])
    grad_before, tape.grad_enabled = tape.grad_enabled, False
    try:
        w = dequantize(tape, qw)
        out = ops.linear(tape, x, w, bias, rows, out_features, name)
        tape.drop(w)
    finally:
        tape.grad_enabled = grad_before
    return tape.output(out, n)
