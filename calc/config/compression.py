"""Compression choices a job can carry: LoRA adapters and weight quantization (frozen configs).

``calc.Training(..., lora=calc.LoRA(rank=16), quant=calc.Quant(method="nf4"))`` is QLoRA;
``calc.Inference(..., quant=calc.Quant(method="int4"), kv_quant="int8")`` serves a 4-bit model
with an 8-bit KV cache. The byte counts these imply live in ``calc.compress.quant`` (weights and KV) and
in the replay (LoRA); this module only says what the user chose, validated at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from calc.config.checks import is_int, is_real

QuantMethod = Literal["int8", "int4", "nf4", "fp8"]
ScaleDtype = Literal["fp32", "fp16", "bf16"]
FP8Scaling = Literal["tensor", "row"]
AdapterDtype = Literal["fp32", "bf16", "fp16"]
KVQuant = Literal["int8", "fp8"]
LoraModule = Literal["q", "k", "v", "o", "gate", "up", "down", "lm_head"]
Keep16 = Literal["embed", "norm", "lm_head"]

QUANT_METHODS: tuple[str, ...] = get_args(QuantMethod)
SCALE_DTYPES: tuple[str, ...] = get_args(ScaleDtype)
FP8_SCALINGS: tuple[str, ...] = get_args(FP8Scaling)
ADAPTER_DTYPES: tuple[str, ...] = get_args(AdapterDtype)
KV_QUANTS: tuple[str, ...] = get_args(KVQuant)
LORA_MODULES: tuple[str, ...] = get_args(LoraModule)
DECODER_LORA_MODULES: tuple[LoraModule, ...] = ("q", "k", "v", "o", "gate", "up", "down")
"""The decoder layers' linears: `LoRA`'s default (``lm_head``, LitGPT's ``lora_head``, is not)."""
KEEP_16BIT: tuple[str, ...] = get_args(Keep16)

MAX_RANK = 1 << 16
"""Largest LoRA rank accepted (beyond any real adapter; guards typos)."""
MAX_GROUP = 1 << 20
"""Largest quantization group size accepted, in elements."""
NF4_BLOCK_SIZES: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
"""Block sizes ``bitsandbytes.functional.quantize_4bit`` accepts (``blocksize`` argument)."""
NF4_NESTED_BLOCK = 256
"""Block of the second-level (double) quantization of the NF4 absmax values: bitsandbytes
``quantize_4bit(compress_statistics=True)`` calls ``quantize_blockwise(absmax, blocksize=256)``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRA:
    """Low-rank adapters ``W x + (alpha / rank) * B(A x)`` on chosen linears of every layer
    (Hu et al. 2021, arXiv 2106.09685): the base is frozen, only ``A`` and ``B`` train."""

    rank: int
    """Adapter rank ``r``: ``A`` is ``[r, in]``, ``B`` is ``[out, r]``; in [1, 65536]."""
    alpha: float | None = None
    """Scaling numerator (``lora_alpha``); the update is scaled by ``alpha / rank``. ``None``
    means ``alpha = rank`` (scale 1). It changes values, not memory."""
    modules: tuple[LoraModule, ...] = DECODER_LORA_MODULES
    """Which projections of each decoder layer get an adapter (llama-family names: ``q``,
    ``k``, ``v``, ``o`` attention, ``gate``, ``up``, ``down`` MLP), and ``lm_head`` for the
    output head (LitGPT's ``lora_head``; ``implementation="litgpt"`` only). Default: the
    seven of the layers, as in the QLoRA paper (Dettmers et al. 2023, §4)."""
    adapter_dtype: AdapterDtype | None = None
    """Dtype of ``A``, ``B``, their grads and the adapter path's activations. ``None``: the
    training precision's parameter dtype."""
    dropout: float = 0.0
    """``lora_dropout``: dropout on each adapter's input, ``B(A(dropout(x)))`` (peft
    ``tuners/lora/layer.py``); in [0, 1). Above 0 every adapted linear keeps a dropped copy of
    its input for ``A``'s gradient and the dropout mask (CUDA: 1 byte per element; CPU: in the
    input's dtype), as `calc.replay.ops.dropout` replays."""

    def __post_init__(self) -> None:
        if not is_int(self.rank) or not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank={self.rank!r} must be an integer in [1, {MAX_RANK}]")
        if self.alpha is not None:
            if not is_real(self.alpha) or not self.alpha > 0:
                raise ValueError(f"alpha={self.alpha!r} must be a number > 0 or None")
        if not isinstance(self.modules, tuple) or not self.modules:
            raise ValueError(
                f"modules={self.modules!r} must be a non-empty tuple of {LORA_MODULES}"
            )
        for m in self.modules:
            if m not in LORA_MODULES:
                raise ValueError(f"modules entry {m!r} is not one of {LORA_MODULES}")
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"modules={self.modules!r} lists a module twice")
        if not is_real(self.dropout) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout!r} must be a number in [0, 1)")
        if self.adapter_dtype is not None and self.adapter_dtype not in ADAPTER_DTYPES:
            raise ValueError(
                f"adapter_dtype={self.adapter_dtype!r} must be one of {ADAPTER_DTYPES} or None"
            )

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on the adapter's output."""
        return (self.rank if self.alpha is None else self.alpha) / self.rank


@dataclass(frozen=True, kw_only=True, slots=True)
class Quant:
    """Weight-only quantization of the decoder layers' linear weights (q, k, v, o, gate, up,
    down); biases and everything named in ``keep_16bit`` stay in the job's 16-bit dtype.

    - ``int8`` / ``int4``: integers with one scale (and, with ``zero_point``, one zero point)
      per group of ``group_size`` input elements of a row, or per row with ``group_size=None``
      (int8 default: per-row symmetric absmax as in LLM.int8(), Dettmers et al. 2022; int4
      default: groups of 128 with zero points, as GPTQ and AWQ ship). int4 packs two per byte.
    - ``nf4``: 4-bit NormalFloat with an absmax per block of ``group_size`` (default 64),
      double-quantized to uint8 per block plus an fp32 absmax per 256 blocks when
      ``double_quant`` (QLoRA, Dettmers et al. 2023, §3; bitsandbytes ``quantize_4bit``).
    - ``fp8``: e4m3 values with one fp32 scale per tensor or per output row (``fp8_scaling``).
    """

    method: QuantMethod
    """``int8``, ``int4``, ``nf4`` or ``fp8`` (e4m3)."""
    group_size: int | None = None
    """Elements of a row sharing one scale. ``None``: the method's default (int8: the whole
    row; int4: 128; nf4: 64). Not allowed for fp8 (use ``fp8_scaling``). Must divide the
    input width of every quantized linear when a model is applied."""
    zero_point: bool | None = None
    """int8/int4 only: asymmetric quantization with a zero point per group, stored like the
    scale. ``None``: int8 symmetric, int4 asymmetric."""
    scale_dtype: ScaleDtype | None = None
    """Dtype of int8/int4 scales and zero points. ``None``: int8 fp32 (bitsandbytes ``SCB``),
    int4 fp16 (GPTQ/AWQ). nf4 absmax and fp8 scales are always fp32."""
    double_quant: bool = True
    """nf4 only: quantize the per-block absmax to uint8 (blocks of 256, fp32 second-level
    absmax), bitsandbytes ``compress_statistics``; QLoRA's double quantization."""
    fp8_scaling: FP8Scaling = "tensor"
    """fp8 only: one fp32 scale per tensor or one per output row."""
    keep_16bit: tuple[Keep16, ...] = ("embed", "norm", "lm_head")
    """What stays unquantized, in the job's 16-bit dtype: token embedding, norm weights (always:
    they are vectors, no weight-only scheme quantizes them) and the LM head. Removing
    ``embed`` or ``lm_head`` quantizes that matrix too with the same scheme."""

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ValueError(f"method={self.method!r} is not one of {QUANT_METHODS}")
        self._check_group_size()
        self._check_integer_options()
        self._check_storage()

    def _check_group_size(self) -> None:
        """``group_size``: None, or an int the method accepts (even for int4, a bitsandbytes
        block size for nf4, never for fp8)."""
        if self.group_size is not None:
            if self.method == "fp8":
                raise ValueError(
                    f"group_size={self.group_size!r} is not used by method='fp8': "
                    "choose fp8_scaling='tensor' or 'row'"
                )
            if not is_int(self.group_size) or not 1 <= self.group_size <= MAX_GROUP:
                raise ValueError(
                    f"group_size={self.group_size!r} must be an integer in [1, {MAX_GROUP}] or None"
                )
            if self.method == "int4" and self.group_size % 2:
                raise ValueError(
                    f"group_size={self.group_size} must be even for int4 (two values a byte)"
                )
            if self.method == "nf4" and self.group_size not in NF4_BLOCK_SIZES:
                raise ValueError(
                    f"group_size={self.group_size} must be one of {NF4_BLOCK_SIZES} for nf4 "
                    "(bitsandbytes block sizes)"
                )

    def _check_integer_options(self) -> None:
        """``zero_point`` and ``scale_dtype``: int8/int4 only."""
        if self.zero_point is not None:
            if not isinstance(self.zero_point, bool):
                raise ValueError(f"zero_point={self.zero_point!r} must be a bool or None")
            if self.method not in ("int8", "int4"):
                raise ValueError(
                    f"zero_point={self.zero_point} applies to int8/int4 only, "
                    f"not method={self.method!r}"
                )
        if self.scale_dtype is not None:
            if self.scale_dtype not in SCALE_DTYPES:
                raise ValueError(
                    f"scale_dtype={self.scale_dtype!r} must be one of {SCALE_DTYPES} or None"
                )
            if self.method not in ("int8", "int4"):
                raise ValueError(
                    f"scale_dtype={self.scale_dtype!r} applies to int8/int4 only "
                    f"(method={self.method!r} stores fp32 scales)"
                )

    def _check_storage(self) -> None:
        """``double_quant``, ``fp8_scaling`` and ``keep_16bit`` (which must keep the norms)."""
        if not isinstance(self.double_quant, bool):
            raise ValueError(f"double_quant={self.double_quant!r} must be a bool")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise ValueError(f"fp8_scaling={self.fp8_scaling!r} must be one of {FP8_SCALINGS}")
        if not isinstance(self.keep_16bit, tuple):
            raise ValueError(f"keep_16bit={self.keep_16bit!r} must be a tuple of {KEEP_16BIT}")
        for item in self.keep_16bit:
            if item not in KEEP_16BIT:
                raise ValueError(f"keep_16bit entry {item!r} is not one of {KEEP_16BIT}")
        if "norm" not in self.keep_16bit:
            raise ValueError(
                f"keep_16bit={self.keep_16bit!r} must include 'norm': norm weights are vectors "
                "that weight-only schemes do not quantize"
            )

    @property
    def group(self) -> int | None:
        """The group size in force (``None``: one group per row, or fp8's per-tensor/row)."""
        if self.group_size is not None:
            return self.group_size
        return {"int8": None, "int4": 128, "nf4": 64, "fp8": None}[self.method]

    @property
    def has_zero_point(self) -> bool:
        """Whether int8/int4 groups store a zero point beside the scale."""
        if self.zero_point is not None:
            return self.zero_point
        return self.method == "int4"

    @property
    def scale_bytes(self) -> int:
        """Bytes of one scale (and of one zero point) of an int8/int4 group."""
        dtype = self.scale_dtype or ("fp32" if self.method == "int8" else "fp16")
        return 4 if dtype == "fp32" else 2


def check_kv_quant(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is ``None``, ``"int8"`` or ``"fp8"``."""
    if value is not None and value not in KV_QUANTS:
        raise ValueError(f"kv_quant={value!r} must be one of {KV_QUANTS} or None")


def check_lora_quant(lora: object, quant: object) -> None:
    """Validate ``Training``'s ``lora``/``quant`` fields: their types, and that a quantized
    base trains only through adapters (weight-only integer weights get no gradient)."""
    if lora is not None and not isinstance(lora, LoRA):
        raise ValueError(f"lora={lora!r} must be a calc.LoRA or None")
    if quant is not None and not isinstance(quant, Quant):
        raise ValueError(f"quant={quant!r} must be a calc.Quant or None")
    if quant is not None and lora is None:
        raise ValueError(
            f"quant={quant!r} needs lora=calc.LoRA(...): a quantized base is frozen, so only "
            "adapters can train (QLoRA); full fine-tuning of quantized weights is not modelled"
        )
