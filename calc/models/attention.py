"""Which attention kernel runs, and therefore which tensors attention saves.

``F.scaled_dot_product_attention`` picks a kernel at run time. On CUDA, torch 2.13 tries
cuDNN, flash, memory-efficient and math in priority order (``torch._C._get_sdp_priority_order``,
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``): flash needs fp16/bf16 and a head
dimension that is a multiple of 8 up to 256; memory-efficient also takes fp32; math takes
anything. Each saves different tensors (flash: out and an fp32 logsumexp [b, a, s];
memory-efficient: the logsumexp padded to a multiple of 32 along s; math: the s x s
probabilities), so the choice is a term of the estimate. The CPU harness forces the same family
(``torch.nn.attention.sdpa_kernel``): flash, efficient and cuDNN map to the CPU flash kernel.
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
