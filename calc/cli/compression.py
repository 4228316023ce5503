"""The command-line options for quantization and LoRA (wired into ``python -m calc``).

* ``--quant int8|int4|nf4|fp8`` (``--group-size``, ``--zero-point``/``--no-zero-point``,
  ``--scale-dtype``, ``--no-double-quant``, ``--fp8-scaling``, ``--quant-lm-head``): weight-only
  quantization of the decoder linears (and the LM head: ``keep_16bit`` without it) (``calc.Quant``):
  served weights, or the frozen base of QLoRA;
* ``--lora-rank R`` (``--lora-alpha``, ``--lora-modules q,v``, ``--lora-dropout P``): LoRA adapters
  (``calc.LoRA``), training only;
* ``--kv-quant int8|fp8``: the KV cache, inference only.

The job classes validate every value (one message naming the field and the allowed values).
"""

from __future__ import annotations

import argparse
import dataclasses

from calc.config.compression import (
    FP8_SCALINGS,
    KV_QUANTS,
    LORA_MODULES,
    QUANT_METHODS,
    SCALE_DTYPES,
    LoRA,
    Quant,
)
from calc.config.jobs import Inference, Training


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the quantization and LoRA option groups to ``p``."""
    q = p.add_argument_group("quantization")
    q.add_argument("--quant", help=f"weight format: {', '.join(QUANT_METHODS)}")
    q.add_argument("--group-size", type=int, help="elements per scale (int4 128, nf4 64)")
    q.add_argument(
        "--zero-point", action=argparse.BooleanOptionalAction, help="int8/int4 zero points"
    )
    q.add_argument("--scale-dtype", help=f"int8/int4 scales: {', '.join(SCALE_DTYPES)}")
    q.add_argument(
        "--no-double-quant", action="store_true", help="nf4: fp32 absmax per block instead"
    )
    q.add_argument("--fp8-scaling", help=f"fp8 scales: {', '.join(FP8_SCALINGS)} (default tensor)")
    q.add_argument(
        "--quant-lm-head",
        action="store_true",
        help="quantize the LM head too (every nn.Linear, as Lightning's bitsandbytes plugin)",
    )
    q.add_argument("--kv-quant", help=f"inference KV cache: {', '.join(KV_QUANTS)}")
    lo = p.add_argument_group("LoRA (--task train)")
    lo.add_argument("--lora-rank", type=int, help="adapter rank: trains LoRA adapters only")
    lo.add_argument("--lora-alpha", type=float, help="lora_alpha (default: the rank)")
    lo.add_argument(
        "--lora-modules",
        help=f"comma-separated of {','.join(LORA_MODULES)} (default the seven of the layers; "
        "lm_head with --implementation litgpt)",
    )
    lo.add_argument(
        "--lora-dropout", type=float, help="lora_dropout in [0, 1) (default 0: peft's Identity)"
    )


def quant_of(args: argparse.Namespace) -> Quant | None:
    """``calc.Quant`` from ``--quant`` and its options (``ValueError`` for a stray option)."""
    extra = {
        "group_size": args.group_size,
        "zero_point": args.zero_point,
        "scale_dtype": args.scale_dtype,
        "fp8_scaling": args.fp8_scaling,
    }
    flags = {"no_double_quant": args.no_double_quant,
             "quant_lm_head": getattr(args, "quant_lm_head", False)}  # fmt: skip
    if args.quant is None:
        stray = [k for k, v in extra.items() if v is not None] + [k for k, v in flags.items() if v]
        if stray:
            names = ", ".join("--" + k.replace("_", "-") for k in stray)
            raise ValueError(f"{names} need --quant")
        return None
    kw = {k: v for k, v in extra.items() if v is not None}
    if args.no_double_quant:
        kw["double_quant"] = False
    if flags["quant_lm_head"]:
        kw["keep_16bit"] = ("embed", "norm")
    return Quant(method=args.quant, **kw)


def lora_of(args: argparse.Namespace) -> LoRA | None:
    """``calc.LoRA`` from ``--lora-rank`` and its options."""
    if args.lora_rank is None:
        dropout = getattr(args, "lora_dropout", None)
        if args.lora_alpha is not None or args.lora_modules is not None or dropout is not None:
            raise ValueError("--lora-alpha/--lora-modules/--lora-dropout need --lora-rank")
        return None
    kw: dict = {"rank": args.lora_rank, "alpha": args.lora_alpha}
    if getattr(args, "lora_dropout", None) is not None:
        kw["dropout"] = args.lora_dropout
    if args.lora_modules is not None:
        kw["modules"] = tuple(m.strip() for m in args.lora_modules.split(",") if m.strip())
    return LoRA(**kw)


def apply(args: argparse.Namespace, job: Training | Inference) -> Training | Inference:
    """``job`` with the quantization/LoRA fields the options ask for (validated again)."""
    quant, lora = quant_of(args), lora_of(args)
    if isinstance(job, Training):
        if args.kv_quant is not None:
            raise ValueError("--kv-quant applies to --task infer only")
        return dataclasses.replace(job, quant=quant, lora=lora)
    if lora is not None:
        raise ValueError("--lora-rank applies to --task train only")
    return dataclasses.replace(job, quant=quant, kv_quant=args.kv_quant)
