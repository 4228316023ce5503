"""``calc.serve``: the terms a vLLM server logs at start-up, predicted per GPU.

The accounting (``calc.serving.profile`` cites vLLM's source for each step):

``kv_cache_bytes = total * gpu_memory_utilization - weights - non_torch - activation_peak
[- cuda_graphs, from 0.21]``; ``gpu_blocks = kv_cache_bytes // page_bytes // layers``, the
smallest over all ranks; ``kv_cache_tokens = gpu_blocks * block_size``; ``max_concurrency`` as
vLLM's ``get_max_concurrency_for_kv_cache_config``. Hybrid models (full and sliding layers) and
MLA follow ``calc.serving.kv_cache``'s groups and pages.

``serve`` takes a `calc.ModelSpec` or a Hugging Face ``config.json`` dict: the five ModelSpec
types are replayed as before, the other families of `calc.serving.arch` (Mixtral, Qwen2/3-MoE,
DeepSeek-V2/V3, Gemma-2/3, Phi-3/4, OLMo-2, Granite) use the analytic forward term of
``calc.serving.profile``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from calc.config.model_spec import MODEL_TYPES, ModelSpec
from calc.config.multimodal import language_model_config, multimodal_note
from calc.config.serving import Serving
from calc.data.gpus import GPU, get_gpu
from calc.serving import engine as eng
from calc.serving import kv_cache as kv
from calc.serving import profile as prof
from calc.serving.arch import ServingArch
from calc.serving.checkpoint import weight_format
from calc.serving.weights import stage_layer_indices, stage_layers, stage_weight_bytes
from calc.units import GIB


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeEstimate:
    """What one vLLM instance holds per GPU after start-up (the most constrained rank)."""

    total_bytes: int
    """The driver's total (``cudaMemGetInfo``) vLLM sizes from."""
    budget_bytes: int
    """``total_bytes * gpu_memory_utilization``: what vLLM may use."""
    weights_bytes: int
    """Weights of the most constrained rank ("Model loading took ... GiB")."""
    non_torch_bytes: int
    """Memory outside PyTorch added by the profiling run (estimated)."""
    activation_peak_bytes: int
    """Peak of the profiling run's activations ("torch peak memory increase")."""
    cuda_graph_bytes: int
    """CUDA graphs' memory (estimated; inside the budget from 0.21, after the KV cache before)."""
    kv_cache_bytes: int
    """"Available KV cache memory": the budget left for KV blocks (may be negative)."""
    gpu_blocks: int
    """KV-cache blocks (each ``block_size`` tokens of every layer of the rank)."""
    kv_cache_tokens: int
    """"GPU KV cache size: N tokens"."""
    max_concurrency: float
    """"Maximum concurrency for max_model_len tokens per request: Xx"."""
    engine: str
    """``v0`` or ``v1``: the engine this version runs on this GPU."""
    max_model_len: int
    """Resolved ``max_model_len``."""
    max_num_seqs: int
    """Resolved ``max_num_seqs``."""
    max_num_batched_tokens: int
    """Resolved ``max_num_batched_tokens``: the profiling forward's tokens."""
    page_bytes: int
    """One layer's KV block on one rank."""
    layers_per_rank: int
    """Decoder layers on the most constrained rank."""
    block_size: int = 16
    """Tokens per KV-cache block vLLM runs with (``--block-size`` or what vLLM picks)."""
    kv_cache_groups: int = 1
    """KV cache groups (1; hybrid full/sliding models: one per ``group_size`` layers of a spec)."""
    block_bytes: int = 0
    """Memory of one block id on this rank: ``page_bytes`` x the layers sharing it."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What was assumed or estimated."""

    @property
    def fits(self) -> bool:
        """Whether vLLM starts: the KV cache holds at least one ``max_model_len`` request."""
        return self.max_concurrency >= 1

    def breakdown(self) -> dict[str, int]:
        """The budget's terms, in bytes (``kv_cache`` clipped at 0; graphs only when counted)."""
        parts = {
            "weights": self.weights_bytes,
            "non_torch": self.non_torch_bytes,
            "activation_peak": self.activation_peak_bytes,
            "kv_cache": max(self.kv_cache_bytes, 0),
        }
        used = sum(parts.values())
        parts["cuda_graphs"] = self.cuda_graph_bytes
        parts["free"] = max(self.total_bytes - used - self.cuda_graph_bytes, 0)
        return parts


def _compute_capability(gpu: GPU | None) -> float | None:
    value = getattr(gpu, "compute_capability", None) if gpu is not None else None
    if value is None:
        return None
    if isinstance(value, tuple | list):
        return float(f"{value[0]}.{value[1]}")
    try:
        return float(str(value))
    except ValueError:
        return None


def _total(total_bytes: int | None, gpu: str | None) -> tuple[int, GPU | None]:
    if (total_bytes is None) == (gpu is None):
        raise ValueError("give exactly one of total_bytes= and gpu=")
    if gpu is not None:
        card = get_gpu(gpu)
        cuda_total = card.cuda_total_bytes
        if cuda_total is None:
            raise ValueError(
                f"gpu={gpu!r}: the catalog has no published cudaMemGetInfo total for "
                f"{card.name}; pass the total vLLM logs instead (total_bytes=, --total-gib)"
            )
        return cuda_total, card
    if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes <= 0:
        raise ValueError(f"total_bytes={total_bytes!r} must be a positive integer (bytes)")
    return total_bytes, None


def resolve_model(model: object) -> tuple[ModelSpec | None, ServingArch]:
    """(the `calc.ModelSpec` calc replays, or None for a family it cannot replay; the serving
    view) of a ModelSpec or a config.json dict; ``ValueError`` for anything else."""
    if isinstance(model, ModelSpec):
        if model.hf_config is not None:  # another architecture: served from its config
            return None, ServingArch.from_hf_config(json.loads(model.hf_config))
        return model, ServingArch.from_model_spec(model)
    if isinstance(model, Mapping):
        model = language_model_config(model)  # a multimodal config's decoder
        if model.get("model_type") in MODEL_TYPES:  # the checkpoint's quantization kept
            return ModelSpec.from_hf_config(model), ServingArch.from_hf_config(model)
        return None, ServingArch.from_hf_config(model)
    raise ValueError(
        f"model must be a calc.ModelSpec or a config.json dict, got {type(model).__name__}"
    )


def serve(
    model: ModelSpec | Mapping[str, object],
    serving: Serving,
    total_bytes: int | None = None,
    gpu: str | None = None,
) -> ServeEstimate:
    """Predict what vLLM logs at start-up for ``model`` (a `calc.ModelSpec` or a Hugging Face
    ``config.json`` dict of a family in `calc.serving.arch`) served with ``serving`` on GPUs of
    ``total_bytes`` (the CUDA driver's total) or catalog GPU ``gpu``: weights, non-torch memory,
    the profiling activation peak, CUDA graphs, the KV cache, its blocks, tokens and the
    maximum concurrency, per GPU (the rank with the fewest blocks; vLLM uses that many on every
    rank). Sources: ``calc.serving.profile``, ``kv_cache``, ``weights``, ``engine``, ``arch``."""
    spec, arch = resolve_model(model)
    if not isinstance(serving, Serving):
        raise ValueError(f"serving must be a calc.Serving, got {type(serving).__name__}")
    total, card = _total(total_bytes, gpu)
    cfg = eng.resolve(
        serving,
        arch.max_positions,
        total,
        card.name if card is not None else "",
        _compute_capability(card),
        mla=arch.mla is not None,
    )
    block = cfg.block_size
    if cfg.max_model_len > arch.max_positions:
        raise ValueError(
            f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings "
            f"({arch.max_positions})"
        )
    budget = int(total * serving.gpu_memory_utilization)
    tokens = cfg.max_num_batched_tokens
    rows = min(cfg.max_num_seqs, tokens)
    if spec is not None:
        forward = prof.forward_activation_bytes(spec, serving, tokens)
    else:
        forward = prof.analytic_forward_bytes(arch, serving, tokens)
    sampler = prof.sampler_bytes(arch, serving, cfg.engine, tokens, rows)
    non_torch = prof.non_torch_bytes(serving, cfg.engine)
    layers = stage_layers(arch.n_layers, serving.pipeline_parallel)
    best: tuple[int, int, int, int, int, int, kv.KVLayout] | None = None
    for stage, n_layers in enumerate(layers):
        weights = stage_weight_bytes(arch, serving, stage)
        last = stage == len(layers) - 1
        act = max(forward, sampler) if last else forward
        graphs = prof.cuda_graph_bytes(serving, n_layers, cfg.cudagraph_capture_size)
        counted = graphs if cfg.cudagraphs_in_budget else 0
        avail = budget - weights - non_torch - act - counted
        indices = stage_layer_indices(arch.n_layers, serving.pipeline_parallel, stage)
        layout = kv.kv_layout(arch, serving, cfg.engine, indices, cfg.max_model_len, tokens, block)
        blocks = kv.num_blocks(avail, layout.page_bytes, layout.group_size)
        if best is None or (blocks, -avail) < (best[0], -best[4]):
            best = (blocks, stage, weights, act, avail, graphs, layout)
    assert best is not None
    blocks, stage, weights, act, avail, graphs, layout = best
    notes = _notes(cfg, serving, tokens, rows, spec is None, layout)
    notes += weight_format(arch.checkpoint, serving)[1]
    if cfg.block_size_note is not None:
        notes += (cfg.block_size_note,)
    left_out = multimodal_note(model) if isinstance(model, Mapping) else None
    if left_out is not None:  # vLLM loads the vision tower too: fewer KV blocks than this
        notes += (f"{left_out}: vLLM loads and profiles them too, so the KV cache is smaller",)
    if cfg.engine == "v0":
        kv_tokens = blocks * block
        concurrency = kv_tokens / cfg.max_model_len
    else:
        kv_tokens = blocks // layout.n_groups * block
        concurrency = blocks / layout.blocks_per_request
    return ServeEstimate(
        total_bytes=total,
        budget_bytes=budget,
        weights_bytes=weights,
        non_torch_bytes=non_torch,
        activation_peak_bytes=act,
        cuda_graph_bytes=graphs,
        kv_cache_bytes=avail,
        gpu_blocks=blocks,
        kv_cache_tokens=kv_tokens,
        max_concurrency=concurrency,
        engine=cfg.engine,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=tokens,
        page_bytes=layout.page_bytes,
        layers_per_rank=layers[stage],
        block_size=block,
        kv_cache_groups=layout.n_groups,
        block_bytes=layout.page_bytes * layout.group_size,
        notes=notes,
    )


def _notes(
    cfg: eng.EngineSettings, serving: Serving, tokens: int, rows: int, analytic: bool,
    layout: kv.KVLayout,
) -> tuple[str, ...]:  # fmt: skip
    forward = (
        "an analytic estimate of vLLM's layer (calc.serving.profile.analytic_forward_bytes: "
        "residual, attention or MLP/FusedMoE intermediate caches), not a replay"
        if analytic
        else "calc's replay of the Hugging Face forward (per rank)"
    )
    notes: tuple[str, ...] = (
        f"engine {cfg.engine} (vLLM {serving.vllm_version}); profiling forward of "
        f"{tokens} tokens over {rows} dummy requests",
        f"activation peak: {forward} vs vLLM's sampler over {rows} rows, the larger",
        "non-torch memory and CUDA graphs: estimates from published logs, not replayed",
    )
    if layout.n_groups > 1:
        notes += (
            f"hybrid KV cache: {layout.n_groups} groups of {layout.group_size} layers on this "
            "rank; tokens = blocks // groups x block_size (vLLM's log)",
        )
    if not cfg.cudagraphs_in_budget and cfg.cudagraph_capture_size:
        notes += ("CUDA graphs are captured after the KV cache (before 0.21): outside it",)
    return notes


def gib(value: int) -> float:
    """Bytes in GiB, for display."""
    return value / GIB
