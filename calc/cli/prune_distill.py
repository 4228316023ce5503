"""The command-line options for pruning and distillation (wired into ``python -m calc``).

* ``--prune unstructured|2:4`` (``--prune-amount``, ``--prune-modules q,v``,
  ``--prune-removed``): training runs under ``torch.nn.utils.prune`` (``calc.Pruning``); with
  either task the output adds how the pruned weights would be stored (dense, CSR, COO, 2:4)
  and which saves memory (``--sparse-index int64|int32``);
* ``--keep-heads``, ``--keep-kv-heads``, ``--keep-ffn``, ``--keep-layers``: structured pruning,
  the model itself shrinks (``calc.pruned_spec``);
* ``--teacher ID`` (``--teacher-precision``, ``--teacher-quant``, ``--distill-temperature``,
  ``--distill-hard-weight``): knowledge distillation from a card's model (``calc.Distill``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from calc.compress.sparse import INDEX_DTYPES, StorageVerdict, storage_verdict
from calc.compress.structured import pruned_spec
from calc.config.compression import Quant
from calc.config.distill import TEACHER_PRECISIONS, Distill
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.config.pruning import PRUNING_KINDS, Pruning
from calc.data.cards import load_card

VALUE_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "bf16-master": 2}
"""Bytes of one stored weight for a job's precision (``amp-*`` keep fp32 weights)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the pruning and distillation option groups to ``p``."""
    g = p.add_argument_group("pruning")
    g.add_argument("--prune", help=f"{', '.join(PRUNING_KINDS)}: prune the layers' linears")
    g.add_argument("--prune-amount", type=float, help="fraction zeroed (default 0.5)")
    g.add_argument("--prune-modules", help="comma-separated, e.g. q,v (default: all linears)")
    g.add_argument(
        "--prune-removed", action="store_true", help="prune.remove ran: dense with zeros"
    )
    g.add_argument(
        "--sparse-index", default="int64", help=f"{', '.join(INDEX_DTYPES)} (CSR; COO is int64)"
    )
    for name, what in (
        ("heads", "query heads"),
        ("kv-heads", "key/value heads"),
        ("ffn", "FFN channels"),
        ("layers", "layers"),
    ):
        g.add_argument(f"--keep-{name}", type=int, help=f"structured pruning: {what} kept")
    d = p.add_argument_group("distillation (--task train)")
    d.add_argument("--teacher", metavar="ID", help="teacher model card id")
    d.add_argument("--teacher-precision", help=f"{', '.join(TEACHER_PRECISIONS)} (default bf16)")
    d.add_argument("--teacher-quant", help="nf4, int8, int4, fp8: quantize the teacher")
    d.add_argument("--distill-temperature", type=float, help="softmax temperature (default 1)")
    d.add_argument("--distill-hard-weight", type=float, help="weight of the hard CE (default 0)")


def pruning_of(args: argparse.Namespace) -> Pruning | None:
    """``calc.Pruning`` from ``--prune*`` (``ValueError`` for a stray ``--prune-*``)."""
    if args.prune is None:
        if args.prune_amount is not None or args.prune_modules or args.prune_removed:
            raise ValueError("--prune-amount/--prune-modules/--prune-removed need --prune")
        return None
    kw: dict[str, Any] = {"kind": args.prune, "removed": args.prune_removed}  # Pruning checks
    if args.prune_amount is not None:
        kw["amount"] = args.prune_amount
    if args.prune_modules:
        kw["modules"] = tuple(m.strip() for m in args.prune_modules.split(",") if m.strip())
    return Pruning(**kw)


def apply(
    args: argparse.Namespace, model: ModelSpec, job: Training | Inference
) -> tuple[ModelSpec, Training | Inference]:
    """The model after structured pruning and the job with its pruning/distillation fields."""
    model = pruned_spec(
        model,
        n_heads=args.keep_heads,
        n_kv_heads=args.keep_kv_heads,
        ffn=args.keep_ffn,
        n_layers=args.keep_layers,
    )
    distill_opts = (
        args.teacher_precision,
        args.distill_temperature,
        args.distill_hard_weight,
        None if args.teacher_quant is None else Quant(method=args.teacher_quant),
    )
    if args.teacher is None and any(v is not None for v in distill_opts):
        raise ValueError("--teacher-precision/--distill-* need --teacher")
    if not isinstance(job, Training):
        if args.teacher is not None:
            raise ValueError("task='infer' does not take --teacher")
        if args.prune is not None:
            pruning_of(args)  # validated; inference serves the dense weights (see storage)
        return model, job
    pruning = pruning_of(args)
    distill = None
    if args.teacher is not None:
        kw: dict[str, Any] = {"teacher": load_card(args.teacher)}  # Distill checks them
        for field, value in zip(
            ("teacher_precision", "temperature", "hard_weight", "teacher_quant"),
            distill_opts,
            strict=True,
        ):
            if value is not None:
                kw[field] = value
        distill = Distill(**kw)
    if pruning is None and distill is None:
        return model, job
    return model, dataclasses.replace(
        job,
        pruning=job.pruning if pruning is None else pruning,
        distill=job.distill if distill is None else distill,
    )


def storage(
    args: argparse.Namespace, model: ModelSpec, job: Training | Inference
) -> StorageVerdict | None:
    """How the pruned weights would be stored (None without ``--prune``)."""
    pruning = pruning_of(args)
    if pruning is None:
        return None
    if args.sparse_index not in INDEX_DTYPES:
        raise ValueError(f"sparse_index={args.sparse_index!r} is not one of {INDEX_DTYPES}")
    item = VALUE_ITEMSIZE.get(job.precision, 4)
    return storage_verdict(model, pruning, item, args.sparse_index)


def storage_lines(v: StorageVerdict, gib: int) -> list[str]:
    """The storage verdict as text (GiB = 2**30 bytes)."""
    lines = [
        f"pruned weights (density {float(v.density):.3f}): dense with zeros "
        f"{v.dense_bytes / gib:.2f} GiB"
    ]
    for fmt, nbytes in v.bytes_by_format.items():
        even = v.break_even_density.get(fmt)
        tail = f"; saves below density {float(even):.3f}" if even is not None else ""
        lines.append(f"  as {fmt}: {nbytes / gib:.2f} GiB{tail}")
    if v.best == "dense":
        lines.append("  -> keep them dense: no sparse format saves memory at this density")
    else:
        saved = v.dense_bytes - v.bytes_by_format[v.best]
        lines.append(f"  -> store as {v.best}: saves {saved / gib:.2f} GiB")
    lines.append(
        "  (storage only: the estimate above holds these weights dense; computing with "
        "sparse or 2:4 weights is not modelled)"
    )
    return lines


def storage_json(v: StorageVerdict) -> dict[str, object]:
    """The storage verdict as JSON-ready values (densities as floats)."""
    return {
        "dense_bytes": v.dense_bytes,
        "bytes_by_format": dict(v.bytes_by_format),
        "density": float(v.density),
        "break_even_density": {k: float(x) for k, x in v.break_even_density.items()},
        "best": v.best,
    }
