"""A serving view of a model's architecture: what vLLM's model classes build, read from a Hugging
Face ``config.json`` (a ``Mapping``; nothing is evaluated) or from a `calc.ModelSpec`.

Per layer it records the KV-cache spec vLLM's ``Attention`` layer reports
(``vllm/v1/kv_cache_interface.py``: ``FullAttentionSpec``, ``SlidingWindowSpec``,
``MLAAttentionSpec``), and whether the layer's MLP is a mixture of experts; for the whole model the
MoE structure, the MLA ranks, head_dim overrides, tied embeddings, biases and norms. Sources, per
family (vllm-project/vllm ``vllm/model_executor/models/``; the HF defaults from transformers'
``configuration_*.py``):

* ``mixtral.py``: every layer a ``MixtralMoE`` (``num_local_experts``, ``num_experts_per_tok``,
  ``intermediate_size`` per expert); a ``sliding_window`` in the config windows every layer;
* ``qwen2_moe.py`` / ``qwen3_moe.py``: a layer is sparse when it is not in ``mlp_only_layers``,
  ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``; experts of
  ``moe_intermediate_size``; Qwen2-MoE adds ``shared_expert`` (``shared_expert_intermediate_size``)
  and ``shared_expert_gate`` (``[1, h]``); Qwen3-MoE has per-head q/k norms;
* ``deepseek_v2.py`` (V2 and V3): MLA attention (``q_lora_rank``, ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), ``DeepseekV2MoE`` on layers
  ``i >= first_k_dense_replace`` with ``i % moe_layer_freq == 0``, ``n_shared_experts`` folded
  into one MLP of ``moe_intermediate_size * n_shared_experts``, and the fp32
  ``e_score_correction_bias`` when ``topk_method == "noaux_tc"``;
* ``gemma2.py`` / ``gemma3.py``: four norms per layer (input, post-attention, pre- and
  post-feedforward), a GeGLU MLP, tied embeddings; Gemma-2 windows the even layers, Gemma-3 all
  but every ``sliding_window_pattern``-th (``layer_types`` when the config lists them); Gemma-3
  adds per-head q/k norms and a second rotary table (``rope_local_base_freq``);
* ``phi3.py`` (a Llama with fused ``qkv_proj``/``gate_up_proj`` checkpoints), ``granite.py``
  (Llama's layout, tied embeddings by default), ``olmo2.py`` (post-attention and post-feedforward
  norms only; ``q_norm`` over ``hidden_size`` and ``k_norm`` over ``kv_heads * head_dim``,
  replicated under tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from calc.config.model_spec import MODEL_TYPES, ModelSpec
from calc.config.multimodal import language_model_config
from calc.serving.checkpoint import Declared, declared

KVKind = Literal["full", "sliding", "mla"]
QKNorm = Literal["none", "head", "full"]

CONFIG_FAMILIES: tuple[str, ...] = (
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gemma2", "gemma3_text",
    "phi3", "olmo2", "granite",
)  # fmt: skip
"""``model_type`` values read here directly (the five of `calc.ModelSpec` go through it)."""


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One decoder layer's KV-cache spec in vLLM."""

    kind: KVKind
    """``full`` (``FullAttentionSpec``), ``sliding`` (``SlidingWindowSpec``) or ``mla``
    (``MLAAttentionSpec``: one latent per token)."""
    window: int | None = None
    """Sliding window in tokens (``sliding`` only)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MoE:
    """The mixture-of-experts MLP of the sparse layers."""

    n_experts: int
    """Routed experts per layer."""
    top_k: int
    """Experts each token is sent to."""
    expert_ffn: int
    """Intermediate size of one expert."""
    shared_ffn: int = 0
    """Intermediate size of the always-on shared MLP (0: none)."""
    shared_gate: bool = False
    """Qwen2-MoE's ``shared_expert_gate`` ``[1, h]``."""
    router_bias: bool = False
    """DeepSeek's fp32 ``e_score_correction_bias`` ``[n_experts]``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MLA:
    """DeepSeek's multi-head latent attention ranks."""

    q_lora_rank: int | None
    """Rank of the query down-projection (``None``: a plain ``q_proj``)."""
    kv_lora_rank: int
    """Rank of the KV latent (cached)."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int
    """Per-head rotary width (the rotary key is cached beside the latent)."""
    v_head_dim: int
    """Per-head value width."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServingArch:
    """What a vLLM rank builds for one model (see the module docstring for the sources)."""

    name: str
    """Display name."""
    model_type: str
    """The config's ``model_type``."""
    hidden: int
    """``hidden_size``."""
    n_heads: int
    """Attention heads."""
    n_kv_heads: int
    """KV heads (MLA: equal to the heads; its cache holds one latent)."""
    head_dim: int
    """Width of one attention head."""
    ffn: int
    """Intermediate size of the dense MLP layers."""
    vocab: int
    """Vocabulary."""
    max_positions: int
    """``max_position_embeddings``."""
    layers: tuple[LayerKV, ...]
    """KV spec of each decoder layer."""
    moe_layers: tuple[bool, ...]
    """Whether each decoder layer's MLP is the mixture of experts."""
    moe: MoE | None = None
    """The experts (``None``: a dense model)."""
    mla: MLA | None = None
    """MLA ranks (``None``: ordinary attention)."""
    gated_mlp: bool = True
    """Fused ``gate_up_proj`` (SwiGLU/GeGLU); ``False``: GPT-2's ``c_fc``/``c_proj``."""
    qkv_bias: bool = False
    """Biases on q/k/v."""
    o_bias: bool = False
    """Bias on the output projection."""
    mlp_bias: bool = False
    """Biases on the MLP linears."""
    norm_bias: bool = False
    """LayerNorm biases (GPT-2)."""
    norms_per_layer: int = 2
    """Hidden-size norms per decoder layer (Gemma: 4)."""
    qk_norm: QKNorm = "none"
    """``head``: per-head q/k norms (Qwen3, Gemma-3); ``full``: OLMo-2's over all heads."""
    tied_embeddings: bool = False
    """The LM head is the embedding."""
    learned_positions: bool = False
    """GPT-2's ``wpe`` instead of rotary embeddings."""
    rope_tables: int = 1
    """Distinct rotary ``cos_sin_cache`` buffers (Gemma-3: local and global)."""
    checkpoint: Declared | None = None
    """The config's ``quantization_config`` (`calc.serving.checkpoint.declared`; e.g.
    DeepSeek-V3's block-wise ``fp8``); ``None``: the checkpoint is in ``dtype``."""

    @property
    def checkpoint_quant(self) -> str | None:
        """``quantization_config.quant_method`` of the config, if any."""
        return None if self.checkpoint is None else self.checkpoint.method

    def __post_init__(self) -> None:
        for name in ("hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab",
                     "max_positions"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not self.layers:
            raise ValueError("layers must hold at least one decoder layer")
        if len(self.moe_layers) != len(self.layers):
            raise ValueError(
                f"moe_layers has {len(self.moe_layers)} entries for {len(self.layers)} layers"
            )
        if any(self.moe_layers) and self.moe is None:
            raise ValueError("moe_layers marks sparse layers but moe is None")
        if any(layer.kind == "mla" for layer in self.layers) and self.mla is None:
            raise ValueError("an mla layer needs the mla ranks")

    @property
    def n_layers(self) -> int:
        """Decoder layers."""
        return len(self.layers)

    @property
    def rotary_dim(self) -> int:
        """Width of the rotary table (MLA: ``qk_rope_head_dim``)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @classmethod
    def from_model_spec(cls, model: ModelSpec) -> ServingArch:
        """The view of a `calc.ModelSpec` (llama, mistral, qwen2, qwen3, gpt2): every layer full
        attention, or windowed where the spec has a ``sliding_window`` (Mistral's rule)."""
        kv = (
            LayerKV("sliding", model.sliding_window)
            if model.sliding_window is not None
            else LayerKV("full")
        )
        return cls(
            name=model.name,
            model_type=model.model_type,
            hidden=model.hidden,
            n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads,
            head_dim=model.head_dim,
            ffn=model.ffn,
            vocab=model.vocab,
            max_positions=model.max_positions,
            layers=(kv,) * model.n_layers,
            moe_layers=(False,) * model.n_layers,
            gated_mlp=model.mlp == "swiglu",
            qkv_bias=model.qkv_bias or model.model_type == "gpt2",
            o_bias=model.o_bias or model.model_type == "gpt2",
            mlp_bias=model.mlp_bias or model.model_type == "gpt2",
            norm_bias=model.norm_bias,
            qk_norm="head" if model.qk_norm else "none",
            tied_embeddings=model.tied_embeddings,
            learned_positions=model.learned_positions,
        )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object], name: str | None = None) -> ServingArch:
        """Read a Hugging Face ``config.json`` dict; ``ValueError`` naming the key it cannot read.
        The five `calc.ModelSpec` types go through `calc.ModelSpec.from_hf_config`."""
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a mapping (a config.json dict), got {config!r}")
        config = language_model_config(config)  # a multimodal config's decoder
        model_type = config.get("model_type")
        label = name or str(model_type)
        if model_type in MODEL_TYPES:
            spec_view = cls.from_model_spec(ModelSpec.from_hf_config(config, name=name))
            return replace(spec_view, checkpoint=declared(config))
        if model_type not in CONFIG_FAMILIES:
            raise ValueError(
                f"model_type={model_type!r} is not modelled for serving; known: "
                f"{', '.join(MODEL_TYPES + CONFIG_FAMILIES)}"
            )
        return _from_config(config, str(model_type), label)


def _int(c: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = c.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        if value is None:
            raise ValueError(f"config key {key!r} is missing (a non-negative integer)")
        raise ValueError(f"config key {key}={value!r} must be a non-negative integer")
    return value


def _bool(c: Mapping[str, object], key: str, default: bool) -> bool:
    value = c.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config key {key}={value!r} must be true or false")
    return value


def _layer_types(c: Mapping[str, object], n_layers: int) -> list[str] | None:
    value = c.get("layer_types")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n_layers:
        raise ValueError(f"config key 'layer_types' must list {n_layers} layer types")
    allowed = ("full_attention", "sliding_attention")
    if any(v not in allowed for v in value):
        raise ValueError(f"config key 'layer_types' entries must be one of {allowed}")
    return [str(v) for v in value]


def _window(c: Mapping[str, object]) -> int | None:
    value = c.get("sliding_window")
    if value is None:
        return None
    return _int(c, "sliding_window")


def _gemma_kv(c: Mapping[str, object], model_type: str, n_layers: int) -> tuple[LayerKV, ...]:
    window = _window(c)
    if window is None:
        return (LayerKV("full"),) * n_layers
    types = _layer_types(c, n_layers)
    if types is None:
        if model_type == "gemma2":  # HF Gemma2: sliding on even layer indices
            types = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
            ]
        else:  # Gemma3: every sliding_window_pattern-th layer is global
            pattern = _int(c, "sliding_window_pattern", 6) or 6
            types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(n_layers)
            ]
    return tuple(
        LayerKV("sliding", window) if t == "sliding_attention" else LayerKV("full") for t in types
    )


def _moe_of(
    c: Mapping[str, object], model_type: str, n_layers: int
) -> tuple[MoE, tuple[bool, ...]]:
    if model_type == "mixtral":
        moe = MoE(
            n_experts=_int(c, "num_local_experts", 8),
            top_k=_int(c, "num_experts_per_tok", 2),
            expert_ffn=_int(c, "intermediate_size"),
        )
        return moe, (True,) * n_layers
    if model_type in ("deepseek_v2", "deepseek_v3"):
        n_shared = _int(c, "n_shared_experts", 0)
        expert_ffn = _int(c, "moe_intermediate_size")
        moe = MoE(
            n_experts=_int(c, "n_routed_experts"),
            top_k=_int(c, "num_experts_per_tok"),
            expert_ffn=expert_ffn,
            shared_ffn=expert_ffn * n_shared,
            router_bias=c.get("topk_method") == "noaux_tc",
        )
        first_dense = _int(c, "first_k_dense_replace", 0)
        freq = _int(c, "moe_layer_freq", 1) or 1
        sparse = tuple(i >= first_dense and i % freq == 0 for i in range(n_layers))
        return moe, sparse
    # qwen2_moe / qwen3_moe
    moe = MoE(
        n_experts=_int(c, "num_experts"),
        top_k=_int(c, "num_experts_per_tok"),
        expert_ffn=_int(c, "moe_intermediate_size"),
        shared_ffn=_int(c, "shared_expert_intermediate_size", 0)
        if model_type == "qwen2_moe"
        else 0,
        shared_gate=model_type == "qwen2_moe",
    )
    step = _int(c, "decoder_sparse_step", 1) or 1
    only = c.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ValueError("config key 'mlp_only_layers' must be a list of layer indices")
    sparse = tuple(
        i not in only and moe.n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)
    )
    return moe, sparse


def _from_config(c: Mapping[str, object], model_type: str, name: str) -> ServingArch:
    hidden = _int(c, "hidden_size")
    heads = _int(c, "num_attention_heads")
    n_layers = _int(c, "num_hidden_layers")
    if hidden <= 0 or heads <= 0 or n_layers <= 0:
        raise ValueError(
            "config keys hidden_size, num_attention_heads, num_hidden_layers must be > 0"
        )
    kv_heads = _int(c, "num_key_value_heads", heads) or heads
    head_default = 128 if model_type == "qwen3_moe" else hidden // heads
    head_dim = _int(c, "head_dim", head_default) or head_default
    moe: MoE | None = None
    sparse = (False,) * n_layers
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"):
        moe, sparse = _moe_of(c, model_type, n_layers)
    mla: MLA | None = None
    layers: tuple[LayerKV, ...]
    if model_type in ("deepseek_v2", "deepseek_v3"):
        q_rank = c.get("q_lora_rank")
        mla = MLA(
            q_lora_rank=None if q_rank is None else _int(c, "q_lora_rank"),
            kv_lora_rank=_int(c, "kv_lora_rank"),
            qk_nope_head_dim=_int(c, "qk_nope_head_dim"),
            qk_rope_head_dim=_int(c, "qk_rope_head_dim"),
            v_head_dim=_int(c, "v_head_dim"),
        )
        layers = (LayerKV("mla"),) * n_layers
        kv_heads = heads
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    elif model_type in ("gemma2", "gemma3_text"):
        layers = _gemma_kv(c, model_type, n_layers)
    else:
        window = _window(c)
        if model_type in ("qwen2_moe", "qwen3_moe") and not _bool(c, "use_sliding_window", False):
            window = None
        kv = LayerKV("sliding", window) if window is not None else LayerKV("full")
        layers = (kv,) * n_layers
    gemma = model_type in ("gemma2", "gemma3_text")
    attention_bias = _bool(c, "attention_bias", False)
    return ServingArch(
        name=name,
        model_type=model_type,
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=_int(c, "intermediate_size"),
        vocab=_int(c, "vocab_size"),
        max_positions=_int(c, "max_position_embeddings"),
        layers=layers,
        moe_layers=sparse,
        moe=moe,
        mla=mla,
        qkv_bias=attention_bias or model_type == "qwen2_moe",
        o_bias=attention_bias and model_type not in ("qwen2_moe",),
        mlp_bias=_bool(c, "mlp_bias", False) if model_type == "granite" else False,
        norms_per_layer=4 if gemma else 2,
        qk_norm=(
            "head"
            if model_type in ("qwen3_moe", "gemma3_text")
            else "full"
            if model_type == "olmo2"
            else "none"
        ),
        tied_embeddings=_bool(c, "tie_word_embeddings", gemma or model_type == "granite"),
        rope_tables=2 if model_type == "gemma3_text" else 1,
        checkpoint=declared(c),
    )
