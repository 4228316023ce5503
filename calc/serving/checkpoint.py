"""The weight format vLLM loads: the checkpoint's own (``config.json``'s
``quantization_config``) unless ``--quantization`` names one.

vLLM's rule (``ModelConfig._verify_quantization``, ``vllm/config.py`` in 0.6.4-0.10.x,
``vllm/config/model.py`` from 0.11; the same in every release modelled): the checkpoint's
``quantization_config`` (``_parse_quant_hf_config``: ``hf_config.quantization_config``, else
the older ``compression_config`` of compressed-tensors) gives ``quant_method``; with
``--quantization`` unset vLLM takes it (``self.quantization = quant_method``, after the Marlin
overrides such as ``gptq`` -> ``gptq_marlin``, which keep the storage); a ``--quantization``
that differs raises "Quantization method specified in the model config (...) does not match
the quantization method specified in the `quantization` argument (...)". `calc.Serving.quant`
is a storage format, not a method name, so an explicit ``quant=`` is taken as the user's
statement of the checkpoint's format (its note says so).

The methods read (each method's ``create_weights``, ``vllm/model_executor/layers/
quantization/``), as storage of the decoder linears (embedding, head and MoE router stay in
``dtype``):

* ``fp8`` (``Fp8Config``): one byte per weight; ``weight_block_size`` ``[bn, bk]`` (DeepSeek-V3,
  Qwen3-FP8) stores an fp32 ``weight_scale_inv`` of ``cdiv(out, bn) x cdiv(in, bk)`` per
  linear (``Fp8LinearMethod.create_weights``, ``BlockQuantScaleParameter``; FusedMoE's
  ``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` the same per expert); without it one fp32
  scale per merged shard (per-tensor);
* ``gptq``, ``gptq_marlin``, ``awq``, ``awq_marlin`` with ``bits`` 4 (``w_bit`` for AWQ):
  ``w4a16``, half a byte per weight and an fp16 scale per ``group_size`` inputs
  (``group_size`` -1: one group, per channel); zero points and ``g_idx`` are not counted;
* ``compressed-tensors`` (``CompressedTensorsConfig``): each of ``config_groups``' ``weights``
  (``num_bits``, ``type``, ``strategy``, ``group_size``, ``block_structure``) and
  ``input_activations``: 8-bit float weights -> ``fp8`` (scales per ``tensor`` shard,
  ``channel`` or ``block``), 8-bit int weights with 8-bit int activations -> ``w8a8``
  (``channel`` or ``tensor`` scales), 4-bit int weights without activations -> ``w4a16``
  (``group``/``channel``); every group must agree.

Any other declaration (bitsandbytes, GGUF, NVFP4, int8 weight-only, modelopt, ...) is not
modelled: the weights stay in ``dtype`` (an over-estimate) and a note names the field and
value; pass ``quant=`` for a format calc knows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from calc.config.serving import Serving, ServingQuant

Scales = Literal["tensor", "channel", "block", "group"]

W4_GROUP = 128
"""Group size ``quant="w4a16"`` assumes (GPTQ/AWQ's usual 128)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightFormat:
    """How the decoder linears of a checkpoint are stored."""

    kind: ServingQuant
    """``fp8`` or ``w8a8`` (one byte per weight) or ``w4a16`` (half a byte)."""
    scales: Scales
    """``tensor``: one fp32 scale per merged shard; ``channel``: fp32 per output row;
    ``block``: fp32 per ``block`` tile; ``group``: fp16 per ``group`` inputs per row."""
    block: tuple[int, int] = (128, 128)
    """``[out, in]`` tile of the block scales (``weight_block_size``)."""
    group: int = W4_GROUP
    """Inputs per scale of the ``group`` scales (-1 in a config: the whole row)."""

    def __post_init__(self) -> None:
        if self.block[0] <= 0 or self.block[1] <= 0:
            raise ValueError(f"block={self.block!r} must be two positive sizes")
        if self.group <= 0:
            raise ValueError(f"group={self.group!r} must be positive")

    def describe(self) -> str:
        """A few words for the notes, e.g. ``fp8, [128, 128] block scales``."""
        if self.scales == "block":
            return f"{self.kind}, {list(self.block)} block scales"
        if self.scales == "group":
            return f"{self.kind}, group {self.group}"
        return f"{self.kind}, per-{self.scales} scales"


USER_FORMATS: dict[str, WeightFormat] = {
    "fp8": WeightFormat(kind="fp8", scales="tensor"),
    "w8a8": WeightFormat(kind="w8a8", scales="channel"),
    "w4a16": WeightFormat(kind="w4a16", scales="group", group=W4_GROUP),
}
"""What ``quant=`` stands for: per-tensor fp8, int8 per channel, int4 group 128."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Declared:
    """A config's ``quantization_config`` as calc reads it."""

    method: str
    """``quant_method`` (lower case), e.g. ``fp8``, ``gptq``, ``compressed-tensors``."""
    format: WeightFormat | None
    """The storage it declares; ``None``: a scheme calc does not model."""
    reason: str = ""
    """Why ``format`` is ``None``: the field and value calc cannot map."""


def _field(c: Mapping[str, object], key: str) -> object:
    return c.get(key)


def _size(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"quantization_config {what}={value!r} must be an integer")
    return value


def _fp8(c: Mapping[str, object]) -> Declared:
    block = _field(c, "weight_block_size")
    if block is None:
        return Declared(method="fp8", format=WeightFormat(kind="fp8", scales="tensor"))
    if not isinstance(block, list) or len(block) != 2:
        raise ValueError(f"quantization_config weight_block_size={block!r} must be [n, k]")
    n, k = (_size(b, "weight_block_size") for b in block)
    return Declared(method="fp8", format=WeightFormat(kind="fp8", scales="block", block=(n, k)))


def _int4(c: Mapping[str, object], method: str) -> Declared:
    bits = c.get("bits", c.get("w_bit"))
    if bits != 4:
        return Declared(method=method, format=None, reason=f"bits={bits!r} (only 4 is modelled)")
    group = _size(c.get("group_size", c.get("q_group_size", W4_GROUP)), "group_size")
    if group == -1:
        return Declared(method=method, format=WeightFormat(kind="w4a16", scales="channel"))
    if group <= 0:
        raise ValueError(f"quantization_config group_size={group!r} must be positive or -1")
    return Declared(method=method, format=WeightFormat(kind="w4a16", scales="group", group=group))


def _ct_group(name: str, group: object) -> WeightFormat | str:
    """One compressed-tensors scheme -> its format, or why it is not modelled."""
    if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
        return f"config_groups.{name}.weights is missing"
    w = group["weights"]
    acts = group.get("input_activations")
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    scheme = f"config_groups.{name}: weights num_bits={bits!r} type={kind!r} strategy={strategy!r}"
    act_bits = acts.get("num_bits") if isinstance(acts, Mapping) else None
    if bits == 8 and kind == "float" and strategy in ("tensor", "channel", "block"):
        if strategy == "block":
            shape = w.get("block_structure") or [128, 128]
            if not isinstance(shape, list) or len(shape) != 2:
                return f"{scheme}, block_structure={shape!r}"
            n, k = (_size(s, "block_structure") for s in shape)
            return WeightFormat(kind="fp8", scales="block", block=(n, k))
        return WeightFormat(kind="fp8", scales=strategy)
    if bits == 8 and kind == "int" and act_bits == 8 and strategy in ("tensor", "channel"):
        return WeightFormat(kind="w8a8", scales=strategy)
    if bits == 4 and kind == "int" and acts is None and strategy in ("group", "channel"):
        if strategy == "channel":
            return WeightFormat(kind="w4a16", scales="channel")
        size = _size(w.get("group_size"), "group_size")
        if size <= 0:
            return f"{scheme}, group_size={size!r}"
        return WeightFormat(kind="w4a16", scales="group", group=size)
    return f"{scheme}, input_activations num_bits={act_bits!r}"


def _compressed(c: Mapping[str, object]) -> Declared:
    method = "compressed-tensors"
    groups = c.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        return Declared(method=method, format=None, reason="no config_groups")
    if c.get("sparsity_config"):
        return Declared(method=method, format=None, reason="sparsity_config (2:4 sparse)")
    found = [_ct_group(str(name), group) for name, group in groups.items()]
    reasons = [f for f in found if isinstance(f, str)]
    if reasons:
        return Declared(method=method, format=None, reason="; ".join(reasons))
    formats = {f for f in found if isinstance(f, WeightFormat)}
    if len(formats) > 1:
        return Declared(method=method, format=None, reason="config_groups of different schemes")
    return Declared(method=method, format=formats.pop())


def declared(config: Mapping[str, object]) -> Declared | None:
    """The ``quantization_config`` (or ``compression_config``) of a ``config.json`` dict;
    ``None`` if it declares none. ``ValueError`` naming the field for malformed values."""
    quant = config.get("quantization_config")
    if quant is None:
        quant = config.get("compression_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise ValueError(f"config key 'quantization_config' must be an object, got {quant!r}")
    raw = quant.get("quant_method", "")
    method = raw.lower() if isinstance(raw, str) else ""
    if method == "fp8":
        return _fp8(quant)
    if method in ("gptq", "gptq_marlin", "awq", "awq_marlin"):
        return _int4(quant, method)
    if method == "compressed-tensors":
        return _compressed(quant)
    return Declared(method=method or repr(raw), format=None, reason=f"quant_method={raw!r}")


def weight_format(
    checkpoint: Declared | None, serving: Serving
) -> tuple[WeightFormat | None, tuple[str, ...]]:
    """(the format vLLM loads the decoder linears in, ``None`` for ``dtype``; the notes): the
    user's ``quant=`` if given (``--quantization``), else the checkpoint's declaration."""
    if serving.quant is not None:
        fmt = USER_FORMATS[serving.quant]
        if checkpoint is None:
            return fmt, (f"weights: quant={serving.quant!r} ({fmt.describe()}), as given",)
        return fmt, (
            f"weights: quant={serving.quant!r} ({fmt.describe()}) given, overriding the "
            f"config's quantization_config (quant_method={checkpoint.method}); vLLM itself "
            "refuses a --quantization that differs from the checkpoint's method",
        )
    if checkpoint is None:
        return None, ()
    if checkpoint.format is None:
        return None, (
            f"weights: the config's quantization_config is not modelled ({checkpoint.reason}): "
            f"counted in {serving.dtype}, more than vLLM loads; pass quant= for a format calc "
            "knows (fp8, w8a8, w4a16)",
        )
    return checkpoint.format, (
        f"weights: the checkpoint's quantization_config (quant_method={checkpoint.method}: "
        f"{checkpoint.format.describe()}), as vLLM loads it without --quantization",
    )
