"""The planner's throughput proxy: a relative score for ranking configurations that fit.

It is a ranking aid, not a prediction of step time, built from three documented effects:

* **recomputed FLOPs**: a training step costs forward + backward = 3 forward passes of matmul
  FLOPs (the backward computes two matmuls per forward one); activation recomputation adds
  what it reruns. Per token and layer, the forward costs ``2 x (layer parameters)`` FLOPs in
  matmuls plus ``4 x s x a x d`` in the attention core (``Q K^T`` and ``softmax(.) V``, causal
  masking not discounted): the FLOPs count of Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM" (forward ``24 b s h^2 + 4 b s^2 h``
  per layer for ``f = 4h`` and multi-head attention), which Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", use for recomputation overheads.
  ``full`` reruns every layer's forward; ``selective`` reruns the attention core only (their
  selective recomputation). The head's ``2 h V`` per token is never recomputed. With LoRA/QLoRA
  (``job.lora``) the base weights are frozen: the backward computes input gradients only, so
  a step costs 2 forward passes (adapter matmuls, ``r << h``, not counted).
* **communication**: a factor ``>= 1`` of the training layout (``communication_factor``), from
  the communication volume per step relative to the compute: DDP and ZeRO-1/2 move ``2 x``
  the parameters per step (all-reduce, or reduce-scatter + all-gather), ZeRO-3/FSDP ``3 x``
  (parameters gathered in forward and backward; Rajbhandari et al. 2020, "ZeRO", §7.2-7.3);
  tensor parallelism all-reduces activations 4 times per layer per micro-batch on the
  critical path (Shoeybi et al. 2019, "Megatron-LM", §3); CPU offload adds the optimizer step
  on the CPU and PCIe traffic (Ren et al. 2021, "ZeRO-Offload"). The weights of these effects
  (``DP_COST_PER_VOLUME``, ``TP_COST``, ``OFFLOAD_COST``) are assumed, not measured.
* **micro-batch size**: kernels run closer to peak on more tokens per call; the score uses
  ``t / (t + TOKENS_HALF_EFFICIENCY)`` for ``t = micro_batch x seq_len`` tokens, a saturating
  curve with an assumed half-efficiency point (not a measurement).

``proxy = efficiency(t) / (recompute_factor x communication_factor)``. Precision is not in
the score: fp32 matmuls are far slower than bf16 ones on tensor-core GPUs, so compare
precisions by recipe, not by this proxy.
"""

from __future__ import annotations

import math
from functools import lru_cache

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.derive.replay import param_count

TOKENS_HALF_EFFICIENCY = 1024
"""Tokens per micro-batch at which the proxy's efficiency term is 1/2 (an assumed scale)."""


DP_COST_PER_VOLUME = 0.025
"""Assumed slowdown per parameter-volume moved over data parallelism (mostly overlapped with
the backward): DDP/ZeRO-1/2 ``1 + 2 x 0.025``, ZeRO-3/FSDP ``1 + 3 x 0.025``."""
TP_COST = 0.08
"""Assumed slowdown per doubling of the tensor-parallel degree (exposed all-reduces)."""
OFFLOAD_COST = 0.3
"""Assumed slowdown of offloading the optimizer to the CPU."""


def communication_factor(parallel: Parallelism) -> float:
    """The layout's communication factor (``>= 1``, module docstring), from a
    ``calc.Parallelism``: ``(1 + DP_COST_PER_VOLUME x volume) x (1 + TP_COST x log2 tp) x
    (1 + OFFLOAD_COST if offloading)``; 1 for one GPU."""
    factor = 1.0
    if parallel.dp > 1:
        factor *= 1 + DP_COST_PER_VOLUME * (3 if parallel.shard_level == 3 else 2)
    if parallel.tp > 1:
        factor *= 1 + TP_COST * math.log2(parallel.tp)
    if parallel.offload != "none":
        factor *= 1 + OFFLOAD_COST
    return factor


@lru_cache(maxsize=256)
def layer_forward_flops_per_token(model: ModelSpec, seq_len: int) -> tuple[int, int]:
    """``(matmul, attention_core)`` forward FLOPs per token of one decoder layer:
    ``2 x`` the layer's matmul parameters, and ``4 x s x a x d`` (module docstring: Narayanan
    et al. 2021's count, written per parameter so GQA and SwiGLU layers count what they hold)."""
    return 2 * layer_matmul_params(model), 4 * seq_len * model.n_heads * model.head_dim


@lru_cache(maxsize=256)
def layer_matmul_params(model: ModelSpec) -> int:
    """The matrix parameters of one decoder layer: those the hand graph lists; for a derived
    model (`calc.derive`, no list of tensors), transformers' parameter count on the ``meta``
    device (`calc.derive.replay.param_count`) less the embedding and the untied head, per
    layer (norms and every expert included: a proxy's approximation). Cached per model: the
    derived count builds the model (40 ms warm for phi-4), which the FLOPs' cache, keyed by
    the sequence length too, would otherwise repeat at every new length."""
    if not model.derived:
        return sum(
            int(p.numel) for p in model.param_tensors() if p.group == "layer" and len(p.shape) == 2
        )
    embeddings = model.vocab * model.hidden * (1 if model.tied_embeddings else 2)
    return max(param_count(model) - embeddings, 0) // model.n_layers


def recompute_factor(model: ModelSpec, job: Training | Inference) -> float:
    """Training FLOPs with ``job.recompute`` over those without (1 for inference and for
    ``recompute="none"``): ``(3F + R) / 3F`` with ``F`` the forward FLOPs per token (layers
    and head) and ``R`` the recomputed ones (``op``: about half the matmuls, every other
    ``mm`` of torchtitan's policy, and no attention core); ``(2F + R) / 2F`` with LoRA (frozen base: no
    weight gradients)."""
    if isinstance(job, Inference) or job.recompute == "none":
        return 1.0
    matmul, core = layer_forward_flops_per_token(model, job.seq_len)
    forward = model.n_layers * (matmul + core) + 2 * model.hidden * model.vocab
    rerun = model.n_layers * {"full": matmul + core, "op": matmul / 2}.get(job.recompute, core)
    passes = 2 if job.lora is not None else 3
    return (passes * forward + rerun) / (passes * forward)


def microbatch_efficiency(tokens: int) -> float:
    """``tokens / (tokens + TOKENS_HALF_EFFICIENCY)``: more tokens per call, closer to 1."""
    return tokens / (tokens + TOKENS_HALF_EFFICIENCY)


def throughput_proxy(
    model: ModelSpec, job: Training | Inference, communication_factor: float = 1.0
) -> float:
    """The relative throughput score of ``job`` (module docstring); higher is better."""
    if isinstance(job, Training):
        tokens = job.micro_batch * job.seq_len
    else:
        tokens = job.batch * job.prompt_len
    return microbatch_efficiency(tokens) / (recompute_factor(model, job) * communication_factor)
