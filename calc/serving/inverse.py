"""The serving questions asked backwards: the longest context or the most requests that fit, the
``gpu_memory_utilization`` to set, the fewest tensor-parallel GPUs.

Each answer is `calc.serve` evaluated at candidate settings (its terms do not depend on
``gpu_memory_utilization``, and in V1 the KV budget does not depend on ``max_model_len``), so
the answers inherit its sources and estimates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from calc.config.model_spec import ModelSpec
from calc.config.serving import Serving
from calc.serving.api import ServeEstimate, resolve_model, serve

Model = ModelSpec | Mapping[str, object]
"""A `calc.ModelSpec` or a config.json dict (see `calc.serve`)."""


def _serve(
    model: Model, serving: Serving, total_bytes: int | None, gpu: str | None
) -> ServeEstimate:
    return serve(model, serving, total_bytes=total_bytes, gpu=gpu)


def largest_max_model_len(
    model: Model, serving: Serving, concurrency: float = 1.0,
    total_bytes: int | None = None, gpu: str | None = None,
) -> int:  # fmt: skip
    """The largest ``max_model_len`` at which vLLM reports a maximum concurrency of at least
    ``concurrency`` (0 if none, capped at the model's ``max_positions``): a binary search over
    `calc.serve`, whose concurrency never grows with ``max_model_len``."""
    if not concurrency > 0:
        raise ValueError(f"concurrency={concurrency!r} must be a positive number")

    def fits(length: int) -> bool:
        est = _serve(model, replace(serving, max_model_len=length), total_bytes, gpu)
        return est.max_concurrency >= concurrency

    low, high = 0, resolve_model(model)[1].max_positions
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def utilization_for(
    model: Model, serving: Serving, concurrency: float,
    total_bytes: int | None = None, gpu: str | None = None,
) -> float | None:  # fmt: skip
    """The least ``gpu_memory_utilization`` (rounded up to 0.001) at which ``concurrency``
    requests of ``serving.max_model_len`` tokens fit; ``None`` if more than the whole GPU is
    needed. Blocks needed: ``ceil(concurrency x blocks per request)``, each ``page x layers``
    bytes (`calc.serving.kv_cache`)."""
    if not concurrency > 0:
        raise ValueError(f"concurrency={concurrency!r} must be a positive number")
    est = _serve(model, replace(serving, gpu_memory_utilization=1.0), total_bytes, gpu)
    per_request = est.gpu_blocks / est.max_concurrency if est.max_concurrency else None
    if per_request is None:  # no block at all even at 1.0: the non-KV terms alone overflow
        return None
    blocks = math.ceil(concurrency * round(per_request))
    needed = est.budget_bytes - est.kv_cache_bytes + blocks * est.block_bytes
    util = math.ceil(needed / est.total_bytes * 1000) / 1000
    return util if util <= 1.0 else None


def fewest_tensor_parallel(
    model: Model, serving: Serving, concurrency: float,
    total_bytes: int | None = None, gpu: str | None = None, limit: int = 64,
) -> int | None:  # fmt: skip
    """The smallest tensor-parallel size (a divisor of the attention heads, up to ``limit``)
    at which ``concurrency`` requests of ``serving.max_model_len`` tokens fit; ``None`` if
    none does."""
    arch = resolve_model(model)[1]
    for tp in range(1, limit + 1):
        if arch.n_heads % tp or (tp < arch.n_kv_heads and arch.n_kv_heads % tp):
            continue
        if tp >= arch.n_kv_heads and tp % arch.n_kv_heads:
            continue
        try:
            est = _serve(model, replace(serving, tensor_parallel=tp), total_bytes, gpu)
        except ValueError:  # tp does not divide another dimension (ffn, ...)
            continue
        if est.max_concurrency >= concurrency:
            return tp
    return None
