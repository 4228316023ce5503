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

**Grouped-query attention excludes memory-efficient on CUDA.** When the modeling code hands SDPA
the un-expanded key/value heads (``enable_gqa=True``: transformers' ``sdpa_attention_forward``
when ``use_gqa_in_sdpa`` holds, i.e. no mask and equal head dims <= 256; verify's reference
models), flash accepts it (``backend_supports_grouped_query_attention = true`` in
``can_use_flash_attention``) but memory-efficient does not: its dense constraints instantiate
``check_batch_size_and_num_heads_dense<false /*supports_grouped_query_attention=*/>``
(``sdp_utils.cpp``, ``can_use_mem_efficient_attention``). So fp32 GQA attention runs math (the
s x s probabilities) on CUDA. Measured on an H200 (verify/measurements/, torch 2.11): forcing
efficient on fp32 GQA raises "No available kernel", and PyTorch warns "both fused kernels require
query, key and value to have the same num_heads". torchtune expands k/v before SDPA (no
``enable_gqa``), so efficient stays available there.

The inputs' dtype is the forward's compute dtype: an fp32 model under FSDP's mixed-precision
policy with ``param_dtype=bfloat16`` (torchtitan's recipe) computes in bf16, so CUDA runs flash
there (`compute_16bit_of`).

The CPU harness forces the same family (``torch.nn.attention.sdpa_kernel``): flash, efficient
and cuDNN map to the CPU flash kernel, which has no dropout ("Both fused kernels do not support
non-zero dropout", ``sdp_utils_cpp.h``): with attention dropout the CPU run takes math
(`cpu_backend`). `kernel_for` is the one place that applies the device.
Checked on a GPU (verify/measurements/): the kernel each case forces runs, and the saved tensors
it implies match ``max_memory_allocated``.
"""

from __future__ import annotations

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec

EXPANDS_KV_IMPLEMENTATIONS = ("torchtune", "litgpt")
"""Implementations that expand key/value heads before SDPA (no ``enable_gqa``)."""


def gqa_in_sdpa(model: ModelSpec, job: Training | Inference) -> bool:
    """Whether SDPA receives fewer key/value heads than query heads (``enable_gqa=True``): a GQA
    model whose modeling code does not expand k/v first (module docstring)."""
    return model.n_kv_heads < model.n_heads and job.implementation not in EXPANDS_KV_IMPLEMENTATIONS


def attention_kernel(
    model: ModelSpec, job: Training | Inference, compute_16bit: bool = False
) -> str:
    """The attention kernel the job runs on CUDA: ``flash``, ``efficient``, ``math`` or
    ``eager`` (softmax attention written out in the modeling code). Flash needs 16-bit inputs
    and a head dim up to 256; memory-efficient takes fp32 but not grouped key/value heads
    (`gqa_in_sdpa`); math takes anything (module docstring). ``compute_16bit``: an fp32 job
    whose forward runs in bf16 all the same (FSDP's mixed-precision policy casts the gathered
    parameters, `compute_16bit_of`), so SDPA sees bf16 inputs. torchtitan allows cuDNN, flash
    and math only (``sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, MATH])``,
    torchtitan/models/attention.py ``ScaledDotProductAttentionWrapper``): 16-bit inputs run cuDNN
    or flash, whose saved tensors are the same (output and fp32 log-sum-exp), fp32 ones math."""
    if job.attention != "sdpa":
        return job.attention
    sixteen_bit = job.precision != "fp32" or compute_16bit
    head_ok = model.head_dim % 8 == 0 and model.head_dim <= 256
    if sixteen_bit and head_ok:
        return "flash"
    if job.implementation == "torchtitan":
        return "math"
    if head_ok and not (isinstance(job, Training) and gqa_in_sdpa(model, job)):
        return "efficient"  # inference: see `check_cuda_kernel`
    return "math"


def check_cuda_kernel(model: ModelSpec, job: Training | Inference) -> None:
    """``ValueError`` for a forced kernel CUDA cannot run: flash on fp32 inputs
    (``check_dtypes_flash_attention``), memory-efficient on grouped key/value heads (module
    docstring). The CPU tracker runs both (its flash kernel takes fp32).
    ``NotImplementedError`` for fp32 grouped-query inference, which runs math on CUDA (not
    modelled for inference yet; the CPU tracker's stand-in stays its flash kernel)."""
    if job.attention == "flash" and job.precision == "fp32":
        raise ValueError(
            "attention='flash' with precision='fp32': CUDA's flash kernel takes fp16/bf16 only "
            "(use attention='sdpa', or a bf16/fp16/amp precision)"
        )
    fp32_sdpa = job.attention == "sdpa" and job.precision == "fp32"
    if isinstance(job, Inference) and fp32_sdpa and gqa_in_sdpa(model, job):
        raise NotImplementedError(
            f"fp32 inference of a model with {model.n_heads} query and {model.n_kv_heads} "
            "key/value heads runs SDPA's math kernel on CUDA (memory-efficient takes no "
            "grouped-query attention): math prefill is not modelled yet (bf16/fp16 runs flash)"
        )
    if job.attention == "efficient" and gqa_in_sdpa(model, job):
        raise ValueError(
            f"attention='efficient' with {model.n_heads} query and {model.n_kv_heads} key/value "
            "heads: CUDA's memory-efficient kernel takes no grouped-query attention "
            "(use attention='sdpa' or 'math')"
        )


def cpu_backend(kernel: str, attn_dropout: float = 0.0) -> str:
    """The CPU SDPA backend that stands for a CUDA kernel: ``flash`` or ``math`` (or eager).

    CPU's fused kernel has no dropout ("Both fused kernels do not support non-zero dropout",
    ``sdp_utils_cpp.h``): with attention dropout the CPU run takes math."""
    if kernel in ("flash", "efficient") and attn_dropout > 0:
        return "math"
    return {"flash": "flash", "efficient": "flash", "math": "math", "eager": "eager"}[kernel]


def kernel_for(
    model: ModelSpec,
    job: Training | Inference,
    device: str,
    attn_dropout: float,
    compute_16bit: bool = False,
) -> str:
    """The kernel the replay runs on ``device``: `attention_kernel` on CUDA (dropout keeps the
    fused kernels, see the module docstring), `cpu_backend` of it on the CPU tracker."""
    kernel = attention_kernel(model, job, compute_16bit)
    if device == "cuda":
        check_cuda_kernel(model, job)
        return kernel
    return cpu_backend(kernel, attn_dropout)


def compute_16bit_of(param_itemsize: int) -> bool:
    """Whether FSDP's mixed-precision policy (``param_dtype``, ``param_itemsize`` bytes; 0: no
    policy) makes the forward of an fp32 model run in a 16-bit dtype."""
    return param_itemsize == 2


FLASH_HEAD_ROUNDING = ((128, 32), (256, 64))
"""``head_size_rounded = round_multiple(head_size, head_size <= 128 ? 32 : 64)`` in ``mha_bwd``
(``flash_attn/flash_api.cpp``), after ``head_size = round_multiple(head_size_og, 8)``."""


def flash_head_pad(head_dim: int) -> int:
    """``head_size_rounded - head_dim`` of the CUDA flash backward's ``dq_accum``."""
    size = -(-head_dim // 8) * 8
    step = next((m for limit, m in FLASH_HEAD_ROUNDING if size <= limit), 64)
    return -(-size // step) * step - head_dim
