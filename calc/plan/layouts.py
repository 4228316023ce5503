"""The planner's parallel layouts: how ``gpu_count`` GPUs share one training job.

A layout is a ``calc.Parallelism`` named by a short label (``dp4-zero2``, ``dp2-fsdp-tp2``),
the value of the planner's ``parallel`` axis (``calc.plan.axes``). For ``n`` GPUs the planner
enumerates, for each tensor-parallel degree ``tp`` dividing ``n`` (at most ``MAX_TP``, one
node's NVLink domain) with ``dp = n / tp``:

* ``dp > 1``: DDP (``zero0``), ZeRO-1, ZeRO-2, ZeRO-3, FSDP2 (``fsdp``), FSDP2 with the
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` that FSDP2 recipes (torchtitan's
  among them) put over an fp32 model (``fsdp-mp``: bf16 gathers, fp32 shards, gradients and
  states) and ZeRO-3 with the optimizer on the CPU (``zero3-offload``, ZeRO-Offload, Ren et
  al. 2021);
* ``dp > NODE_GPUS`` a multiple of it, without tp: HSDP (``hsdp8``, ``hsdp8-mp``), FSDP2 over a
  2-D mesh that shards within a node of `NODE_GPUS` and replicates across ``dp / 8`` nodes
  (torchtitan's ``data_parallel_shard_degree`` with ``data_parallel_replicate_degree``): each
  GPU holds an eighth of the model whatever the node count, its gradients all-reduced across
  the replicas;
* ``dp == 1``: tensor parallelism alone.

Pipeline parallelism is not enumerated: ``calc.step.pipeline`` models it for ``grad_accum == 1``
without recomputation only, so most of the grid would be "not modelled"; ``fixed`` cannot add
it either. Context and sequence parallelism are left at their defaults (off).

Each layout's peak is ``calc.estimate(model, job, parallel).peak_bytes`` (``calc.estimate.ranks``: one
compiled replay per class of ranks, the most-loaded rank's peak). The planner evaluates it from
the same replays as persisted tables (``calc.plan.grid``, one per class of ranks and structure,
``calc.estimate.ranks.rank_replays``), every micro-batch of a (layout, structure) in one vectorised call
per class (``calc.plan.engine.Evaluator``); tests/calc/plan/test_parallel.py checks each row against
``calc.estimate``. ZeRO-3 and FSDP2 rows share their tables (both replay FSDP2's sharding).
"""

from __future__ import annotations

from functools import lru_cache

from calc.config.parallelism import Parallelism

SINGLE = "single"
"""The layout of one GPU (no parallelism)."""
MAX_TP = 8
"""Largest tensor-parallel degree enumerated: one node of 8 GPUs (tp all-reduces every layer;
Narayanan et al. 2021 §3.3 keep tp within a node)."""
NODE_GPUS = 8
"""GPUs an HSDP layout shards over: one node (replicas across nodes)."""
_SHARDINGS: tuple[tuple[str, dict], ...] = (
    ("zero0", {"zero": 0}),
    ("zero1", {"zero": 1}),
    ("zero2", {"zero": 2}),
    ("zero3", {"zero": 3}),
    ("fsdp", {"fsdp": True}),
    ("fsdp-mp", {"fsdp": True, "fsdp_param_dtype": "bf16", "fsdp_reduce_dtype": "fp32"}),
    ("zero3-offload", {"zero": 3, "offload": "optimizer"}),
)

_HSDP: tuple[tuple[str, dict], ...] = (
    ("", {"fsdp": True}),
    ("-mp", {"fsdp": True, "fsdp_param_dtype": "bf16", "fsdp_reduce_dtype": "fp32"}),
)
"""HSDP's variants: FSDP2 alone and with the recipes' mixed-precision policy."""


@lru_cache(maxsize=64)
def layouts(gpu_count: int) -> dict[str, Parallelism]:
    """Every layout the planner enumerates on ``gpu_count`` GPUs, by label, in table order."""
    if gpu_count == 1:
        return {SINGLE: Parallelism()}
    out: dict[str, Parallelism] = {}
    for tp in (t for t in range(1, min(gpu_count, MAX_TP) + 1) if gpu_count % t == 0):
        dp = gpu_count // tp
        suffix = f"-tp{tp}" if tp > 1 else ""
        if dp == 1:
            out[f"tp{tp}"] = Parallelism(tp=tp)
            continue
        for name, kw in _SHARDINGS:
            out[f"dp{dp}-{name}{suffix}"] = Parallelism(dp=dp, tp=tp, **kw)
        if tp == 1 and dp > NODE_GPUS and dp % NODE_GPUS == 0:
            for name, kw in _HSDP:
                hsdp = Parallelism(dp=dp, dp_replicate=dp // NODE_GPUS, **kw)
                out[f"dp{dp}-hsdp{NODE_GPUS}{name}"] = hsdp
    return out


def layout_of(label: object, gpu_count: int) -> Parallelism:
    """The ``Parallelism`` of a label (``ValueError`` naming the allowed labels)."""
    table = layouts(gpu_count)
    if not isinstance(label, str) or label not in table:
        raise ValueError(
            f"parallel={label!r} is not a layout of {gpu_count} GPUs; allowed: {', '.join(table)}"
        )
    return table[label]


def default_layout(gpu_count: int) -> str:
    """The layout a job without one runs under: DDP over every GPU (or one GPU)."""
    return SINGLE if gpu_count == 1 else f"dp{gpu_count}-zero0"
