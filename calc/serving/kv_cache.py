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

Other architectures (`calc.serving.arch`; ``vllm/v1/kv_cache_interface.py`` and
``vllm/v1/core/kv_cache_utils.py``, read at commits bbf906a8 and 001cabc1):

* MLA (``MLAAttentionSpec.real_page_size_bytes``): ``block_size * num_kv_heads * head_size *
  dtype_size`` with one "head" of ``kv_lora_rank + qk_rope_head_dim``: no factor 2, the same on
  every tensor-parallel rank (each rank caches the whole latent). V0 likewise
  (``CacheEngine.get_cache_block_size``: the value entry is 0 with ``use_mla``).
* Full and sliding-window layers in one model (Gemma-2/3), V1 from ``HYBRID_FROM``
  (``get_kv_cache_groups`` -> ``_get_kv_cache_groups_uniform_page_size``, named
  ``_get_kv_cache_config_uniform_page_size`` at bbf906a8): the layers are grouped by spec; the
  group size is the smallest count of layers of one spec (001cabc1: the largest when it is below
  1.5 times the smallest); each spec's layers are split into ``cdiv(count, group_size)`` groups
  (``layers[i::num_groups]``). A worker has ``group_size`` tensors (its largest group), so
  ``num_blocks = available // page_size // group_size`` (``get_kv_cache_config_from_groups``);
  the log prints ``num_blocks // len(groups) * block_size`` tokens (``_report_kv_cache_config``)
  and the concurrency is ``num_blocks / sum over groups of blocks per request`` (each group's
  ``max_memory_usage_bytes`` / page). Before ``HYBRID_FROM``, on V0, and with
  ``--disable-hybrid-kv-cache-manager``, every layer of such a model is full attention
  (``unify_hybrid_kv_cache_specs``). Layers of different page sizes are not modelled.
* Sliding window on every layer (Mistral's rule): one group, the sliding request size.
"""

from __future__ import annotations

from dataclasses import dataclass

from calc.config.model_spec import ModelSpec
from calc.config.serving import DEFAULT_BLOCK_SIZE, Serving
from calc.serving.arch import LayerKV, ServingArch
from calc.serving.weights import DTYPE_BYTES, kv_heads_per_rank

HYBRID_FROM = (0, 10, 0)
"""First release whose V1 engine keeps sliding-window layers of a hybrid model in their own KV
cache groups (the hybrid KV cache manager, PR #16101 split into the PRs of mid-2025; vLLM's
design doc describes it as of v0.10.1, PR #54738): an estimated boundary."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers (vLLM's ``cdiv``)."""
    return -(-a // b)


def block_of(serving: Serving, block_size: int | None = None) -> int:
    """The block size to use: ``block_size`` (the one `calc.serving.engine.block_size`
    resolved), else ``serving.block_size``, else vLLM's default 16."""
    if block_size is not None:
        return block_size
    return DEFAULT_BLOCK_SIZE if serving.block_size is None else serving.block_size


def kv_dtype_bytes(serving: Serving) -> int:
    """Bytes per cached element: one for ``fp8*``, else ``dtype``'s."""
    if serving.kv_cache_dtype.startswith("fp8"):
        return 1
    return DTYPE_BYTES[serving.dtype]


def page_bytes(model: ModelSpec, serving: Serving, block_size: int | None = None) -> int:
    """One layer's KV block on one rank: ``2 * block_size * kv_heads * head_size * bytes``."""
    heads = kv_heads_per_rank(model, serving.tensor_parallel)
    return 2 * block_of(serving, block_size) * heads * model.head_dim * kv_dtype_bytes(serving)


def num_blocks(available_bytes: int, page: int, n_layers: int) -> int:
    """``int(available_memory // page_size // num_layers)``, never negative (V1 and V0 alike:
    V0's block holds every layer, ``available // (page * n_layers)``, the same integer)."""
    if available_bytes <= 0:
        return 0
    return available_bytes // page // n_layers


def blocks_per_request(
    model: ModelSpec, serving: Serving, max_model_len: int, max_num_batched_tokens: int,
    block_size: int | None = None,
) -> int:  # fmt: skip
    """Blocks one layer needs for a request of ``max_model_len`` tokens (V1)."""
    block = block_of(serving, block_size)
    if model.sliding_window is not None:
        window = min(model.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(window, block) + 1
    return cdiv(max_model_len, block)


def max_concurrency(
    blocks: int, model: ModelSpec, serving: Serving, engine: str, max_model_len: int,
    max_num_batched_tokens: int, block_size: int | None = None,
) -> float:  # fmt: skip
    """The ``"Maximum concurrency for L tokens per request"`` vLLM logs."""
    if engine == "v0":
        return blocks * block_of(serving, block_size) / max_model_len
    per_request = blocks_per_request(
        model, serving, max_model_len, max_num_batched_tokens, block_size
    )
    return blocks / per_request


@dataclass(frozen=True, kw_only=True, slots=True)
class KVLayout:
    """How one rank's KV cache is laid out (``KVCacheConfig``)."""

    page_bytes: int
    """One layer's block (the same for every layer)."""
    group_size: int
    """Layers sharing one block id on this rank: the tensors of ``page_bytes * num_blocks``."""
    n_groups: int
    """KV cache groups of the whole model (1 unless hybrid)."""
    blocks_per_request: int
    """Blocks one ``max_model_len`` request needs (V1), summed over the groups."""


def layer_page_bytes(
    arch: ServingArch, kind: LayerKV, serving: Serving, block_size: int | None = None
) -> int:
    """One layer's KV block on one rank: ``2 * block_size * kv_heads * head_dim * bytes``, or
    MLA's ``block_size * (kv_lora_rank + qk_rope_head_dim) * bytes``."""
    block = block_of(serving, block_size)
    if kind.kind == "mla":
        assert arch.mla is not None
        width = arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim
        return block * width * kv_dtype_bytes(serving)
    heads = kv_heads_per_rank(arch, serving.tensor_parallel)
    return 2 * block * heads * arch.head_dim * kv_dtype_bytes(serving)


def _request_blocks(kind: LayerKV, block_size: int, max_model_len: int, batched: int) -> int:
    if kind.kind == "sliding":
        assert kind.window is not None
        window = min(kind.window - 1 + batched, max_model_len)
        return cdiv(window, block_size) + 1
    return cdiv(max_model_len, block_size)


def kv_groups(arch: ServingArch, hybrid: bool) -> list[tuple[LayerKV, list[int]]]:
    """The KV cache groups of the whole model: (spec, layer indices); with ``hybrid`` False a
    mixed full/sliding model is all full attention."""
    specs = list(arch.layers)
    kinds = {s.kind for s in specs}
    if not hybrid and "full" in kinds and "sliding" in kinds:
        specs = [LayerKV("full") for _ in specs]
    by_spec: dict[LayerKV, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    if len(by_spec) == 1:
        ((spec, layers),) = by_spec.items()
        return [(spec, layers)]
    counts = [len(v) for v in by_spec.values()]
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    groups: list[tuple[LayerKV, list[int]]] = []
    for spec, layers in by_spec.items():
        n = cdiv(len(layers), size)
        groups += [(spec, layers[i::n]) for i in range(n)]
    return groups


def kv_layout(
    arch: ServingArch, serving: Serving, engine: str, stage_layers: range,
    max_model_len: int, max_num_batched_tokens: int, block_size: int | None = None,
) -> KVLayout:  # fmt: skip
    """The layout on the rank holding ``stage_layers`` (see the module docstring), with blocks
    of ``block_size`` tokens (default: `block_of`)."""
    hybrid = engine == "v1" and serving.version >= HYBRID_FROM
    groups = kv_groups(arch, hybrid)
    block = block_of(serving, block_size)
    pages = {layer_page_bytes(arch, spec, serving, block) for spec, _ in groups}
    if len(pages) > 1:
        raise ValueError(f"{arch.name}: layers with different KV page sizes are not modelled")
    on_stage = set(stage_layers)
    size = max(sum(1 for i in layers if i in on_stage) for _, layers in groups)
    per_request = sum(
        _request_blocks(spec, block, max_model_len, max_num_batched_tokens) for spec, _ in groups
    )
    return KVLayout(
        page_bytes=pages.pop(),
        group_size=size,
        n_groups=len(groups),
        blocks_per_request=per_request,
    )
