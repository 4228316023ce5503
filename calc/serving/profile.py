"""The terms of vLLM's memory profile besides the weights: the profiling run's activation peak,
the memory outside PyTorch, and the CUDA graphs.

What vLLM measures (V1, ``vllm/v1/worker/gpu_worker.py`` ``Worker.determine_available_memory``
with ``vllm/utils`` ``memory_profiling``; read at commit 35d5cda1):

* ``profile_run`` (``vllm/v1/worker/gpu_model_runner.py``) runs ``_dummy_run(max_num_tokens)``:
  one forward of ``max_num_batched_tokens`` tokens spread over ``min(max_num_seqs,
  max_num_batched_tokens)`` dummy requests, then ``_dummy_sampler_run`` on the last hidden state
  of each request (``hidden_states[logit_indices]``): ``compute_logits`` and the sampler with
  top-k and top-p set (``SamplingMetadata`` with ``top_p = 0.9``, ``top_k = vocab - 1``);
* ``torch_peak_increase``: ``allocated_bytes.all.peak`` during that run minus the allocated
  bytes before it (the weights): the "activation peak";
* ``non_torch_increase``: (``cudaMemGetInfo`` used - ``memory_reserved``) after the run minus the
  same at the start-up snapshot (taken after the CUDA context is created, and from about 0.11
  after NCCL's initialisation): kernels loaded lazily, NCCL and custom all-reduce buffers;
* ``available_kv_cache_memory = total * gpu_memory_utilization - (weights +
  torch_peak_increase + non_torch_increase)`` (``memory_profiling``'s ``non_kv_cache_memory``).

V0 (``vllm/worker/worker.py`` ``determine_num_available_blocks``, 0.6.4 to 0.10) subtracts the
same three terms; its ``profile_run`` spreads the tokens over ``max_num_seqs`` sequences and
samples one token per sequence.

How calc predicts each term:

* the forward: calc's replay of the Hugging Face forward (``calc.estimate`` of a prefill of
  ``max_num_batched_tokens`` tokens as one sequence, flash attention, logits for the last token
  only) on a per-rank model (``n_heads / tp``, KV heads per rank, ``ffn / tp``); its
  temporaries (and the cuBLAS workspace) at the peak are the forward's activation peak. vLLM's
  own layer differs: fused ``qkv_proj`` (one ``[T, (a + 2k) d]`` output instead of three),
  ``gate_up_proj`` plus ``SiluAndMul`` (``[T, 2f]`` and ``[T, f]`` where Hugging Face holds
  ``gate``, ``silu``, ``up`` and their product, ``3 [T, f]`` at the peak: the same bytes),
  in-place fused residual add + RMSNorm, its attention backend (FlashAttention writing into a
  preallocated output) and, by default, torch.compile's fused kernels: the MLP peak, which
  dominates, is the same, the rest differs by a few ``[T, h]`` tensors;
* the sampler (``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``
  ``apply_top_k_top_p``, PyTorch path): with ``R = min(max_num_seqs, max_num_batched_tokens)``
  rows and ``U = R * vocab * 4`` bytes, the source keeps alive at once the fp32 copy of the
  logits (``U``), ``sort``'s values (``U``) and int64 indices (``2 U``), the top-k and top-p
  masks (``U / 4`` each), the softmax (``U``) and the scattered result (``U``): 6.5 units, while
  the bf16 logits and the forward's ``[T, h]`` output stay alive too. ATen's segmented sort
  adds scratch of its own; ``SAMPLER_UNITS = 9`` is the total that two published logs imply
  (vLLM PR #10511: Llama-3-8B, 256 rows, "PyTorch activation peak memory 1.26GiB"; a 0.15.1
  start-up of Llama-3.1-8B on an A100-40GB, ilseokoh/vllm-gce: 1.2-1.3 GiB with non-torch):
  an estimate; a 0.10.2 start-up of Qwen3-8B-FP8 (256 rows, vocab 151936) logs "1.4 GiB for
  peak activation", as 9 units predict. FlashInfer's fused sampler (used by V1 where FlashInfer
  is installed, as in vLLM's Docker images: "Using FlashInfer for top-p & top-k sampling")
  keeps about two units (``FLASHINFER_SAMPLER_UNITS``; a 0.10.0 log of Llama-3.2-1B shows a
  0.45 GiB peak with 256 rows, below what the sort path would take): ``Serving.sampler``
  chooses. V0's sampler (``vllm/model_executor/layers/
  sampler.py``) sorts the same way and adds log-probabilities: ``SAMPLER_UNITS`` too;
* the forward of an architecture calc cannot replay yet (`calc.serving.arch` families outside
  `calc.ModelSpec`): ``analytic_forward_bytes``, a stated estimate of the live tensors of vLLM's
  layer at its widest point (see there);
* non-torch memory and CUDA graphs: not replayable (driver and NCCL allocations); stated
  estimates from published start-up logs, see ``NON_TORCH_BYTES`` and ``cuda_graph_bytes``.
"""

from __future__ import annotations

from calc.config.jobs import Inference
from calc.config.model_spec import ModelSpec
from calc.config.serving import Serving
from calc.estimate.api import estimate
from calc.serving.arch import ServingArch
from calc.serving.weights import DTYPE_BYTES, kv_heads_per_rank, padded_vocab
from calc.units import GIB, MIB

SAMPLER_UNITS = 9
"""fp32 ``[R, vocab]`` units live at the PyTorch top-k/top-p sampler's peak, sort scratch
included (see above: 6.5 from the source, the rest implied by published logs)."""
FLASHINFER_SAMPLER_UNITS = 2
"""The same with FlashInfer's fused top-k/top-p sampling (fp32 logits and probabilities)."""
LIGHT_SAMPLER_FROM = (0, 20, 0)
"""From about this version the profiling run's sampler holds about two ``[R, vocab]`` fp32
copies again (the V2 model runner's ``_dummy_sampler_run``: "During the initial memory
profiling, the sampler may skip top_k, top_p, and logprobs"; 2026 logs of 0.5B-1B models with
256 rows show 0.26-0.31 GiB peaks, below the sort path's ~1.3 GiB): an estimated boundary."""
NON_TORCH_BYTES = {"v0": 256 * MIB, "v1": 64 * MIB, "tp": 192 * MIB}
"""Memory outside PyTorch that the profiling run adds: V0's and V1's on one GPU, and what
tensor parallelism adds per rank (``tp``): estimates from published logs. V0 (measured from an
earlier snapshot) logs 0.03-0.35 GiB ("non_torch_memory=0.35GiB", 0.6.4, vllm issue #10517;
"non_torch_memory takes 0.20GiB", 4 x RTX 3090, PR #14447). V1 on one GPU: "0.07 GiB for non-torch memory"
(vLLM 0.10.2, H100, a 7B model, ``gpu_worker.py`` line 391's summary), "non-torch forward
increase memory: 0.02GiB" (0.10.0, Llama-3.2-1B), "non_torch_memory takes 0.03GiB" (V0, vllm
issue #13882); several GPUs: "0.21 GiB for non-torch memory" (0.11, 4 x L40S, tensor parallel
4), NCCL's and the custom all-reduce's buffers."""
GRAPH_BYTES_PER_LAYER = 22 * MIB
"""CUDA-graph memory per decoder layer of the rank (the piecewise graphs of every capture size
hold their own outputs and executable images): an estimate from vLLM's own estimates and
measurements in published logs: "CUDA graph pool memory: 0.24 GiB (actual), 0.58 GiB
(estimated)" for a 28-layer 0.6B model, "0.71 GiB (actual), 1.55 GiB (estimated)" for a
62-layer 27B model (2026 releases); "Graph capturing finished in 3 secs, took 0.52 GiB"
(0.10.1, Llama-3.1-8B, 32 layers)."""


def rank_model(model: ModelSpec, tp: int) -> ModelSpec:
    """The model one tensor-parallel rank computes: its heads, KV heads and MLP width."""
    if tp == 1:
        return model
    kv = kv_heads_per_rank(model, tp)
    return model.with_overrides(
        n_heads=model.n_heads // tp,
        n_kv_heads=kv,
        ffn=model.ffn // tp,
        name=f"{model.name} (tp rank of {tp})",
    )


def forward_activation_bytes(model: ModelSpec, serving: Serving, tokens: int) -> int:
    """Peak temporaries of one forward of ``tokens`` tokens on one rank (calc's replay of the
    Hugging Face forward as one sequence; GPT-2: the reference implementation)."""
    per_rank = rank_model(model, serving.tensor_parallel)
    if model.model_type == "gpt2":
        job = Inference(
            batch=1, context=tokens, precision=serving.dtype, implementation="reference"
        )
    else:
        job = Inference(batch=1, context=tokens, precision=serving.dtype, implementation="hf")
    est = estimate(per_rank, job)
    parts = est.breakdown
    return int(parts.get("temporaries", 0)) + int(parts.get("cuda", 0))


def sampler_units(serving: Serving, engine: str) -> int:
    """fp32 ``[R, vocab]`` units of the dummy sampler run: ``serving.sampler``, or with
    ``auto`` PyTorch's sort path (a ``pip install vllm`` without FlashInfer) and the light
    profiling sampler from ``LIGHT_SAMPLER_FROM`` on."""
    if serving.sampler == "auto":
        flashinfer = engine == "v1" and serving.version >= LIGHT_SAMPLER_FROM
    else:
        flashinfer = serving.sampler == "flashinfer"
    return FLASHINFER_SAMPLER_UNITS if flashinfer else SAMPLER_UNITS


def sampler_bytes(
    model: ModelSpec | ServingArch, serving: Serving, engine: str, tokens: int, rows: int
) -> int:
    """Live bytes at the sampler's peak: the forward's ``[tokens, h]`` output, the sampled rows'
    hidden states, the bf16 logits and the sampler's fp32 temporaries."""
    itemsize = DTYPE_BYTES[serving.dtype]
    hidden = tokens * model.hidden * itemsize + rows * model.hidden * itemsize
    logits = rows * padded_vocab(model) * itemsize
    unit = rows * model.vocab * 4
    return hidden + logits + sampler_units(serving, engine) * unit


def activation_peak_bytes(
    model: ModelSpec, serving: Serving, engine: str, tokens: int, rows: int
) -> int:
    """``torch_peak_increase`` of the profiling run: the larger of the forward's and the
    sampler's peaks (the last pipeline stage samples; an earlier one only runs the forward)."""
    forward = forward_activation_bytes(model, serving, tokens)
    return max(forward, sampler_bytes(model, serving, engine, tokens, rows))


FUSED_MOE_CHUNK_TOKENS = 32768
"""``VLLM_FUSED_MOE_CHUNK_SIZE`` default (``vllm/envs.py``): ``fused_experts_impl`` processes at
most this many tokens at a time."""


def _attention_elems(arch: ServingArch, tp: int, tokens: int) -> int:
    """Live attention activations per rank (elements): fused ``qkv`` and the attention output;
    MLA's prefill path (``q``, the latent, ``kv_b_proj``'s ``[T, a, nope + v]``, the assembled
    ``k`` and the padded ``v`` of ``qk`` width, the output)."""
    heads = arch.n_heads // tp
    if arch.mla is not None:
        m = arch.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        per_token = heads * (4 * qk + m.qk_nope_head_dim + m.v_head_dim)
        return tokens * (per_token + m.kv_lora_rank + m.qk_rope_head_dim)
    kv = kv_heads_per_rank(arch, tp)
    return tokens * (heads + 2 * kv + heads) * arch.head_dim


def _mlp_elems(
    arch: ServingArch, tp: int, tokens: int, sparse: bool, expert_parallel: bool = False
) -> int:
    """Live MLP activations per rank (elements). Dense: ``gate_up`` ``[T, 2f]`` and
    ``SiluAndMul``'s ``[T, f]``. Sparse (``fused_moe.py`` ``fused_experts_impl``): the shared
    ``intermediate_cache13`` of ``M * top_k * max(2 I, h)``, ``intermediate_cache2`` ``[M top_k,
    I]`` with ``M = min(T, FUSED_MOE_CHUNK_TOKENS)``, the output ``[T, h]``, the router logits
    ``[T, E]`` and the top-k weights and ids (fp32/int32, counted as two elements each); a shared
    expert's output ``[T, h]`` stays alive beside them. With expert parallelism every rank sees
    all ``T`` tokens and the caches are sized for whole experts (``I`` not split)."""
    if not sparse:
        return tokens * 3 * (arch.ffn // tp)
    assert arch.moe is not None
    moe = arch.moe
    inter = moe.expert_ffn if expert_parallel else moe.expert_ffn // tp
    m = min(tokens, FUSED_MOE_CHUNK_TOKENS)
    routed = m * moe.top_k * (max(2 * inter, arch.hidden) + inter)
    routed += tokens * (arch.hidden + moe.n_experts + 4 * moe.top_k)
    shared = tokens * arch.hidden if moe.shared_ffn else 0
    return routed + shared


def analytic_forward_bytes(arch: ServingArch, serving: Serving, tokens: int) -> int:
    """Estimated peak of one forward of ``tokens`` tokens on one rank for an architecture calc
    cannot replay: the residual and the normed hidden state ``2 [T, h]`` plus the larger of the
    attention's and the widest MLP's live tensors (``_attention_elems``, ``_mlp_elems``), in
    ``dtype``. An estimate from vLLM's layer code, not a replay: allocator rounding, the
    attention backend's workspace and torch.compile's fusions are not modelled."""
    tp = serving.tensor_parallel
    ep = serving.expert_parallel
    mlp = max(_mlp_elems(arch, tp, tokens, sparse, ep) for sparse in set(arch.moe_layers))
    widest = max(_attention_elems(arch, tp, tokens), mlp)
    return (2 * tokens * arch.hidden + widest) * DTYPE_BYTES[serving.dtype]


NEW_NON_TORCH_EXTRA_BYTES = 256 * MIB
"""What 2026 releases add outside PyTorch on one GPU: their start-up summaries ("Actual usage
is X GiB for consumed memory (weights + non-torch)") put it at 0.16-0.47 GiB beside the
weights (0.30, 0.16, 0.47 GiB in three published logs): an estimate, from
``LIGHT_SAMPLER_FROM`` on."""


def non_torch_bytes(serving: Serving, engine: str) -> int:
    """``non_torch_increase`` (estimated): ``NON_TORCH_BYTES`` for the engine, plus its ``tp``
    term with tensor parallelism and ``NEW_NON_TORCH_EXTRA_BYTES`` from ``LIGHT_SAMPLER_FROM``."""
    total = NON_TORCH_BYTES[engine]
    if serving.tensor_parallel > 1:
        total += NON_TORCH_BYTES["tp"]
    if engine == "v1" and serving.version >= LIGHT_SAMPLER_FROM:
        total += NEW_NON_TORCH_EXTRA_BYTES
    return total


def cuda_graph_bytes(serving: Serving, n_layers: int, capture_tokens: int) -> int:
    """Memory of the captured CUDA graphs (estimated): ``GRAPH_BYTES_PER_LAYER`` per layer of the
    rank; 0 without graphs (``enforce_eager`` or no capture size)."""
    if capture_tokens <= 0 or serving.enforce_eager:
        return 0
    return n_layers * GRAPH_BYTES_PER_LAYER


def as_gib(value: int) -> float:
    """Bytes in GiB (display helper for notes)."""
    return value / GIB
