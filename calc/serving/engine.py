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
* KV block size (`block_size`): 16 unless ``--block-size`` is given (``vllm/platforms/cuda.py``
  ``check_and_update_config``); for MLA models (``model_config.use_mla``: DeepSeek-V2/V3) the
  attention backend forces its own, by version and compute capability:

  - before 0.8.0: none (Triton MLA takes any size; FlashMLA was released by DeepSeek on
    2025-02-24, after 0.7.3, and integrated in vLLM PR #13747 for 0.8.0);
  - 0.8.0 to 0.16.x, ``check_and_update_config`` (``use_mla``, no ``VLLM_ATTENTION_BACKEND``):
    Hopper (capability 9.x, ``is_flashmla_supported``) -> FlashMLA, block 64, any other size
    replaced (0.8-0.10: ``block_size != 64``; from `MULTIPLE_OF_64_FROM`, an estimated
    boundary, ``block_size % 64 != 0``, so 128 and 256 stay); Blackwell (capability 10.0,
    ``is_device_capability(100)``) from `CUTLASS_MLA_FROM` (PR #21626, July 2025) ->
    CUTLASS MLA, block 128 (``% 128`` from `MULTIPLE_OF_64_FROM`); from `FLASHINFER_MLA_FROM`
    (PR #32615, an estimated boundary) FlashInfer MLA on Blackwell, 64 unless 32 or a
    multiple of 64;
  - from `BACKEND_BLOCK_FROM` (PR #35122, "Refactor ``check_and_update_config``", merged
    2026-02; an estimated boundary): the block size follows the selected backend
    (``Platform.update_block_size_for_backend`` -> ``AttentionBackend.get_preferred_block_
    size(16)``: 16 if the backend supports it, else its smallest kernel block size) and a
    user's ``--block-size`` is kept (the selector picks a backend that supports it). Hopper
    prefers FlashAttention MLA (``_get_backend_priorities``, PR #27363), whose kernel block
    sizes are ``MultipleOf(16)``: 16; Blackwell prefers FlashInfer MLA (``[32, 64]``): 32.
  - other GPUs (Ampere, Ada: Triton MLA) keep 16. An unknown GPU (``total_bytes=``) keeps 16,
    with a note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from calc.config.serving import DEFAULT_BLOCK_SIZE, Serving
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
FLASHMLA_FROM = (0, 8, 0)
"""First release with FlashMLA and its forced block size of 64 on Hopper."""
CUTLASS_MLA_FROM = (0, 10, 1)
"""First release defaulting MLA to CUTLASS MLA (block 128) on Blackwell (PR #21626, merged
after 0.10.0 was cut)."""
MULTIPLE_OF_64_FROM = (0, 11, 0)
"""First release keeping a user's multiple of 64 (of 128 for CUTLASS MLA) instead of forcing
exactly 64 (``block_size % 64 != 0``): an estimated boundary."""
FLASHINFER_MLA_FROM = (0, 15, 0)
"""First release defaulting MLA to FlashInfer MLA on Blackwell (PR #32615, January 2026): an
estimated boundary."""
BACKEND_BLOCK_FROM = (0, 17, 0)
"""First release whose block size follows the selected attention backend (PR #35122): an
estimated boundary."""


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
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV-cache block vLLM runs with (`block_size`)."""
    block_size_note: str | None = None
    """Why ``block_size`` differs from ``--block-size`` or 16, when it does (or is unknown)."""


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


def _forced(size: int | None, kernel: int, multiple: bool) -> int:
    """``check_and_update_config``'s rule: ``size`` kept if it fits ``kernel`` (a multiple of
    it when ``multiple``, else equal), else ``kernel``."""
    if size is not None and (size % kernel == 0 if multiple else size == kernel):
        return size
    return kernel


def block_size(
    serving: Serving, mla: bool, compute_capability: float | None
) -> tuple[int, str | None]:
    """(the KV block size vLLM runs with, a note when it is not ``--block-size`` or 16) for a
    model that uses MLA or not, on a GPU of ``compute_capability`` (module docstring)."""
    user = serving.block_size
    size = DEFAULT_BLOCK_SIZE if user is None else user
    version = serving.version
    if not mla or version < FLASHMLA_FROM:
        return size, None
    if compute_capability is None:
        return size, (
            f"KV block size {size}: the GPU is not named (total_bytes=), so vLLM's MLA "
            "backend choice is unknown; on Hopper it is 64 from 0.8.0 to 0.16.x (FlashMLA): "
            "pass gpu= or block_size="
        )
    major = int(compute_capability)
    if version >= BACKEND_BLOCK_FROM:
        if user is not None:
            return size, None
        if major == 10:
            return 32, (
                "KV block size 32: FlashInfer MLA's smallest kernel block size (vLLM picks the "
                "block size of the selected MLA backend, update_block_size_for_backend)"
            )
        return size, None
    multiple = version >= MULTIPLE_OF_64_FROM
    if major == 9:
        forced, backend = _forced(user, 64, multiple), "FlashMLA"
    elif major == 10 and version >= FLASHINFER_MLA_FROM:
        forced = user if user == 32 else _forced(user, 64, True)
        backend = "FlashInfer MLA"
    elif compute_capability == 10.0 and version >= CUTLASS_MLA_FROM:
        forced, backend = _forced(user, 128, multiple), "CUTLASS MLA"
    else:
        return size, None
    if forced == size:
        return size, None
    was = "the default 16" if user is None else f"block_size={user}"
    return forced, (
        f"KV block size {forced}: vLLM {serving.vllm_version} forces it for the {backend} "
        f"backend of MLA models on this GPU instead of {was} (vllm/platforms/cuda.py "
        "check_and_update_config)"
    )


def resolve(
    serving: Serving,
    model_max_len: int,
    device_memory_bytes: int,
    device_name: str = "",
    compute_capability: float | None = None,
    mla: bool = False,
) -> EngineSettings:
    """Fill ``serving``'s ``None`` fields with the defaults of its vLLM version on this GPU
    (``device_memory_bytes``: the driver's total, as ``get_device_total_memory`` reads it;
    ``mla``: the model uses MLA, which decides the block size with the GPU)."""
    engine = engine_kind(serving, compute_capability)
    block, block_note = block_size(serving, mla, compute_capability)
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
        block_size=block,
        block_size_note=block_note,
    )
