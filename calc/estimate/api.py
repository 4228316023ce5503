"""``calc.estimate``: the public entry point. Validates its input, then evaluates the compiled
replay of one GPU (`calc.estimate.core`) or of the most-loaded rank of a parallel layout
(`calc.estimate.ranks`)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from calc.compress import litgpt_lora
from calc.compress.lora import check_parallel, trainable_numels
from calc.compress.quant import check_fits, library_of, shards_of
from calc.config.hf_config import hf_config_dict
from calc.config.jobs import DEVICES, Inference, Training, check_choice
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.data.gpus import GPU, get_gpu
from calc.derive.linears import MLP_NAMES
from calc.derive.replay import (
    MOE_LORA_NOTE,
    check_cuda,
    derived_trainable_numels,
    is_moe,
    require_recorder,
)
from calc.estimate.core import (
    CUBLAS_WORKSPACE_BYTES,
    evaluate,
)
from calc.estimate.fallback import compiled_or_derived
from calc.estimate.ranks import estimate_parallel
from calc.estimate.reserved import allocator_stats
from calc.estimate.result import Estimate
from calc.estimate.workspace import cublas_workspace_bytes, for_gpu, workspace_charge
from calc.models import litgpt_arch
from calc.parallel.layout import param_numels
from calc.replay.offload import MIN_TOKENS
from calc.step.optimizer import paged_state_bytes


def estimate(
    model: ModelSpec,
    job: Training | Inference,
    parallel: Parallelism | None = None,
    device: str = "cuda",
    gpu: str | GPU | None = None,
) -> Estimate:
    """Peak bytes of ``job`` on one GPU (``device="cuda"``: ``max_memory_allocated``) or under
    verify's CPU storage tracker (``device="cpu"``), with the phases and the breakdown.

    With ``parallel`` (a `calc.Parallelism` over several GPUs), the estimate is the most-loaded
    rank's (``Estimate.rank``), with every rank's peak in ``Estimate.rank_peaks`` and
    ``ranks/<r>`` keys in the breakdown (`calc.estimate.ranks`).

    ``gpu`` (a catalog id or `calc.data.gpus.GPU`): charge that GPU's cuBLAS workspaces
    (`calc.estimate.workspace`, by compute capability) instead of Hopper's 32 MiB each, the
    charge when no GPU is named. Nothing else depends on it.

    Raises ``ValueError`` for invalid input and ``NotImplementedError`` for a combination the
    cost model does not cover yet (the message names it).
    """
    check_choice("device", device, DEVICES)
    if (
        isinstance(job, Training)
        and job.implementation == "litgpt"
        and isinstance(model, ModelSpec)
    ):
        model = litgpt_arch.as_built(model)  # the configuration litgpt builds
    _check_arguments(model, job, parallel)
    if isinstance(job, Training):
        _check_training(model, job)
    if job.quant is not None:  # the group size must divide every quantized linear
        check_fits(model, job.quant, library_of(job), shards_of(parallel))
    compressed = isinstance(job, Training) and any(
        x is not None for x in (job.lora, job.quant, job.pruning, job.distill)
    )
    if parallel is not None and not parallel.is_single and compressed:
        check_parallel(job, parallel)  # NotImplementedError for the layouts not covered
    gpu_obj = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if gpu_obj is not None and not isinstance(gpu_obj, GPU):
        raise ValueError(f"gpu must be a catalog id or a calc GPU, got {type(gpu).__name__}")
    if parallel is not None and not parallel.is_single:
        _check_parallel_job(job, parallel)
        est = _with_paged(estimate_parallel(model, job, parallel, device), model, job)
        est = replace(est, notes=(*est.notes, *lora_notes(model, job)))
        return est if gpu_obj is None else for_gpu(est, job, gpu_obj)
    if device == "cuda" and model.derived:
        check_cuda(model, job)  # the recording's CPU kernel must be the one CUDA runs
    comp, key, job, notes = compiled_or_derived(model, job, device)
    notes = (*notes, *job_notes(job, device), *lora_notes(model, job))
    est = _with_paged(evaluate(comp, key, model, job, device, notes=notes), model, job)
    if gpu_obj is not None:
        est = for_gpu(est, job, gpu_obj)
    charged = workspace_charge(job, device)
    if not charged:
        return est
    size = cublas_workspace_bytes(gpu_obj)
    handles = charged // CUBLAS_WORKSPACE_BYTES
    return replace(est, allocator_fn=partial(allocator_stats, model, job, device, size, handles))


def _check_arguments(model: object, job: object, parallel: object) -> None:
    """``ValueError`` for arguments of the wrong type; `RecorderMissing` for a model or job
    only the derived replay answers where torch or transformers is not installed."""
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a calc.ModelSpec, got {type(model).__name__}")
    if not isinstance(job, Training | Inference):
        raise ValueError(f"job must be calc.Training or calc.Inference, got {type(job).__name__}")
    if parallel is not None and not isinstance(parallel, Parallelism):
        raise ValueError(f"parallel must be a calc.Parallelism, got {type(parallel).__name__}")
    if model.derived or job.implementation == "derived":
        require_recorder(model.model_type)  # torch and transformers, or one clear message


def _check_parallel_job(job: Training | Inference, parallel: Parallelism) -> None:
    """What a parallel layout refuses of the job: a compiled step other than torchtitan's
    shape (each layer compiled, FSDP2 alone: `compiles_sharded`; the rank replays do not
    refuse it themselves); paged optimizer states under sharding or offload (modelled
    unsharded: one GPU, DDP)."""
    if isinstance(job, Training) and job.compile != "none" and not compiles_sharded(job, parallel):
        raise NotImplementedError(
            f"compile={job.compile!r} is modelled on one GPU and, for compile='regional', "
            "under FSDP2 alone (fsdp=True, fsdp_version=2, dp ranks only, no offload); not "
            "with DDP, ZeRO-1, FSDP1, tensor, pipeline or context parallelism yet"
        )
    paged = isinstance(job, Training) and job.paged_optimizer
    if paged and (parallel.shard_level or parallel.offload != "none"):
        raise NotImplementedError(
            "paged_optimizer with ZeRO, FSDP or offload is not modelled (one GPU and DDP are)"
        )


def compiles_sharded(job: Training, parallel: Parallelism) -> bool:
    """Whether ``job`` compiled on ``parallel`` is what the recording covers: each decoder
    layer compiled (``compile="regional"``) under FSDP2 over dp ranks alone, torchtitan's
    shape (``torchtitan/models/llama3/infra/parallelize.py``: ``apply_compile`` per block,
    then ``fully_shard`` per block and root), recorded with FSDP2's hooks outside the graphs
    (`calc.derive.record`) and measured so (`verify.dist.profiled`)."""
    return (
        job.compile == "regional"
        and parallel.fsdp
        and parallel.fsdp_version == 2
        and parallel.world_size == parallel.dp
        and parallel.dp_replicate == 1
        and parallel.offload == "none"
    )


def _with_paged(est: Estimate, model: ModelSpec, job: Training | Inference) -> Estimate:
    """``est`` with a paged optimizer's managed-memory states named (`Estimate.paged_state_bytes`
    and a note); unchanged for any other job."""
    if not isinstance(job, Training) or not job.paged_optimizer or job.optimizer is None:
        return est
    if model.derived:  # the parameters transformers builds (meta device)
        numels = derived_trainable_numels(model, job)
    elif job.implementation == "litgpt" and job.lora is not None:  # its fused qkv adapter
        numels = litgpt_lora.trainable_numels(model, job.lora)
    else:
        numels = trainable_numels(model, job) or param_numels(model)
    paged = paged_state_bytes(numels, job.optimizer)
    note = (
        f"paged optimizer: {paged:,} B of states in CUDA managed memory (bitsandbytes "
        "get_paged), outside PyTorch's allocator and the peak; on the GPU until memory runs "
        "short, then paged to the host"
    )
    return replace(est, paged_state_bytes=paged, notes=(*est.notes, note))


def _check_training(model: ModelSpec, job: Training) -> None:
    """``ValueError`` for a training job that does not fit ``model``: a pruned module it lacks,
    a distillation student that does not match, loss chunks that do not divide the tokens;
    ``NotImplementedError`` for offloading a micro-batch below `calc.replay.offload.MIN_TOKENS`."""
    if job.lora is not None and "lm_head" in job.lora.modules and job.implementation != "litgpt":
        raise NotImplementedError(
            f"lora.modules with 'lm_head' and implementation={job.implementation!r}: an adapter "
            "on the LM head is modelled for implementation='litgpt' (its lora_head)"
        )
    if job.pruning is not None:
        job.pruning.modules_for(model)  # ValueError for a module the model lacks
    if job.distill is not None:
        job.distill.check_student(model)
    tokens = job.micro_batch * job.seq_len
    if job.offload_activations and job.implementation == "torchtune" and tokens < MIN_TOKENS:
        raise NotImplementedError(
            f"offload_activations with micro_batch * seq_len = {tokens} tokens: modelled from "
            f"{MIN_TOKENS} tokens (below, some per-token tensors fall under torchtune's 1 KiB "
            "offloading threshold)"
        )
    if job.loss == "chunked-ce" and job.implementation != "litgpt":  # litgpt: 128-row chunks
        if tokens % job.loss_chunks:  # calc.models.head: equal chunks of the flattened tokens
            raise ValueError(
                f"loss_chunks={job.loss_chunks} must divide micro_batch * seq_len = {tokens}"
            )


COMPILE_NOTE = (
    "torch.compile: recorded from Inductor's own generated code run on fake tensors, at this "
    "job's batch and sequence (Inductor compiles for the shapes it is given: other sizes are "
    "recorded again, about 2 s per decoder layer, then cached); the optimizer step runs eagerly"
)
COMPILE_CUDA_NOTE = (
    "torch.compile on CUDA: the program recorded is Inductor's CPU one (C++ kernels); on a GPU "
    "Inductor writes Triton kernels from the same scheduled graph, saved set and buffer plan, "
    "but this has not been measured on a GPU yet"
)


COMPILE_REGIONAL_NOTE = (
    "compile='regional': transformers' decoder layers keep their index as an int, which Dynamo "
    "specialises on, so each layer may compile a graph of its own; past "
    "torch._dynamo.config.recompile_limit (8 in torch 2.13) the remaining layers run eagerly, "
    "and the recording does the same (raise the limit in the run to compile them all)"
)


PADDING_NOTE = (
    "padding='left': the prompts' attention mask is passed, so each forward builds a 4-D mask "
    "(SDPA: a float copy of the query dtype) and generate grows the 2-D mask each step; "
    "grouped-query heads are repeated before SDPA (transformers passes enable_gqa only without "
    "a mask); how many tokens are padded does not change the bytes"
)
PADDING_CUDA_NOTE = (
    "padding='left' on CUDA: with a mask SDPA runs its memory-efficient kernel (flash takes "
    "none), while the recording runs CPU flash with the mask; not measured on a GPU yet"
)


def lora_notes(model: ModelSpec, job: Training | Inference) -> tuple[str, ...]:
    """`MOE_LORA_NOTE` for LoRA on a mixture of experts' MLP names (`calc.derive.lora`)."""
    if not isinstance(job, Training) or job.lora is None or model.hf_config is None:
        return ()
    mlp = set(job.lora.modules) & set(MLP_NAMES)
    return (MOE_LORA_NOTE,) if mlp and is_moe(hf_config_dict(model)) else ()


def job_notes(job: Training | Inference, device: str) -> tuple[str, ...]:
    """The notes a job's recipe adds: a compiled training step's (`calc.derive.inductor`) or a
    left-padded batch's; none otherwise."""
    if isinstance(job, Inference):
        if job.padding == "none":
            return ()
        return (PADDING_NOTE, PADDING_CUDA_NOTE) if device == "cuda" else (PADDING_NOTE,)
    if job.compile == "none":
        return ()
    notes: tuple[str, ...] = (COMPILE_NOTE,)
    if job.compile == "regional":
        notes = (*notes, COMPILE_REGIONAL_NOTE)
    return (*notes, COMPILE_CUDA_NOTE) if device == "cuda" else notes
