"""``calc.Serving``: a vLLM server's start-up settings, as its command-line flags name them.

Each field is one ``vllm serve`` flag (``--gpu-memory-utilization``, ``--max-model-len``,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--tensor-parallel-size``,
``--pipeline-parallel-size``, ``--dtype``, ``--kv-cache-dtype``, ``--quantization``,
``--block-size``, ``--enforce-eager``); ``None`` stands for the engine's own default for that
version and GPU, which ``calc.serving.engine`` resolves from vLLM's source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from calc.config.checks import check_bool, check_choice, check_size, is_real

Engine = Literal["vllm"]
ServingDtype = Literal["bf16", "fp16", "fp32"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
ServingQuant = Literal["fp8", "w8a8", "w4a16"]
Entrypoint = Literal["serve", "llm"]
Sampler = Literal["auto", "pytorch", "flashinfer"]

ENGINES: tuple[str, ...] = ("vllm",)
SERVING_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
SERVING_QUANTS: tuple[str, ...] = ("fp8", "w8a8", "w4a16")
ENTRYPOINTS: tuple[str, ...] = ("serve", "llm")
SAMPLERS: tuple[str, ...] = ("auto", "pytorch", "flashinfer")
BLOCK_SIZES: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)
"""``--block-size`` choices of vLLM's ``CacheConfig`` (``vllm/config/cache.py``, ``BlockSize``)."""
DEFAULT_BLOCK_SIZE = 16
"""The block size vLLM's CUDA platform sets when ``--block-size`` is not given
(``vllm/platforms/cuda.py`` ``check_and_update_config``: ``cache_config.block_size = 16``);
`calc.serving.engine.block_size` applies what vLLM forces for MLA models on top of it."""
OLDEST_VERSION = (0, 6, 4)
"""Oldest vLLM modelled: 0.6.4 is the first to log the memory profile this accounting follows
(``vllm/worker/worker.py`` ``determine_num_available_blocks``, PR #10511)."""
NEWEST_VERSION = (0, 21, 99)
"""Newest vLLM family modelled (0.21.x)."""
DEFAULT_VLLM_VERSION = "0.19.0"
RELEASES: tuple[str, ...] = (
    "0.6.4", "0.7.3", "0.8.5", "0.9.2", "0.10.1", "0.10.2", "0.11.0", "0.15.1", "0.19.0",
    "0.20.0", "0.21.0",
)  # fmt: skip
"""Releases offered by the web app's Serve page (any release in range is accepted)."""
"""The release `Serving` assumes when none is named."""


def parse_version(text: object) -> tuple[int, int, int]:
    """``"0.19.0"`` -> ``(0, 19, 0)``; ``ValueError`` naming ``vllm_version`` otherwise (a
    ``.postN``/``rcN`` suffix on the patch number is ignored)."""
    if not isinstance(text, str):
        raise ValueError(f"vllm_version={text!r} must be a string such as '0.19.0'")
    parts = text.strip().split(".")
    if len(parts) < 2 or len(parts) > 4:
        raise ValueError(f"vllm_version={text!r} must look like MAJOR.MINOR.PATCH, e.g. '0.19.0'")
    numbers = []
    for part in parts[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            raise ValueError(f"vllm_version={text!r} must look like MAJOR.MINOR.PATCH")
        numbers.append(int(digits))
    while len(numbers) < 3:
        numbers.append(0)
    return numbers[0], numbers[1], numbers[2]


@dataclass(frozen=True, kw_only=True, slots=True)
class Serving:
    """A vLLM server's memory-relevant start-up settings (one engine instance).

    >>> Serving(vllm_version="0.19.0", gpu_memory_utilization=0.9, max_model_len=32768)
    ... # doctest: +ELLIPSIS
    Serving(engine='vllm', vllm_version='0.19.0', ...)
    """

    engine: Engine = "vllm"
    """The serving engine; only vLLM is modelled."""
    vllm_version: str = DEFAULT_VLLM_VERSION
    """vLLM release (``MAJOR.MINOR.PATCH``); the defaults and the accounting follow it."""
    gpu_memory_utilization: float = 0.9
    """``--gpu-memory-utilization``: the fraction of the driver's total memory
    (``cudaMemGetInfo``) this instance may use, in (0, 1]."""
    max_model_len: int | None = None
    """``--max-model-len``: the longest request (prompt + output) in tokens; ``None``: the
    model's ``max_position_embeddings``."""
    max_num_seqs: int | None = None
    """``--max-num-seqs``: requests scheduled together; ``None``: the version's default."""
    max_num_batched_tokens: int | None = None
    """``--max-num-batched-tokens``: tokens per scheduler step (the profiling forward's size);
    ``None``: the version's default for this GPU and entry point."""
    tensor_parallel: int = 1
    """``--tensor-parallel-size``: GPUs each layer is split over."""
    pipeline_parallel: int = 1
    """``--pipeline-parallel-size``: GPUs the layers are staged over."""
    dtype: ServingDtype = "bf16"
    """``--dtype``: weights and activations."""
    kv_cache_dtype: KVCacheDtype = "auto"
    """``--kv-cache-dtype``: ``auto`` stores the cache in ``dtype``; ``fp8*`` in one byte."""
    quant: ServingQuant | None = None
    """``--quantization``: the checkpoint's weight format, ``fp8`` (W8A8 fp8, per-tensor
    scales), ``w8a8`` (int8 per-channel) or ``w4a16`` (int4 weights, group 128,
    GPTQ/AWQ/compressed-tensors); ``None``: as vLLM, the format the model's ``config.json``
    declares in ``quantization_config`` (`calc.serving.checkpoint`), else ``dtype`` weights."""
    block_size: int | None = None
    """``--block-size``: tokens per KV-cache block; ``None``: vLLM's default, 16, or what
    vLLM forces for an MLA model on this GPU and version (`calc.serving.engine.block_size`)."""
    enforce_eager: bool = False
    """``--enforce-eager``: no CUDA graphs (none captured, none accounted)."""
    expert_parallel: bool = False
    """``--enable-expert-parallel``: MoE experts spread over the tensor-parallel ranks (each
    rank holds ``E / tp`` whole experts) instead of each expert split over them."""
    entrypoint: Entrypoint = "serve"
    """How vLLM is started: ``serve`` (OpenAI server, ``UsageContext.OPENAI_API_SERVER``) or
    ``llm`` (the ``vllm.LLM`` class, ``UsageContext.LLM_CLASS``); the defaults differ."""
    sampler: Sampler = "auto"
    """Top-k/top-p sampler of the profiling run: ``flashinfer`` where vLLM logs "Using
    FlashInfer for top-p & top-k sampling" (FlashInfer installed, as in vLLM's Docker images),
    ``pytorch`` where it logs "FlashInfer is not available" (a plain ``pip install vllm``);
    ``auto``: PyTorch's up to 0.19, the lighter profiling sampler of 2026 releases from 0.20."""

    def __post_init__(self) -> None:
        check_choice("engine", self.engine, ENGINES)
        version = parse_version(self.vllm_version)
        if not OLDEST_VERSION <= version <= NEWEST_VERSION:
            raise ValueError(
                f"vllm_version={self.vllm_version!r} is out of range: modelled 0.6.4 to 0.21.x"
            )
        util = self.gpu_memory_utilization
        if not is_real(util) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization={util!r} must be a number in (0, 1]")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None:
                check_size(name, value, 1, 1 << 24)
        check_size("tensor_parallel", self.tensor_parallel, 1, 1024)
        check_size("pipeline_parallel", self.pipeline_parallel, 1, 1024)
        check_choice("dtype", self.dtype, SERVING_DTYPES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quant is not None:
            check_choice("quant", self.quant, SERVING_QUANTS)
        if self.block_size is not None and (
            self.block_size not in BLOCK_SIZES or isinstance(self.block_size, bool)
        ):
            raise ValueError(
                f"block_size={self.block_size!r} is not one of "
                f"{', '.join(map(str, BLOCK_SIZES))} (or None: vLLM's default)"
            )
        check_bool("enforce_eager", self.enforce_eager)
        check_bool("expert_parallel", self.expert_parallel)
        check_choice("entrypoint", self.entrypoint, ENTRYPOINTS)
        check_choice("sampler", self.sampler, SAMPLERS)

    @property
    def version(self) -> tuple[int, int, int]:
        """``vllm_version`` as a comparable tuple."""
        return parse_version(self.vllm_version)
