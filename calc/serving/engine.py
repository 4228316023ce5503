"""Which vLLM engine runs, and the defaults it picks, per version (read from vLLM's source).

Sources (vllm-project/vllm; the commit read is named where the rule was checked):

* V1 is the default engine from 0.8.0 (``VLLM_USE_V1`` defaults to 1); 0.11.0 removed V0.
  Between 0.8.0 and 0.9.x the V1 oracle falls back to V0 on GPUs of compute capability < 8.0
  (``vllm/engine/arg_utils.py`` ``EngineArgs._is_v1_supported_oracle``: ``_raise_or_fallback(
  feature_name="Compute Capability < 8.0")``); 0.10.2 serves a T4 on V1 (FlexAttention), as a
  published bring-up log shows, so 0.10.x has no such fallback.
* V1 batch defaults (``vllm/engine/arg_utils.py`` ``EngineArgs._set_default_args`` /
  ``get_batch_defaults``, 0.9.0 onwards): a GPU with ``get_device_total_memory() >= 70 GiB``
  whose name does not contain ``a100`` (PR #17885) gets ``max_num_batched_tokens`` 16384 for
  ``LLM`` and 8192 for ``vllm serve``, ``max_num_seqs`` 1024; any other GPU 8192 / 2048 and 256.
  ``max_num_seqs`` is then capped at ``max_num_batched_tokens``. In 0.8.x the large token
  budgets went to GPUs named H100 or H200 (``if "h100" in device_name or "h200" in
  device_name``) and ``max_num_seqs`` was 256 on every GPU (``_set_default_args_v1``).
* V0 (up to 0.10.x): ``SchedulerConfig`` defaults ``max_num_seqs = 256`` and, without chunked
  prefill, ``max_num_batched_tokens = max(max_model_len, 2048)`` (``vllm/config.py``
  ``SchedulerConfig.__post_init__``); ``vllm serve`` turns chunked prefill on for
  ``max_model_len > 32768`` (``EngineArgs.create_engine_config``, ``use_long_context``), with
  the 2048-token budget of the chunked path.
* CUDA graphs: V1 captures the sizes up to ``max_cudagraph_capture_size = min(2 *
  max_num_seqs, 512)`` (``vllm/config/compilation.py``, 0.11 onwards; 512 before). From 0.21.0
  vLLM profiles the graphs' memory before sizing the KV cache and subtracts it
  (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, "CUDA graph memory profiling is enabled
  (default since v0.21.0)" in ``vllm/v1/worker/gpu_worker.py``); before, the graphs are captured
  after the KV cache is allocated, from the memory ``gpu_memory_utilization`` leaves over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from calc.config.serving import Serving
from calc.units import GIB

EngineKind = Literal["v0", "v1"]

LARGE_GPU_BYTES = 70 * GIB
"""``device_memory >= 70 * GiB_bytes``: the threshold of vLLM's larger batch defaults."""
V0_MAX_NUM_SEQS = 256
"""``SchedulerConfig.max_num_seqs`` default of the V0 engine."""
V0_MIN_BATCHED_TOKENS = 2048
"""V0 without chunked prefill: ``max_num_batched_tokens = max(max_model_len, 2048)``."""
V0_LONG_CONTEXT = 32768
"""V0 ``vllm serve`` enables chunked prefill above this ``max_model_len``."""
MAX_CAPTURE_SIZE = 512
"""Largest CUDA-graph batch vLLM captures by default."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    """The settings vLLM runs with once its defaults are filled in."""

    engine: EngineKind
    """``v0`` (``vllm/worker``) or ``v1`` (``vllm/v1``)."""
    max_model_len: int
    """Longest request, in tokens."""
    max_num_seqs: int
    """Requests per scheduler step (the profiling run's dummy requests)."""
    max_num_batched_tokens: int
    """Tokens per step: the profiling forward's size."""
    cudagraph_capture_size: int
    """Largest batch (tokens) a CUDA graph is captured for; 0 with ``enforce_eager``."""
    cudagraphs_in_budget: bool
    """Whether the CUDA graphs' memory is subtracted before the KV cache is sized (>= 0.21)."""


def engine_kind(serving: Serving, compute_capability: float | None) -> EngineKind:
    """V0 before 0.8.0; V1 from 0.8.0, except on compute capability < 8.0 up to 0.9.x."""
    version = serving.version
    if version < (0, 8, 0):
        return "v0"
    if version < (0, 10, 0) and compute_capability is not None and compute_capability < 8.0:
        return "v0"
    return "v1"


def _v1_batch_defaults(
    serving: Serving, device_memory_bytes: int, device_name: str
) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) defaults of the V1 engine for this GPU."""
    name = device_name.lower()
    llm = serving.entrypoint == "llm"
    if serving.version < (0, 9, 0):  # 0.8.x: H100/H200 by name; max_num_seqs 256 everywhere
        large = "h100" in name or "h200" in name
        return (16384 if llm else 8192) if large else (8192 if llm else 2048), 256
    if device_memory_bytes >= LARGE_GPU_BYTES and "a100" not in name:
        return (16384 if llm else 8192), 1024
    return (8192 if llm else 2048), 256


def resolve(
    serving: Serving,
    model_max_len: int,
    device_memory_bytes: int,
    device_name: str = "",
    compute_capability: float | None = None,
) -> EngineSettings:
    """Fill ``serving``'s ``None`` fields with the defaults of its vLLM version on this GPU
    (``device_memory_bytes``: the driver's total, as ``get_device_total_memory`` reads it)."""
    engine = engine_kind(serving, compute_capability)
    max_model_len = serving.max_model_len or model_max_len
    if engine == "v1":
        batched, seqs = _v1_batch_defaults(serving, device_memory_bytes, device_name)
        if serving.max_num_batched_tokens is not None:
            batched = serving.max_num_batched_tokens
        if serving.max_num_seqs is not None:
            seqs = serving.max_num_seqs
        else:
            seqs = min(seqs, batched)
    else:
        seqs = serving.max_num_seqs or V0_MAX_NUM_SEQS
        chunked = serving.entrypoint == "serve" and max_model_len > V0_LONG_CONTEXT
        default = V0_MIN_BATCHED_TOKENS if chunked else max(max_model_len, V0_MIN_BATCHED_TOKENS)
        batched = serving.max_num_batched_tokens or default
    capture = 0
    if not serving.enforce_eager:
        cap = MAX_CAPTURE_SIZE
        if engine == "v1" and serving.version >= (0, 11, 0):
            cap = min(2 * seqs, MAX_CAPTURE_SIZE)
        capture = min(cap, batched) if engine == "v1" else min(cap, seqs)
    return EngineSettings(
        engine=engine,
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        cudagraph_capture_size=capture,
        cudagraphs_in_budget=engine == "v1" and serving.version >= (0, 21, 0) and capture > 0,
    )
