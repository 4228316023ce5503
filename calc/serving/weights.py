"""The weights one vLLM rank loads: what "Model loading took X GiB" reports.

vLLM's model code (``vllm/model_executor/models/llama.py``, ``qwen2.py``, ``qwen3.py``,
``gpt2.py``) builds the layers from its parallel linears (``vllm/model_executor/layers/
linear.py``) and embeddings (``vocab_parallel_embedding.py``):

* ``QKVParallelLinear``: one fused ``[(a/tp + 2 k_r) d, h]`` weight per rank, where a rank holds
  ``k_r = max(1, k / tp)`` KV heads (``tp >= k`` replicates them: ``num_kv_head_replicas``);
  ``MergedColumnParallelLinear`` (``gate_up_proj``): ``[2 f / tp, h]``; ``RowParallelLinear``
  (``o_proj``, ``down_proj``): the input dimension split, the bias whole on every rank;
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of 64
  (``DEFAULT_VOCAB_PADDING_SIZE``) and split over the ranks; a tied head is the embedding;
* norms replicated; the rotary embedding's ``cos_sin_cache`` ``[max_position_embeddings,
  rotary_dim]`` in the model dtype, built once (``get_rope`` caches it) and registered as a
  buffer (``vllm/model_executor/layers/rotary_embedding``), so it is loaded with the weights;
* pipeline stages (``vllm/distributed/utils.py`` ``get_pp_indices``): ``L // pp`` layers each,
  the remainder one more on the stages just before the last; the embedding on the first stage,
  the final norm and head on the last.

Quantized checkpoints store the decoder linears only (embedding and head stay in ``dtype``):
``fp8`` one byte per weight plus an fp32 scale per merged shard (``Fp8LinearMethod``,
per-tensor); ``w8a8`` one byte plus an fp32 scale per output channel (compressed-tensors
channelwise int8); ``w4a16`` half a byte plus an fp16 scale per group of 128 inputs
(GPTQ/compressed-tensors symmetric; Marlin's repacked copy replaces the checkpoint's, same size;
AWQ's zero points, ``in/128 x out/2`` bytes, are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from calc.config.model_spec import ModelSpec
from calc.config.serving import Serving

VOCAB_PADDING = 64
"""``DEFAULT_VOCAB_PADDING_SIZE`` of ``vocab_parallel_embedding.py``."""
W4_GROUP = 128
"""Group size of the int4 checkpoints modelled (``w4a16``)."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of ``--dtype``."""


@dataclass(frozen=True, slots=True)
class Linear:
    """One linear of a layer as a rank holds it."""

    out_features: int
    in_features: int
    shards: int
    """Logical matrices merged into it (qkv 3, gate_up 2): fp8 keeps one scale per shard."""
    bias: int
    """Bias elements on this rank (0 without a bias)."""


def _div(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"tensor_parallel={tp} must divide the model's {what} ({total})")
    return total // tp


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """``QKVParallelLinear``: ``k / tp`` KV heads per rank, one (replicated) when ``tp >= k``."""
    if tp >= model.n_kv_heads:
        if tp % model.n_kv_heads:
            raise ValueError(
                f"tensor_parallel={tp} must be a multiple of the KV heads ({model.n_kv_heads})"
            )
        return 1
    return _div(model.n_kv_heads, tp, "KV heads")


def layer_linears(model: ModelSpec, tp: int) -> tuple[Linear, ...]:
    """The four linears of one decoder layer on one tensor-parallel rank."""
    h, d = model.hidden, model.head_dim
    heads = _div(model.n_heads, tp, "attention heads")
    ffn = _div(model.ffn, tp, "intermediate size")
    qkv_out = (heads + 2 * kv_heads_per_rank(model, tp)) * d
    if model.model_type == "gpt2":  # c_attn, c_proj, c_fc, mlp.c_proj: all with biases
        return (
            Linear(qkv_out, h, 3, qkv_out),
            Linear(h, heads * d, 1, h),
            Linear(ffn, h, 1, ffn),
            Linear(h, ffn, 1, h),
        )
    return (
        Linear(qkv_out, h, 3, qkv_out if model.qkv_bias else 0),
        Linear(h, heads * d, 1, h if model.o_bias else 0),
        Linear(2 * ffn, h, 2, 2 * ffn if model.mlp_bias else 0),
        Linear(h, ffn, 1, h if model.mlp_bias else 0),
    )


def linear_bytes(lin: Linear, serving: Serving) -> int:
    """Bytes of one linear's weight, scales and bias in the checkpoint format of ``serving``."""
    itemsize = DTYPE_BYTES[serving.dtype]
    numel = lin.out_features * lin.in_features
    bias = lin.bias * itemsize
    if serving.quant is None:
        return numel * itemsize + bias
    if serving.quant == "fp8":
        return numel + 4 * lin.shards + bias
    if serving.quant == "w8a8":
        return numel + 4 * lin.out_features + bias
    groups = -(-lin.in_features // W4_GROUP)  # w4a16
    return numel // 2 + 2 * groups * lin.out_features + bias


def layer_bytes(model: ModelSpec, serving: Serving) -> int:
    """One decoder layer on one rank: the linears plus the replicated norms."""
    itemsize = DTYPE_BYTES[serving.dtype]
    tp = serving.tensor_parallel
    linears = sum(linear_bytes(lin, serving) for lin in layer_linears(model, tp))
    norm_params = 2 * model.hidden * (2 if model.norm_bias else 1)
    if model.qk_norm:
        norm_params += 2 * model.head_dim
    return linears + norm_params * itemsize


def padded_vocab(model: ModelSpec) -> int:
    """``pad_vocab_size(vocab, 64)``."""
    return -(-model.vocab // VOCAB_PADDING) * VOCAB_PADDING


def stage_layers(n_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage (``get_pp_indices``): the remainder on the stages before the
    last."""
    if pp > n_layers:
        raise ValueError(f"pipeline_parallel={pp} exceeds the model's {n_layers} layers")
    parts = [n_layers // pp] * pp
    for i in range(n_layers % pp):
        parts[-2 - i] += 1
    return tuple(parts)


def stage_weight_bytes(model: ModelSpec, serving: Serving, stage: int) -> int:
    """Bytes a rank of pipeline stage ``stage`` loads (weights, rope cache, GPT-2's ``wpe``)."""
    itemsize = DTYPE_BYTES[serving.dtype]
    pp = serving.pipeline_parallel
    n_layers = stage_layers(model.n_layers, pp)[stage]
    total = n_layers * layer_bytes(model, serving)
    table = padded_vocab(model) // serving.tensor_parallel * model.hidden * itemsize
    first, last = stage == 0, stage == pp - 1
    if first:
        total += table
        if model.learned_positions:
            total += model.max_positions * model.hidden * itemsize
    if last:
        final_norm = model.hidden * (2 if model.norm_bias else 1)
        total += final_norm * itemsize
        if not model.tied_embeddings or not first:
            total += table  # a tied head on another stage loads its own copy
    if not model.learned_positions:  # rotary cos_sin_cache [max_positions, head_dim]
        total += model.max_positions * model.head_dim * itemsize
    return total
