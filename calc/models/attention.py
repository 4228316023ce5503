"""Which attention kernel runs, and therefore which tensors attention saves.

``F.scaled_dot_product_attention`` picks a kernel at run time. On CUDA, torch 2.13 tries its
priority order (``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``,
read at pytorch/pytorch@001f694: flash, efficient, math; cuDNN first only on sm90/sm100 with
cuDNN > 9.15, ``check_prefer_cudnn_attention``). Flash needs fp16/bf16
(``check_dtypes_flash_attention``) and a head dimension up to 256
(``check_head_dim_size_flash``; not a multiple of 8 is padded); memory-efficient also takes
fp32; math takes anything. **Dropout does not exclude flash or efficient on CUDA**: neither
``can_use_flash_attention``'s nor ``can_use_mem_efficient_attention``'s constraint lists test
``params.dropout`` (only ``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``,
for head dims in (224, 256] on sm86/89/120, and cuDNN's ``check_cudnn_dropout``, which wants a
multiple of 1/16, do). Each kernel saves different tensors (flash: out and an fp32 logsumexp
[b, a, s]; memory-efficient: the logsumexp padded to a multiple of 32 along s; math: the
s x s probabilities), so the choice is a term of the estimate.

The CPU harness forces the same family (``torch.nn.attention.sdpa_kernel``): flash, efficient
and cuDNN map to the CPU flash kernel, which has no dropout ("Both fused kernels do not support
non-zero dropout", ``sdp_utils_cpp.h``): with attention dropout the CPU run takes math
(`cpu_backend`). `kernel_for` is the one place that applies the device.
Not yet checked on a GPU: this file states the rules as read in the source.
"""

from __future__ import annotations

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec


def attention_kernel(model: ModelSpec, job: Training | Inference) -> str:
    """The attention kernel the job runs on CUDA: ``flash``, ``efficient``, ``math`` or
    ``eager`` (softmax attention written out in the modeling code)."""
    if job.attention != "sdpa":
        return job.attention
    sixteen_bit = job.precision != "fp32"
    head_ok = model.head_dim % 8 == 0 and model.head_dim <= 256
    if sixteen_bit and head_ok:
        return "flash"
    if head_ok:
        return "efficient"
    return "math"


def cpu_backend(kernel: str, attn_dropout: float = 0.0) -> str:
    """The CPU SDPA backend that stands for a CUDA kernel: ``flash`` or ``math`` (or eager).

    CPU's fused kernel has no dropout ("Both fused kernels do not support non-zero dropout",
    ``sdp_utils_cpp.h``): with attention dropout the CPU run takes math."""
    if kernel in ("flash", "efficient") and attn_dropout > 0:
        return "math"
    return {"flash": "flash", "efficient": "flash", "math": "math", "eager": "eager"}[kernel]


def kernel_for(
    model: ModelSpec, job: Training | Inference, device: str, attn_dropout: float
) -> str:
    """The kernel the replay runs on ``device``: `attention_kernel` on CUDA (dropout keeps the
    fused kernels, see the module docstring), `cpu_backend` of it on the CPU tracker."""
    kernel = attention_kernel(model, job)
    return kernel if device == "cuda" else cpu_backend(kernel, attn_dropout)


FLASH_HEAD_ROUNDING = ((128, 32), (256, 64))
"""``head_size_rounded = round_multiple(head_size, head_size <= 128 ? 32 : 64)`` in ``mha_bwd``
(``flash_attn/flash_api.cpp``), after ``head_size = round_multiple(head_size_og, 8)``."""


def flash_head_pad(head_dim: int) -> int:
    """``head_size_rounded - head_dim`` of the CUDA flash backward's ``dq_accum``."""
    size = -(-head_dim // 8) * 8
    step = next((m for limit, m in FLASH_HEAD_ROUNDING if size <= limit), 64)
    return -(-size // step) * step - head_dim
