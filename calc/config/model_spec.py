"""The shape of a decoder-only Transformer, and the parameter tensors it owns.

``ModelSpec`` is the one place a Hugging Face ``config.json`` is read into numbers. Its
``param_tensors`` lists every learnable tensor in the order ``model.named_parameters()`` yields
them (Hugging Face ``transformers``: ``models/llama/modeling_llama.py``,
``models/mistral/modeling_mistral.py``, ``models/qwen2/modeling_qwen2.py``,
``models/qwen3/modeling_qwen3.py``, ``models/gpt2/modeling_gpt2.py``), so the parameter count
is a sum over tensors rather than a closed-form guess. Buffers that some checkpoints also store
(GPT-2's causal-mask ``attn.bias``, old Llama's ``rotary_emb.inv_freq``) are not parameters and
are not listed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard, TypeVar

import sympy as sp

from calc import symbols as S
from calc.config.checks import is_int, is_real
from calc.config.multimodal import is_multimodal, language_model_config

ModelType = Literal["llama", "mistral", "qwen2", "qwen3", "gpt2"]
Group = Literal["embedding", "position", "layer", "final_norm", "head"]

MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
_MLPS = ("swiglu", "gelu")
_NORMS = ("rmsnorm", "layernorm")
_SIZE_FIELDS = (
    "hidden",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn",
    "vocab",
    "max_positions",
)
_BOOL_FIELDS = (
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "norm_bias",
    "qk_norm",
    "tied_embeddings",
    "learned_positions",
)
_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "embedding_dropout")
# GPT-2 ``activation_function`` values that are a GELU (transformers/activations.py ACT2FN).
_GELU_ACTS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python")

Dim = int | sp.Expr

_DERIVED_STRUCTURE: dict[str, Any] = {
    "mlp": "swiglu", "norm": "rmsnorm", "qkv_bias": False, "o_bias": False, "mlp_bias": False,
    "norm_bias": False, "qk_norm": False, "learned_positions": False, "attention_dropout": 0.0,
    "hidden_dropout": 0.0, "embedding_dropout": 0.0, "norm_eps": 1e-6, "rope_theta": None,
}  # fmt: skip
"""The structural fields of a derived model's spec: unused placeholders (its replay comes from
the modeling code, `calc.derive`), set so that the spec validates."""


def _is_model_type(value: object) -> TypeGuard[ModelType]:
    return value in MODEL_TYPES


@dataclass(frozen=True, slots=True)
class ParamTensor:
    """One learnable tensor of the model, as ``named_parameters()`` names and shapes it."""

    name: str
    """Parameter name without the ``model.``/``transformer.`` prefix; ``*`` stands for the layer
    index in group ``"layer"`` (e.g. ``layers.*.self_attn.q_proj.weight``)."""
    shape: tuple[Dim, ...]
    """Shape in PyTorch layout: ``nn.Linear`` is ``[out, in]``, GPT-2 ``Conv1D`` is ``[in, out]``.
    Entries are ints, or sympy expressions of ``calc.symbols`` when built symbolically."""
    group: Group
    """Where the tensor lives; ``"layer"`` tensors exist once per decoder layer (``L`` copies)."""

    @property
    def numel(self) -> Dim:
        """Number of elements of one copy of this tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Dimensions and structural switches of a decoder-only Transformer."""

    name: str
    """Display name or card id of the model."""
    model_type: ModelType
    """Hugging Face ``model_type``: the architecture whose tensors are listed."""
    hidden: int
    """Hidden size ``h`` (width of the residual stream), in elements."""
    n_layers: int
    """Number of decoder layers ``L``."""
    n_heads: int
    """Number of query heads ``a``."""
    n_kv_heads: int
    """Number of key/value heads ``k`` (equal to ``n_heads`` without GQA); divides ``n_heads``."""
    head_dim: int
    """Width of one attention head ``d``, in elements (``n_heads * head_dim`` may differ from
    ``hidden`` in the llama family, e.g. Qwen3)."""
    ffn: int
    """Feed-forward (intermediate) size ``f``, in elements."""
    vocab: int
    """Vocabulary size ``V`` (rows of the token embedding)."""
    max_positions: int
    """Longest sequence the model is configured for, in tokens (rows of ``wpe`` for GPT-2)."""
    mlp: Literal["swiglu", "gelu"]
    """MLP kind: ``swiglu`` (gate, up, down projections) or ``gelu`` (fc, proj)."""
    norm: Literal["rmsnorm", "layernorm"]
    """Normalisation layer kind."""
    qkv_bias: bool
    """Whether the q/k/v projections carry a bias."""
    o_bias: bool
    """Whether the attention output projection carries a bias."""
    mlp_bias: bool
    """Whether the MLP projections carry biases."""
    norm_bias: bool
    """Whether each norm has a bias (LayerNorm does; RMSNorm never does)."""
    qk_norm: bool
    """Whether each layer has per-head ``q_norm``/``k_norm`` RMSNorm weights over ``head_dim``
    (Qwen3)."""
    tied_embeddings: bool
    """Whether the LM head reuses the token-embedding matrix (then it is counted once)."""
    learned_positions: bool
    """Whether positions are a learned ``wpe`` table (GPT-2) rather than RoPE."""
    attention_dropout: float
    """Dropout probability on attention weights, in [0, 1)."""
    hidden_dropout: float
    """Dropout probability on residual-branch outputs (GPT-2 ``resid_pdrop``; 0 for llama family),
    in [0, 1)."""
    embedding_dropout: float
    """Dropout probability on the input embeddings (GPT-2 ``embd_pdrop``), in [0, 1)."""
    norm_eps: float
    """Epsilon added inside the norms (dimensionless, > 0)."""
    rope_theta: float | None
    """RoPE base wavelength; ``None`` for learned positions."""
    sliding_window: int | None = None
    """Sliding-window attention span in tokens for the layers that use it (Mistral's
    ``sliding_window``; Qwen2 only with ``use_sliding_window``), else ``None``. It changes the
    Hugging Face cache (``DynamicSlidingWindowLayer``), not the parameters."""
    hf_config: str | None = None
    """A model of another architecture (a ``model_type`` outside ``MODEL_TYPES``): its
    ``config.json`` as canonical JSON text (sorted keys), which ``calc.derive`` builds and
    traces; the size fields above are then read from it for display. ``None`` for the five
    hand-modelled types."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} must be a non-empty string")
        self._check_model_type()
        self._check_sizes()
        self._check_structure()
        self._check_numbers()

    def _check_model_type(self) -> None:
        """One of the hand-modelled types, or any other with its config (a derived model)."""
        if self.hf_config is None:
            if self.model_type not in MODEL_TYPES:
                raise ValueError(
                    f"model_type={self.model_type!r} must be one of {MODEL_TYPES}, or any other "
                    "Hugging Face model_type read with ModelSpec.from_hf_config (derived)"
                )
            return
        if not isinstance(self.hf_config, str):
            raise ValueError(f"hf_config={self.hf_config!r} must be JSON text or None")
        if self.model_type in MODEL_TYPES or not _is_type_name(self.model_type):
            raise ValueError(
                f"model_type={self.model_type!r} with hf_config must be a Hugging Face "
                f"model_type other than {MODEL_TYPES} (letters, digits, '_')"
            )

    @property
    def derived(self) -> bool:
        """Whether calc derives this model's replay from its modeling code (`calc.derive`)."""
        return self.hf_config is not None

    def _check_sizes(self) -> None:
        """Positive integer sizes; whole GQA groups; GPT-2's heads span the hidden size."""
        for field in _SIZE_FIELDS:
            value = getattr(self, field)
            if not is_int(value) or value <= 0:
                raise ValueError(f"{field}={value!r} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.model_type == "gpt2" and self.n_heads * self.head_dim != self.hidden:
            raise ValueError(
                f"head_dim={self.head_dim} must equal hidden/n_heads="
                f"{self.hidden}/{self.n_heads} for gpt2"
            )

    def _check_structure(self) -> None:
        """The MLP and norm kinds and the structural switches (a norm bias only on LayerNorm)."""
        if self.mlp not in _MLPS:
            raise ValueError(f"mlp={self.mlp!r} must be one of {_MLPS}")
        if self.norm not in _NORMS:
            raise ValueError(f"norm={self.norm!r} must be one of {_NORMS}")
        for field in _BOOL_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise ValueError(f"{field}={value!r} must be a bool")
        if self.norm_bias and self.norm != "layernorm":
            raise ValueError(f"norm_bias={self.norm_bias} is only allowed with norm='layernorm'")

    def _check_numbers(self) -> None:
        """Dropout probabilities in [0, 1); a positive norm epsilon and RoPE base."""
        for field in _DROPOUT_FIELDS:
            value = getattr(self, field)
            if not is_real(value) or not 0 <= value < 1:
                raise ValueError(f"{field}={value!r} must be a probability in [0, 1)")
        if not is_real(self.norm_eps) or not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} must be a positive number")
        if self.rope_theta is not None and (not is_real(self.rope_theta) or self.rope_theta <= 0):
            raise ValueError(f"rope_theta={self.rope_theta!r} must be a positive number or None")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object], name: str | None = None) -> ModelSpec:
        """Read a Hugging Face ``config.json`` mapping (model_type llama, mistral, qwen2, qwen3,
        gpt2; another type is kept for the derived replay; a multimodal config's ``text_config``,
        `calc.config.multimodal`). Keys absent from the mapping take the default of the matching
        ``transformers`` config class (``models/*/configuration_*.py``); the size keys that
        define the model are required. Raises ``ValueError`` naming the offending key."""
        if not isinstance(config, Mapping):
            got = type(config).__name__
            raise ValueError(f"config must be a JSON object (a dict), got {got}")
        if is_multimodal(config):  # the decoder under text_config (calc.config.multimodal)
            inner = language_model_config(config)
            outer = config.get("_name_or_path") or inner["model_type"]
            return cls.from_hf_config(inner, name=name if name is not None else str(outer))
        model_type = config.get("model_type")
        label = name if name is not None else str(config.get("_name_or_path") or model_type)
        if not _is_model_type(model_type):
            if not _is_type_name(model_type):
                raise ValueError(f"model_type={model_type!r} must be a Hugging Face model_type")
            return cls._from_other(config, label, model_type)
        if model_type == "gpt2":
            return cls._from_gpt2(config, label)
        return cls._from_llama_family(config, label, model_type)

    @classmethod
    def _from_gpt2(cls, c: Mapping[str, object], name: str) -> ModelSpec:
        # Defaults: transformers/models/gpt2/configuration_gpt2.py (GPT2Config).
        hidden = _req_int(c, "n_embd")
        heads = _req_int(c, "n_head")
        if hidden % heads:
            raise ValueError(f"n_embd={hidden} must be divisible by n_head={heads}")
        n_inner = c.get("n_inner")
        ffn = 4 * hidden if n_inner is None else _req_int(c, "n_inner")
        act = _opt(c, "activation_function", "gelu_new", _is_str, "str")
        if act not in _GELU_ACTS:
            raise ValueError(f"activation_function={act!r} must be one of {_GELU_ACTS}")
        return cls(
            name=name,
            model_type="gpt2",
            hidden=hidden,
            n_layers=_req_int(c, "n_layer"),
            n_heads=heads,
            n_kv_heads=heads,
            head_dim=hidden // heads,
            ffn=ffn,
            vocab=_req_int(c, "vocab_size"),
            max_positions=_req_int(c, "n_positions"),
            mlp="gelu",
            norm="layernorm",
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            norm_bias=True,
            qk_norm=False,
            tied_embeddings=_opt(c, "tie_word_embeddings", True, _is_bool, "bool"),
            learned_positions=True,
            attention_dropout=_prob(c, "attn_pdrop", 0.1),
            hidden_dropout=_prob(c, "resid_pdrop", 0.1),
            embedding_dropout=_prob(c, "embd_pdrop", 0.1),
            norm_eps=_opt_float(c, "layer_norm_epsilon", 1e-5),
            rope_theta=None,
        )

    @classmethod
    def _from_llama_family(
        cls, c: Mapping[str, object], name: str, model_type: ModelType
    ) -> ModelSpec:
        # Defaults: transformers/models/{llama,mistral,qwen2,qwen3}/configuration_*.py.
        hidden = _req_int(c, "hidden_size")
        heads = _req_int(c, "num_attention_heads")
        kv_default = 8 if model_type == "mistral" else heads
        kv = _opt(c, "num_key_value_heads", kv_default, is_int, "int", none_means_default=True)
        if model_type == "qwen3" and "head_dim" not in c:
            head_dim = 128  # Qwen3Config.head_dim default, not hidden // heads
        elif c.get("head_dim") is None:
            if hidden % heads:
                raise ValueError(
                    f"hidden_size={hidden} must be divisible by num_attention_heads={heads} "
                    "when head_dim is not given"
                )
            head_dim = hidden // heads
        else:
            head_dim = _req_int(c, "head_dim")
        act = _opt(c, "hidden_act", "silu", _is_str, "str")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} must be 'silu' (SwiGLU MLP) for {model_type}")
        # Biases follow each modeling file: llama and qwen3 read attention_bias for q/k/v/o;
        # qwen2 hard-codes bias on q/k/v only; mistral has none; only llama reads mlp_bias.
        if model_type in ("llama", "qwen3"):
            qkv_bias = o_bias = _opt(c, "attention_bias", False, _is_bool, "bool")
        else:
            qkv_bias, o_bias = model_type == "qwen2", False
        mlp_bias = _opt(c, "mlp_bias", False, _is_bool, "bool") if model_type == "llama" else False
        max_pos_default = {"llama": 2048, "mistral": 4096 * 32}.get(model_type, 32768)
        window: int | None = None
        if model_type == "mistral" or (
            model_type == "qwen2" and _opt(c, "use_sliding_window", False, _is_bool, "bool")
        ):
            if "sliding_window" not in c:
                window = 4096 if model_type == "mistral" else None  # MistralConfig default
            elif c["sliding_window"] is not None:
                window = _req_int(c, "sliding_window")
        return cls(
            name=name,
            model_type=model_type,
            hidden=hidden,
            n_layers=_req_int(c, "num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=kv,
            head_dim=head_dim,
            ffn=_req_int(c, "intermediate_size"),
            vocab=_req_int(c, "vocab_size"),
            max_positions=_opt(c, "max_position_embeddings", max_pos_default, is_int, "int"),
            mlp="swiglu",
            norm="rmsnorm",
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            norm_bias=False,
            qk_norm=model_type == "qwen3",
            tied_embeddings=_opt(c, "tie_word_embeddings", False, _is_bool, "bool"),
            learned_positions=False,
            attention_dropout=_prob(c, "attention_dropout", 0.0),
            hidden_dropout=0.0,
            embedding_dropout=0.0,
            norm_eps=_opt_float(c, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(c),
            sliding_window=window,
        )

    @classmethod
    def _from_other(cls, c: Mapping[str, object], name: str, model_type: str) -> ModelSpec:
        """A model of another architecture: the config is kept (``hf_config``) for
        ``calc.derive``; the size fields are read from the keys most configs share (llama's
        names, GPT-2's as a fallback) for display and for the symbols' values."""
        hidden = _first_int(c, ("hidden_size", "n_embd", "d_model"))
        heads = _first_int(c, ("num_attention_heads", "n_head", "num_heads"))
        kv = c.get("num_key_value_heads")
        n_kv = kv if is_int(kv) and kv > 0 and heads % kv == 0 else heads
        head_dim = c.get("head_dim")
        if not (is_int(head_dim) and head_dim > 0):
            head_dim = max(1, hidden // heads)
        ffn = c.get("intermediate_size", c.get("n_inner"))
        max_pos = c.get("max_position_embeddings", c.get("n_positions"))
        window = c.get("sliding_window")
        return cls(
            name=name,
            model_type=model_type,  # type: ignore[arg-type]
            hidden=hidden,
            n_layers=_first_int(c, ("num_hidden_layers", "n_layer", "num_layers")),
            n_heads=heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn=ffn if is_int(ffn) and ffn > 0 else 4 * hidden,
            vocab=_req_int(c, "vocab_size"),
            max_positions=max_pos if is_int(max_pos) and max_pos > 0 else 2048,
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            **_DERIVED_STRUCTURE,
            sliding_window=window if is_int(window) and window > 0 else None,
            hf_config=json.dumps(dict(c), sort_keys=True),
        )

    @classmethod
    def from_json(cls, text: str, name: str | None = None) -> ModelSpec:
        """Parse ``config.json`` text (JSON only, never evaluated) and read it."""
        try:
            config = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"config JSON is malformed: {exc}") from exc
        return cls.from_hf_config(config, name=name)

    def with_overrides(self, **changes: Any) -> ModelSpec:
        """A validated copy with some fields replaced (e.g. a scaled-down model); each value is
        checked by ``__post_init__`` (``ValueError`` naming the field), hence typed ``Any``."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ tensors

    def dims(self) -> dict[sp.Symbol, int]:
        """Value of each model symbol of ``calc.symbols``. ``P`` is ``max_positions`` when the
        model has a learned position table and 0 otherwise (RoPE models own no ``wpe`` rows, and
        ``P`` then appears in none of their expressions)."""
        return {
            S.h: self.hidden,
            S.L: self.n_layers,
            S.a: self.n_heads,
            S.k: self.n_kv_heads,
            S.d: self.head_dim,
            S.f: self.ffn,
            S.V: self.vocab,
            S.P: self.max_positions if self.learned_positions else 0,
        }

    def param_tensors(self, symbolic: bool = False) -> tuple[ParamTensor, ...]:
        """Every learnable tensor, in ``named_parameters()`` order; group ``"layer"`` lists one
        decoder layer. The tied LM head is omitted. ``symbolic=True`` gives shapes as sympy
        expressions of ``h, a, k, d, f, V, P``; otherwise plain ints."""
        if self.derived:
            raise NotImplementedError(
                f"model_type={self.model_type!r} is derived from its modeling code: its "
                "parameter tensors are known from the trace (calc.derive), not listed here"
            )
        dm: Mapping[sp.Symbol, Dim] = (
            {sym: sym for sym in S.MODEL_SYMBOLS} if symbolic else self.dims()
        )
        if self.model_type == "gpt2":
            return self._gpt2_tensors(dm)
        return self._llama_tensors(dm)

    def _llama_tensors(self, dm: Mapping[sp.Symbol, Dim]) -> tuple[ParamTensor, ...]:
        h, a, k, d, f, V = dm[S.h], dm[S.a], dm[S.k], dm[S.d], dm[S.f], dm[S.V]
        out: list[ParamTensor] = [ParamTensor("embed_tokens.weight", (V, h), "embedding")]

        def layer(name: str, shape: tuple[Dim, ...]) -> None:
            out.append(ParamTensor(f"layers.*.{name}", shape, "layer"))

        for proj, rows, bias in (
            ("q_proj", a * d, self.qkv_bias),
            ("k_proj", k * d, self.qkv_bias),
            ("v_proj", k * d, self.qkv_bias),
        ):
            layer(f"self_attn.{proj}.weight", (rows, h))
            if bias:
                layer(f"self_attn.{proj}.bias", (rows,))
        layer("self_attn.o_proj.weight", (h, a * d))
        if self.o_bias:
            layer("self_attn.o_proj.bias", (h,))
        if self.qk_norm:
            layer("self_attn.q_norm.weight", (d,))
            layer("self_attn.k_norm.weight", (d,))
        for proj, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
            layer(f"mlp.{proj}.weight", shape)
            if self.mlp_bias:
                layer(f"mlp.{proj}.bias", (shape[0],))
        layer("input_layernorm.weight", (h,))
        layer("post_attention_layernorm.weight", (h,))
        out.append(ParamTensor("norm.weight", (h,), "final_norm"))
        if not self.tied_embeddings:
            out.append(ParamTensor("lm_head.weight", (V, h), "head"))
        return tuple(out)

    def _gpt2_tensors(self, dm: Mapping[sp.Symbol, Dim]) -> tuple[ParamTensor, ...]:
        h, f, V, P = dm[S.h], dm[S.f], dm[S.V], dm[S.P]
        out: list[ParamTensor] = [
            ParamTensor("wte.weight", (V, h), "embedding"),
            ParamTensor("wpe.weight", (P, h), "position"),
        ]
        # Conv1D weights are [in, out] (transformers/pytorch_utils.py Conv1D).
        for name, shape in (
            ("ln_1.weight", (h,)),
            ("ln_1.bias", (h,)),
            ("attn.c_attn.weight", (h, 3 * h)),
            ("attn.c_attn.bias", (3 * h,)),
            ("attn.c_proj.weight", (h, h)),
            ("attn.c_proj.bias", (h,)),
            ("ln_2.weight", (h,)),
            ("ln_2.bias", (h,)),
            ("mlp.c_fc.weight", (h, f)),
            ("mlp.c_fc.bias", (f,)),
            ("mlp.c_proj.weight", (f, h)),
            ("mlp.c_proj.bias", (h,)),
        ):
            out.append(ParamTensor(f"h.*.{name}", shape, "layer"))
        out.append(ParamTensor("ln_f.weight", (h,), "final_norm"))
        out.append(ParamTensor("ln_f.bias", (h,), "final_norm"))
        if not self.tied_embeddings:
            out.append(ParamTensor("lm_head.weight", (V, h), "head"))
        return tuple(out)

    @property
    def n_params_expr(self) -> sp.Expr:
        """Parameter count as a sympy expression of ``h, L, a, k, d, f, V, P``."""
        return sp.sympify(_count(self.param_tensors(symbolic=True), S.L))

    @property
    def n_params(self) -> int:
        """Exact parameter count (tied embeddings counted once, like
        ``PreTrainedModel.num_parameters()``)."""
        return int(_count(self.param_tensors(), self.n_layers))


def _count(tensors: tuple[ParamTensor, ...], n_layers: Dim) -> Dim:
    total: Dim = 0
    for t in tensors:
        total += t.numel * n_layers if t.group == "layer" else t.numel
    return sp.expand(total) if isinstance(total, sp.Basic) else total


def _req_int(c: Mapping[str, object], key: str) -> int:
    if key not in c:
        raise ValueError(f"config is missing required key {key!r}")
    value = c[key]
    if isinstance(value, float) and value.is_integer() and value > 0:
        raise ValueError(
            f"{key}={value!r} must be a positive integer written without a decimal point or "
            "exponent (JSON reads it as a floating-point number)"
        )
    if not is_int(value) or value <= 0:
        raise ValueError(f"{key}={value!r} must be a positive integer")
    return value


def _is_type_name(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value) and value.replace("_", "").isalnum()


def _first_int(c: Mapping[str, object], keys: tuple[str, ...]) -> int:
    """The first of ``keys`` the config has, as a positive integer."""
    for key in keys:
        if key in c:
            return _req_int(c, key)
    raise ValueError(f"config is missing required key {keys[0]!r} (or {', '.join(keys[1:])})")


def _is_bool(value: object) -> TypeGuard[bool]:
    return isinstance(value, bool)


def _is_str(value: object) -> TypeGuard[str]:
    return isinstance(value, str)


_T = TypeVar("_T")


def _opt(
    c: Mapping[str, object],
    key: str,
    default: _T,
    is_kind: Callable[[object], TypeGuard[_T]],
    kind: str,
    *,
    none_means_default: bool = False,
) -> _T:
    """``c[key]`` checked by ``is_kind`` (a ``ValueError`` naming ``kind`` otherwise), or
    ``default`` when the key is absent."""
    if key not in c or (none_means_default and c[key] is None):
        return default
    value = c[key]
    if not is_kind(value):
        raise ValueError(f"{key}={value!r} must be of type {kind}")
    return value


def _opt_float(c: Mapping[str, object], key: str, default: float) -> float:
    """A real number ``c[key]`` as a float, or ``default`` when absent."""
    return float(_opt(c, key, default, is_real, "float"))


def _prob(c: Mapping[str, object], key: str, default: float) -> float:
    """A dropout probability ``c[key]`` in [0, 1), or ``default`` when absent."""
    value = _opt_float(c, key, default)
    if not 0 <= value < 1:
        raise ValueError(f"{key}={value!r} must be a probability in [0, 1)")
    return value


def _rope_theta(c: Mapping[str, object]) -> float:
    """``rope_theta`` from the top level or from ``rope_parameters`` (transformers >= 5);
    default 10000.0 (``RotaryEmbeddingConfigMixin.default_theta`` in modeling_rope_utils.py)."""
    params = c.get("rope_parameters")
    if "rope_theta" in c:
        return _opt_float(c, "rope_theta", 10_000.0)
    if isinstance(params, Mapping) and "rope_theta" in params:
        return _opt_float(params, "rope_theta", 10_000.0)
    return 10_000.0
