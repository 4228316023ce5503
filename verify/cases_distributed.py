"""Distributed verification cases of data parallelism and sharding (DDP, ZeRO, FSDP2).

Each case names its engine (`verify.dist_engines`) and the `calc.Parallelism` calc predicts.
Tolerance 1 % (the reference implementation's bar); the ``quick`` ones run on 2 processes.
"""

from __future__ import annotations

from typing import Any

from calc.jobs import Training
from calc.parallel import Parallelism
from verify.distributed import DistCase

LLAMA = "llama-2-7b"
SMALL = {"layers": 2}


def _case(
    name: str,
    engine: str,
    parallel: Parallelism,
    *,
    card: str = LLAMA,
    scale: dict[str, Any] | None = None,
    tags: tuple[str, ...] = (),
    note: str = "",
    tolerance_pct: float = 1.0,
    **job: Any,
) -> DistCase:
    job.setdefault("micro_batch", 2)
    job.setdefault("seq_len", 32)
    job.setdefault("precision", "fp32")
    job.setdefault("optimizer", "adamw")
    job.setdefault("optimizer_impl", "foreach")
    job.setdefault("implementation", "reference")
    return DistCase(
        name=name,
        card=card,
        scale=tuple(sorted((scale or SMALL).items())),
        job=Training(**job),
        parallel=parallel,
        engine=engine,
        tags=tags,
        note=note,
        tolerance_pct=tolerance_pct,
    )


Q = ("quick",)

CASES: tuple[DistCase, ...] = (
    _case("dist-replicas-2", "replicas", Parallelism(dp=2), tags=Q,
          note="control: two independent single-GPU runs (no wrapper)"),
    _case("dist-ddp-2", "ddp", Parallelism(dp=2), tags=Q),
    _case("dist-zero1-2", "zero1", Parallelism(dp=2, zero=1)),
    _case("dist-fsdp2-2", "fsdp2", Parallelism(dp=2, fsdp=True)),
)  # fmt: skip
