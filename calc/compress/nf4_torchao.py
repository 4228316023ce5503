"""torchao's NF4 weights, as torchtune's QLoRA stores and dequantizes them.

torchtune 0.6.1 builds a QLoRA model with ``quantize_base=True``: every decoder linear is a
``FrozenNF4Linear`` (``torchtune/modules/low_precision/nf4_linear.py``) or a ``LoRALinear``
whose frozen base is ``to_nf4(weight)`` (``torchtune/modules/peft/lora.py``, ``__init__`` and
``forward``); both call torchao's ``linear_nf4``. The output projection stays a plain linear
(``models/llama3/_component_builders.py``: "quantize_base is not applied to final
output_proj"). torchao's ``NF4Tensor`` (``torchao/dtypes/nf4tensor.py``, the same code in
0.10-0.14) keeps, for a weight of ``n`` elements in dtype ``t`` (bf16 or fp32), blocks of
``block = 64`` and scaler blocks of ``256``, five tensors, each its own allocation:

=====================  ==============  ======================================================
tensor                 elements        dtype
=====================  ==============  ======================================================
``quantized_data``     ``n / 2``       uint8 (two 4-bit indices a byte)
``quantized_scalers``  ``n / block``   int8 (each block's absmax, quantized per 256 blocks)
``quantization_factor`` ``n/block/256``* ``t``
``scaler_mean``        1               ``t``
``nf4``                16              ``t`` (the NormalFloat table)
=====================  ==============  ======================================================

(* ``n / block`` when that is 256: `_factor_storage`.)

``linear_nf4`` is the autograd Function ``LinearNF4``: forward ``F.linear(x, w.to(x.dtype))``
under no grad, saving only the NF4 tensor; backward ``grad @ w.to(grad.dtype)``. Each ``.to``
dequantizes the whole weight with ``get_original_weight``, whose temporaries (`dequantize`)
were read from an allocation trace of torchao 0.14 on this machine: two int64 index tensors of
``n / 2`` live through the whole function, about 12 bytes per weight element at its peak
beside the ``2n``-byte result. `to_nf4` asserts that ``block`` divides ``n`` and that 256
divides ``n / block`` (`check_fits`).
"""

from __future__ import annotations

from typing import Any

import sympy as sp

from calc.config.jobs import Training
from calc.models.shape import Shape
from calc.replay.tape import Size, Tape, Tensor, divide

BLOCK = 64
"""``to_nf4``'s default ``block_size`` (elements per absmax)."""
SCALER_BLOCK = 256
"""``to_nf4``'s default ``scaler_block_size`` (absmaxes per int8 quantization factor)."""
TABLE_ENTRIES = 16
"""Entries of the NF4 table every ``NF4Tensor`` holds in its own dtype."""
INT64 = 8


def stored(n: Size, itemsize: int) -> list[tuple[str, Size, int, str]]:
    """``(name, elements, bytes per element, kind)`` of each tensor an ``NF4Tensor`` of ``n``
    elements in a dtype of ``itemsize`` bytes keeps; kind ``weight`` (the packed values) or
    ``qscale`` (the rest: quantization overhead)."""
    blocks = divide(n, BLOCK)
    return [
        ("nf4.quantized_data", divide(n, 2), 1, "weight"),
        ("nf4.quantized_scalers", blocks, 1, "qscale"),
        ("nf4.quantization_factor", _factor_storage(blocks), itemsize, "qscale"),
        ("nf4.scaler_mean", 1, itemsize, "qscale"),
        ("nf4.table", TABLE_ENTRIES, itemsize, "qscale"),
    ]


def _factor_storage(blocks: Size) -> Size:
    """Elements of ``quantization_factor``'s storage. ``double_quantize_scalers`` computes
    ``256 / (2 * absmax)`` on an absmax expanded to every block (``blocks`` elements), keeps
    column 0 and calls ``.contiguous()``: a copy of ``blocks / 256`` elements, except when
    there is one scaler block, whose ``[1]`` view is already contiguous and keeps the whole
    storage (a weight of exactly 16,384 elements)."""
    per_scaler = divide(blocks, SCALER_BLOCK)
    if isinstance(blocks, int):
        return blocks if blocks == SCALER_BLOCK else per_scaler
    return sp.Piecewise((blocks, sp.Eq(blocks, SCALER_BLOCK)), (per_scaler, True))


def check_job(sh: Shape, job: Training) -> None:
    """torchtune's QLoRA (``quantize_base=True``): torchao's NF4 with its default blocks on
    every decoder linear, LoRA adapters on the chosen ones, the output projection and the
    embedding unquantized. Raises ``NotImplementedError`` for any other quantization."""
    q = job.quant  # with job.lora: calc.Training refuses a quantized base without adapters
    assert q is not None
    if q.method != "nf4" or q.group != BLOCK or not q.double_quant:
        raise NotImplementedError(
            f"implementation='torchtune' quantizes with torchao's to_nf4 (method='nf4', "
            f"group_size={BLOCK}, double_quant=True); got method={q.method!r}, "
            f"group_size={q.group}, double_quant={q.double_quant}"
        )
    if set(q.keep_16bit) != {"embed", "norm", "lm_head"}:
        raise NotImplementedError(
            "implementation='torchtune' QLoRA keeps the embedding and the output projection "
            "unquantized (keep_16bit=('embed', 'norm', 'lm_head'))"
        )
    if sh.qkv_bias or sh.o_bias or sh.mlp_bias:
        raise NotImplementedError(
            "implementation='torchtune' QLoRA of a model with linear biases (Qwen2's q/k/v): "
            "modelled for bias-free llama and mistral"
        )


def check_fits(out_features: int, in_features: int, where: str, shards: int = 1) -> None:
    """Raise ``ValueError`` unless ``to_nf4`` can quantize an ``[out, in]`` weight: its
    elements a multiple of ``block * scaler_block`` = 16,384; and, sharded over ``shards``
    ranks by FSDP2, unless ``aten.split`` of an ``NF4Tensor`` can chunk it: dim 0 and every
    inner tensor split evenly (``nf4_split``: ``inner_tensor.numel() % num_chunks == 0``; the
    smallest is ``quantization_factor``, one element per 16,384)."""
    n = out_features * in_features
    unit = BLOCK * SCALER_BLOCK
    if n % unit:
        raise ValueError(
            f"quant: torchao's to_nf4 needs the elements of every quantized weight to be a "
            f"multiple of {BLOCK} x {SCALER_BLOCK} = {unit}; {where} is "
            f"{out_features} x {in_features} = {n}"
        )
    if shards > 1 and (out_features % shards or (n // unit) % shards):
        raise ValueError(
            f"parallel: FSDP2 over dp={shards} chunks each NF4Tensor on dim 0, and torchao "
            f"splits its inner tensors evenly: {where} ({out_features} x {in_features}) needs "
            f"out features and elements / {unit} divisible by {shards}"
        )


GATHERED = ("nf4.quantized_scalers", "nf4.quantization_factor", "nf4.quantized_data")
"""The inner tensors ``NF4Tensor.fsdp_pre_all_gather`` hands FSDP2 to all-gather, in order;
``scaler_mean`` and the table go in the metadata, shared by every shard and the gathered
tensor (``construct_nf4_args`` passes the same tensors on)."""


def gathered_numels(n: Size) -> dict[str, Size]:
    """Elements of each `GATHERED` tensor of an ``NF4Tensor`` of ``n`` elements (the
    quantization factor's own elements, not a one-block storage: FSDP2 needs more blocks)."""
    blocks = divide(n, BLOCK)
    return {
        "nf4.quantized_scalers": blocks,
        "nf4.quantization_factor": divide(blocks, SCALER_BLOCK),
        "nf4.quantized_data": divide(n, 2),
    }


def fsdp_inputs(
    tape: Tape, params: list[Tensor], shapes: list[tuple]
) -> tuple[list[Tensor], list[tuple], frozenset[int]]:
    """FSDP2's all-gather inputs for ``params`` (with their ``shapes``): each quantized base
    (`calc.compress.quant.QWeight` of torchao's nf4, by its values' storage in
    ``tape.quantized``) becomes its `GATHERED` inner tensors, flat, which FSDP2 shards at
    init (``_init_sharded_param``: ``torch.chunk`` is ``nf4_split``, ``new_zeros`` and
    ``copy_`` make each rank's inner shards) and all-gathers per layer (uint8 with the
    adapters); the third item names their storages (no dim-0 padding: they split evenly,
    `check_fits`)."""
    out: list[Tensor] = []
    out_shapes: list[tuple] = []
    unpadded: set[int] = set()
    for p, shape in zip(params, shapes, strict=True):
        qw: Any = tape.quantized.get(id(p.storage))
        if qw is None:
            out.append(p)
            out_shapes.append(shape)
            continue
        if qw.library != "torchao":
            raise NotImplementedError("FSDP2 over a bitsandbytes-format quantized base")
        numels = gathered_numels(qw.out_f * qw.in_f)
        for t in qw.stored:
            if t.storage.name in numels:
                out.append(t)
                out_shapes.append((numels[t.storage.name],))
                unpadded.add(id(t.storage))
    return out, out_shapes, frozenset(unpadded)


def dequantize(tape: Tape, n: Size, itemsize: int) -> Tensor:
    """``NF4Tensor.get_original_weight()``: the dense weight of ``n`` elements, with the
    temporaries of each line (``>> 4`` and ``& 0b1111`` uint8, each ``.to(torch.long)``; the two
    table lookups ``nf4[idx]``; ``dequantize_scalers``' ``int8 / factor`` and ``+ mean``; each
    ``repeated.flatten()`` a copy of an expanded view, multiplied; ``torch.stack``). The locals
    die as the function returns; the result is the stack's output (``reshape`` views it)."""
    half = divide(n, 2)
    blocks = divide(n, BLOCK)
    shifted = tape.new(half, 1, "nf4dq.hi")
    first = tape.new(half, INT64, "nf4dq.first")
    tape.drop(shifted)
    masked = tape.new(half, 1, "nf4dq.lo")
    second = tape.new(half, INT64, "nf4dq.second")
    tape.drop(masked)
    values_first = tape.new(half, itemsize, "nf4dq.lookup_first")
    values_second = tape.new(half, itemsize, "nf4dq.lookup_second")
    quotient = tape.new(blocks, itemsize, "nf4dq.scalers_div")
    scalers = tape.new(blocks, itemsize, "nf4dq.scalers")
    tape.drop(quotient)
    scaled = []
    for part in ("first", "second"):
        repeated = tape.new(half, itemsize, f"nf4dq.repeat_{part}")
        scaled.append(tape.new(half, itemsize, f"nf4dq.scaled_{part}"))
        tape.drop(repeated)
    weight = tape.new(n, itemsize, "nf4dq.stack")
    tape.drop(first, second, values_first, values_second, scalers, *scaled)
    return weight
