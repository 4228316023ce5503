"""vLLM's KV cache: page size per layer, blocks, tokens and the maximum concurrency it logs.

V1 (``vllm/v1/core/kv_cache_utils.py``, read at commit bbf906a8, a 0.9/0.10 version):

* every attention layer has a spec whose ``page_size_bytes`` is ``2 * block_size *
  num_kv_heads * head_size * dtype_size`` (``vllm/v1/kv_cache_interface.py``
  ``AttentionSpec.page_size_bytes``; ``num_kv_heads`` per rank);
* one cache type: ``get_num_blocks``: ``num_blocks = int(available_memory // page_size //
  num_layers)``; the log ``"GPU KV cache size: %s tokens"`` prints ``num_blocks *
  block_size`` (``_get_kv_cache_config_uniform_type``);
* ``get_max_concurrency_for_kv_cache_config``: ``num_blocks / cdiv(max_memory_usage_per_request,
  memory_per_block)``; for full attention a request needs ``cdiv(max_model_len, block_size)``
  blocks per layer (``FullAttentionSpec.max_memory_usage_bytes``), for sliding-window layers
  ``cdiv(min(sliding_window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1``
  (``SlidingWindowSpec.max_memory_usage_bytes``), logged as ``"Maximum concurrency for %s
  tokens per request: %.2fx"``;
* the workers' configurations are unified to the smallest ``num_blocks`` over all ranks
  (``unify_kv_cache_configs``).

V0 (``vllm/worker/worker.py`` ``determine_num_available_blocks`` and ``cache_engine.py``
``CacheEngine.get_cache_block_size``): ``num_gpu_blocks = int(available_kv_cache_memory //
cache_block_size)`` with ``cache_block_size = block_size * num_layers * 2 * num_kv_heads *
head_size * dtype_size``; the concurrency it logs is ``num_gpu_blocks * block_size /
max_model_len`` (``vllm/executor/executor_base.py``).
"""

from __future__ import annotations

from calc.config.model_spec import ModelSpec
from calc.config.serving import Serving
from calc.serving.weights import DTYPE_BYTES, kv_heads_per_rank


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers (vLLM's ``cdiv``)."""
    return -(-a // b)


def kv_dtype_bytes(serving: Serving) -> int:
    """Bytes per cached element: one for ``fp8*``, else ``dtype``'s."""
    if serving.kv_cache_dtype.startswith("fp8"):
        return 1
    return DTYPE_BYTES[serving.dtype]


def page_bytes(model: ModelSpec, serving: Serving) -> int:
    """One layer's KV block on one rank: ``2 * block_size * kv_heads * head_size * bytes``."""
    heads = kv_heads_per_rank(model, serving.tensor_parallel)
    return 2 * serving.block_size * heads * model.head_dim * kv_dtype_bytes(serving)


def num_blocks(available_bytes: int, page: int, n_layers: int) -> int:
    """``int(available_memory // page_size // num_layers)``, never negative (V1 and V0 alike:
    V0's block holds every layer, ``available // (page * n_layers)``, the same integer)."""
    if available_bytes <= 0:
        return 0
    return available_bytes // page // n_layers


def blocks_per_request(
    model: ModelSpec, serving: Serving, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Blocks one layer needs for a request of ``max_model_len`` tokens (V1)."""
    tokens = max_model_len
    if model.sliding_window is not None:
        window = min(model.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(window, serving.block_size) + 1
    return cdiv(tokens, serving.block_size)


def max_concurrency(
    blocks: int, model: ModelSpec, serving: Serving, engine: str, max_model_len: int,
    max_num_batched_tokens: int,
) -> float:  # fmt: skip
    """The ``"Maximum concurrency for L tokens per request"`` vLLM logs."""
    if engine == "v0":
        return blocks * serving.block_size / max_model_len
    return blocks / blocks_per_request(model, serving, max_model_len, max_num_batched_tokens)
