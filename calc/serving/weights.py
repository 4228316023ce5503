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

Quantized checkpoints store the decoder linears only (embedding and head stay in ``dtype``),
in the format `calc.serving.checkpoint.weight_format` resolves (the config's
``quantization_config``, or ``quant=``): ``fp8`` one byte per weight plus fp32 scales, one per
merged shard (``Fp8LinearMethod``, per-tensor), per output channel, or per ``[bn, bk]`` block
(``weight_block_size``: ``cdiv(out, bn) x cdiv(in, bk)``); ``w8a8`` one byte plus an fp32 scale
per output channel (compressed-tensors channelwise int8) or shard; ``w4a16`` half a byte plus an
fp16 scale per group of inputs (GPTQ/compressed-tensors symmetric; Marlin's repacked copy
replaces the checkpoint's, same size; AWQ's zero points, ``in/group x out/2`` bytes, are not
counted).

The other families (`calc.serving.arch`), as their vLLM model classes build them:

* MoE layers: ``FusedMoE`` (``vllm/model_executor/layers/fused_moe/layer.py``,
  ``UnquantizedFusedMoEMethod.create_weights``): ``w13_weight [E, 2 I / tp, h]`` and
  ``w2_weight [E, h, I / tp]`` (tensor parallelism splits each expert's intermediate size;
  with ``--enable-expert-parallel`` a rank holds ``cdiv(E, tp)`` whole experts instead); the router ``gate`` ``[E, h]`` (``ReplicatedLinear`` /
  ``GateLinear``, unquantized, replicated); DeepSeek's ``e_score_correction_bias`` ``[E]`` fp32;
  shared experts (``DeepseekV2MLP`` of ``moe_intermediate_size * n_shared_experts``, Qwen2-MoE's
  ``shared_expert``) as a tensor-parallel gated MLP, Qwen2-MoE's ``shared_expert_gate`` ``[1, h]``
  replicated. fp8 keeps two scales per expert for ``w13`` and one for ``w2`` (per-tensor).
* MLA (``deepseek_v2.py`` ``DeepseekV2MLAAttention``): ``q_a_proj [q_lora, h]`` replicated with
  ``q_a_layernorm``, ``q_b_proj [a (nope + rope) / tp, q_lora]`` (or ``q_proj [a (nope + rope) /
  tp, h]``), ``kv_a_proj_with_mqa [kv_lora + rope, h]`` replicated with ``kv_a_layernorm``,
  ``kv_b_proj [a (nope + v) / tp, kv_lora]``, ``o_proj [h, a v / tp]``; its rotary table is
  ``qk_rope_head_dim`` wide. The MLA backends' ``W_UK_T``/``W_UV`` (``process_weights_after_
  loading``) are views or copies of ``kv_b_proj`` made after loading: not counted.
* Gemma: four hidden-size norms per layer; Gemma-3's per-head q/k norms and two rotary tables;
  OLMo-2's ``q_norm [h]`` and ``k_norm [k d]``, replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from calc.config.model_spec import ModelSpec
from calc.config.serving import Serving
from calc.serving.arch import ServingArch
from calc.serving.checkpoint import USER_FORMATS, WeightFormat, weight_format

VOCAB_PADDING = 64
"""``DEFAULT_VOCAB_PADDING_SIZE`` of ``vocab_parallel_embedding.py``."""
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


def _arch(model: ModelSpec | ServingArch) -> ServingArch:
    return model if isinstance(model, ServingArch) else ServingArch.from_model_spec(model)


def kv_heads_per_rank(model: ModelSpec | ServingArch, tp: int) -> int:
    """``QKVParallelLinear``: ``k / tp`` KV heads per rank, one (replicated) when ``tp >= k``."""
    if tp >= model.n_kv_heads:
        if tp % model.n_kv_heads:
            raise ValueError(
                f"tensor_parallel={tp} must be a multiple of the KV heads ({model.n_kv_heads})"
            )
        return 1
    return _div(model.n_kv_heads, tp, "KV heads")


def attention_linears(arch: ServingArch, tp: int) -> tuple[Linear, ...]:
    """The attention projections of one layer on one tensor-parallel rank."""
    h, d = arch.hidden, arch.head_dim
    heads = _div(arch.n_heads, tp, "attention heads")
    if arch.mla is not None:
        m = arch.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q: tuple[Linear, ...] = (
            (Linear(m.q_lora_rank, h, 1, 0), Linear(heads * qk, m.q_lora_rank, 1, 0))
            if m.q_lora_rank is not None
            else (Linear(heads * qk, h, 1, 0),)
        )
        return (
            *q,
            Linear(m.kv_lora_rank + m.qk_rope_head_dim, h, 1, 0),
            Linear(heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, 1, 0),
            Linear(h, heads * m.v_head_dim, 1, 0),
        )
    qkv_out = (heads + 2 * kv_heads_per_rank(arch, tp)) * d
    return (
        Linear(qkv_out, h, 3, qkv_out if arch.qkv_bias else 0),
        Linear(h, heads * d, 1, h if arch.o_bias else 0),
    )


def mlp_linears(arch: ServingArch, ffn: int, tp: int) -> tuple[Linear, ...]:
    """A dense MLP of intermediate size ``ffn`` on one rank: ``gate_up_proj`` + ``down_proj``
    (GPT-2: ``c_fc`` + ``c_proj``)."""
    h = arch.hidden
    f = _div(ffn, tp, "intermediate size")
    if not arch.gated_mlp:
        return (
            Linear(f, h, 1, f if arch.mlp_bias else 0),
            Linear(h, f, 1, h if arch.mlp_bias else 0),
        )
    return (
        Linear(2 * f, h, 2, 2 * f if arch.mlp_bias else 0),
        Linear(h, f, 1, h if arch.mlp_bias else 0),
    )


def layer_linears(model: ModelSpec | ServingArch, tp: int, layer: int = 0) -> tuple[Linear, ...]:
    """The attention and dense-MLP linears of decoder layer ``layer`` on one rank (a sparse
    layer's shared MLP, if any, in place of the dense one; experts: `moe_bytes`)."""
    arch = _arch(model)
    attn = attention_linears(arch, tp)
    if not arch.moe_layers[layer]:
        return attn + mlp_linears(arch, arch.ffn, tp)
    assert arch.moe is not None
    if arch.moe.shared_ffn:
        return attn + mlp_linears(arch, arch.moe.shared_ffn, tp)
    return attn


_UNSET: WeightFormat = WeightFormat(kind="fp8", scales="tensor")
"""Marker: `linear_bytes` without ``fmt`` takes ``serving.quant``'s format."""


def rank_format(model: ModelSpec | ServingArch, serving: Serving) -> WeightFormat | None:
    """The format of the decoder linears (``None``: ``dtype``): ``quant=``, else the
    checkpoint's ``quantization_config`` (`calc.serving.checkpoint.weight_format`)."""
    return weight_format(_arch(model).checkpoint, serving)[0]


def linear_bytes(lin: Linear, serving: Serving, fmt: WeightFormat | None = _UNSET) -> int:
    """Bytes of one linear's weight, scales and bias stored in ``fmt`` (``None``: ``dtype``;
    omitted: the format ``serving.quant`` names)."""
    if fmt is _UNSET:
        fmt = None if serving.quant is None else USER_FORMATS[serving.quant]
    itemsize = DTYPE_BYTES[serving.dtype]
    out, inp = lin.out_features, lin.in_features
    numel = out * inp
    bias = lin.bias * itemsize
    if fmt is None:
        return numel * itemsize + bias
    weight = numel // 2 if fmt.kind == "w4a16" else numel
    scale = 2 if fmt.kind == "w4a16" else 4  # fp16 group scales; fp32 otherwise
    if fmt.scales == "tensor":
        count = lin.shards
    elif fmt.scales == "channel":
        count = out
    elif fmt.scales == "block":
        count = -(-out // fmt.block[0]) * -(-inp // fmt.block[1])
    else:  # group
        count = -(-inp // fmt.group) * out
    return weight + scale * count + bias


def moe_bytes(arch: ServingArch, serving: Serving) -> int:
    """One sparse layer's experts and router on one rank: ``E`` x (``w13`` + ``w2``), the
    replicated router ``[E, h]`` in ``dtype``, DeepSeek's fp32 correction bias, Qwen2-MoE's
    ``shared_expert_gate``."""
    assert arch.moe is not None
    moe, h = arch.moe, arch.hidden
    itemsize = DTYPE_BYTES[serving.dtype]
    inter = expert_ffn_per_rank(arch, serving)
    fmt = rank_format(arch, serving)
    expert = linear_bytes(Linear(2 * inter, h, 2, 0), serving, fmt) + linear_bytes(
        Linear(h, inter, 1, 0), serving, fmt
    )
    router = moe.n_experts * h * itemsize + (4 * moe.n_experts if moe.router_bias else 0)
    gate = h * itemsize if moe.shared_gate else 0
    return local_experts(arch, serving) * expert + router + gate


def expert_ffn_per_rank(arch: ServingArch, serving: Serving) -> int:
    """An expert's intermediate size on one rank: ``I / tp``, whole with expert parallelism."""
    assert arch.moe is not None
    if serving.expert_parallel:
        return arch.moe.expert_ffn
    return _div(arch.moe.expert_ffn, serving.tensor_parallel, "expert intermediate size")


def local_experts(arch: ServingArch, serving: Serving) -> int:
    """Experts on the most loaded rank: all of them, or with ``--enable-expert-parallel`` (EP
    size = tp, ``FusedMoEParallelConfig``) ``cdiv(E, tp)`` (``determine_expert_map`` gives the
    remainder to the first ranks)."""
    assert arch.moe is not None
    if not serving.expert_parallel:
        return arch.moe.n_experts
    return -(-arch.moe.n_experts // serving.tensor_parallel)


def norm_params(arch: ServingArch) -> int:
    """Replicated norm elements of one decoder layer."""
    total = arch.norms_per_layer * arch.hidden * (2 if arch.norm_bias else 1)
    if arch.qk_norm == "head":
        total += 2 * arch.head_dim
    elif arch.qk_norm == "full":
        total += arch.hidden + arch.n_kv_heads * arch.head_dim
    if arch.mla is not None:
        total += arch.mla.kv_lora_rank + (arch.mla.q_lora_rank or 0)
    return total


def layer_bytes(model: ModelSpec | ServingArch, serving: Serving, layer: int = 0) -> int:
    """Decoder layer ``layer`` on one rank: the linears, the experts if sparse, the norms."""
    arch = _arch(model)
    tp = serving.tensor_parallel
    fmt = rank_format(arch, serving)
    linears = sum(linear_bytes(lin, serving, fmt) for lin in layer_linears(arch, tp, layer))
    experts = moe_bytes(arch, serving) if arch.moe_layers[layer] else 0
    return linears + experts + norm_params(arch) * DTYPE_BYTES[serving.dtype]


def padded_vocab(model: ModelSpec | ServingArch) -> int:
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


def stage_layer_indices(n_layers: int, pp: int, stage: int) -> range:
    """Indices of the decoder layers on pipeline stage ``stage``."""
    parts = stage_layers(n_layers, pp)
    start = sum(parts[:stage])
    return range(start, start + parts[stage])


def stage_weight_bytes(model: ModelSpec | ServingArch, serving: Serving, stage: int) -> int:
    """Bytes a rank of pipeline stage ``stage`` loads (weights, rope cache, GPT-2's ``wpe``)."""
    arch = _arch(model)
    itemsize = DTYPE_BYTES[serving.dtype]
    pp = serving.pipeline_parallel
    layers = stage_layer_indices(arch.n_layers, pp, stage)
    if any(arch.moe_layers) or arch.mla is not None:
        total = sum(layer_bytes(arch, serving, i) for i in layers)
    else:  # uniform layers
        total = len(layers) * layer_bytes(arch, serving)
    table = padded_vocab(arch) // serving.tensor_parallel * arch.hidden * itemsize
    first, last = stage == 0, stage == pp - 1
    if first:
        total += table
        if arch.learned_positions:
            total += arch.max_positions * arch.hidden * itemsize
    if last:
        final_norm = arch.hidden * (2 if arch.norm_bias else 1)
        total += final_norm * itemsize
        if not arch.tied_embeddings or not first:
            total += table  # a tied head on another stage loads its own copy
    if not arch.learned_positions:  # rotary cos_sin_cache [max_positions, rotary_dim]
        total += arch.rope_tables * arch.max_positions * arch.rotary_dim * itemsize
    return total
