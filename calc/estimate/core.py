"""`estimate(model, job)`: replay once per structure, compile once, evaluate in microseconds.

A *structure* is everything that changes which tensors exist (precision, optimizer, kernel,
recompute, implementation, biases, tied head, GQA, ...); sizes are symbols. For each structure
the step is replayed symbolically (`calc.step.training`), reduced to its possible peaks
(`calc.replay.timeline`), and the distinct storage sizes are compiled with
``lambdify(..., cse=True)``. An estimate is then one call of that function and a small
matrix-vector product.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import sympy as sp

from calc import symbols as S
from calc.compress import litgpt_lora
from calc.compress.lora import adapter_numels
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.data.bitsandbytes import BNB_MIN_8BIT_SIZE, BNB_OPTIMIZERS, BNB_PAGED_MIN_NUMEL
from calc.derive.data_parallel import fsdp_shard, grad_order
from calc.derive.native import Native, Rank
from calc.derive.replay import derived_events, notes_of, regime_of
from calc.derive.sharding import Shard
from calc.estimate.result import Estimate
from calc.models import litgpt
from calc.models.attention import attention_kernel, compute_16bit_of, flash_head_pad
from calc.parallel.data import ReplayPlan
from calc.replay import timeline
from calc.step.inference import replay_inference, replayed_new_tokens
from calc.step.pipeline import StagePlan, replay_stage
from calc.step.sizes import values_for
from calc.step.training import replay_training, replayed_micro_batches

CUBLAS_WORKSPACE_BYTES = 32 * 1024 * 1024
"""cuBLAS workspace per (handle, stream) on sm90 (H100/H200): ``getChosenWorkspaceSize`` in
``aten/src/ATen/cuda/CublasHandlePool.cpp`` (torch 2.13). Allocated through the caching
allocator at the first matmul of a thread, so it counts in ``memory_allocated``."""
CUBLAS_HANDLES_TRAINING = 2
"""Forward runs on the Python thread, backward on the autograd device thread: one workspace each."""


@dataclass(frozen=True, slots=True)
class Compiled:
    """The compiled form of one structure and one branch of the layer count."""

    timeline: timeline.Timeline
    sizes_fn: Callable[..., Sequence[int]]  # (*ALL_SYMBOLS) -> list of sizes
    l_min: int
    phase_index: tuple  # (phase, candidate indices)
    grad_order: tuple = ()  # (name, tag, numel expr, itemsize) of leaves, first-backward order
    _expr: list = field(default_factory=list)

    def expression(self) -> sp.Expr:
        """The peak formula of this structure (built once, on first use)."""
        if not self._expr:
            self._expr.append(timeline.expression(self.timeline, S.L))
        return self._expr[0]


def _job_structure(job: Training | Inference) -> Training | Inference:
    """The job with its sizes (which are symbols in the replay) set to 1, and its accumulation
    count cut to the micro-batches the replay plays out (`calc.step.training.replayed_micro_batches`):
    every ``grad_accum >= 2`` shares one structure."""
    if isinstance(job, Training):
        # torchtune's chunked loss copies a chunk of more than one sequence (calc.models.torchtune)
        chunks = job.implementation == "torchtune" and job.loss == "chunked-ce"
        b = min(job.micro_batch, 2) if chunks else 1
        return replace(job, micro_batch=b, seq_len=1, grad_accum=replayed_micro_batches(job))
    if job.new_tokens > 0:  # generate: every new_tokens >= 4 shares one (calc.models.hf_generate)
        # batch 1 and batch > 1 differ (generate's right-padding check): two structures
        n = replayed_new_tokens(job)
        return replace(job, batch=min(job.batch, 2), context=0, prompt=1, new_tokens=n)
    return replace(job, batch=1, context=1, prompt=None)


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How one rank's replay differs from the single-GPU step (part of the compile key)."""

    tp_comm: bool = False
    """The model is one tensor-parallel rank's, with its all-reduces (`calc.parallel.tensor`)."""
    tp_vocab: bool = False
    """The embedding and head are split over the vocabulary (`calc.parallel.tensor`)."""
    sp: int = 1
    """Sequence parallelism over this many ranks (tp), or 1: `calc.parallel.sequence`."""
    dp: ReplayPlan | None = None
    """Data-parallel changes to the step (`calc.parallel.data`)."""
    exact_layers: bool = False
    """Replay every layer (no generalisation from five): the rank's state differs per layer."""
    stage: StagePlan | None = None
    """A pipeline stage (`calc.step.pipeline.StagePlan`): the rank replays that stage's schedule."""
    native: Native | None = None
    """transformers' own tensor/expert parallelism of a derived model (`calc.derive.native`)."""


SINGLE = ReplayOptions()


@dataclass(frozen=True, slots=True)
class StructureKey:
    """What decides the compiled replay of ``(model, job, opts)``: two jobs with equal keys
    differ only in sizes (the replay's symbols) and share one compile. Hashes and compares by
    value (the in-memory caches); its ``repr`` names the on-disk one (`calc.plan.grid`)."""

    heads_span_hidden: bool
    """``n_heads * head_dim == hidden``: ``d`` is written ``h / a`` (`calc.step.training.shape_for`)."""
    multi_query: bool
    """One kv head (``n_kv_heads == 1``)."""
    sliding: bool
    """The model has a sliding window."""
    prompt_one: bool
    """HF inference with a one-token prompt (another mask path)."""
    window_in_context: bool
    """HF inference with a sliding window within the context (another mask path)."""
    small_params: tuple[bool, ...]
    """bitsandbytes' Adam: per trained param, fewer than ``min_8bit_size`` elements; paged,
    then per trained param fewer than the paging threshold (else empty)."""
    model_fields: tuple[tuple[str, object], ...]
    """``(name, value)`` of the `ModelSpec` fields that change the graph the replay walks as
    they are (``_FROM_MODEL``: model type, mlp, norm, biases, tying, dropouts)."""
    gqa: bool
    """``n_kv_heads != n_heads``."""
    opts: ReplayOptions
    attention_kernel: str
    """The SDPA kernel the job runs (`calc.models.attention.attention_kernel`)."""
    flash_head_pad: int
    """The CUDA flash backward's head-dim rounding (`calc.models.attention.flash_head_pad`)."""
    job: Training | Inference
    """The job with its sizes set to 1 (``_job_structure``)."""


_FROM_MODEL = (
    "model_type", "mlp", "norm", "qkv_bias", "o_bias", "mlp_bias", "norm_bias", "qk_norm",
    "tied_embeddings", "learned_positions", "attention_dropout", "hidden_dropout",
    "embedding_dropout",
)  # fmt: skip
"""The `ModelSpec` fields `StructureKey.model_fields` holds."""


def _structure_key(
    model: ModelSpec, job: Training | Inference, opts: ReplayOptions = SINGLE
) -> StructureKey:
    # HF inference: a one-token prompt, or a sliding window within the context, takes other
    # mask paths (calc/models/hf_inference.py refuses them; they must not share a compile).
    prompt_one = isinstance(job, Inference) and job.prompt_len == 1
    window_in_context = (
        isinstance(job, Inference)
        and model.sliding_window is not None
        and model.sliding_window <= job.context
    )
    small_params: tuple[bool, ...] = ()
    bnb = isinstance(job, Training) and job.optimizer in BNB_OPTIMIZERS
    if isinstance(job, Training) and bnb and not is_derived(model, job):  # per-param thresholds
        numels: Sequence[int | sp.Expr]
        if job.lora is None:
            numels = [p.numel for p in model.param_tensors()]
        elif job.implementation == "litgpt":  # its fused qkv adapter: litgpt_lora.adapt
            numels = litgpt_lora.head_numels(model, job.lora) + litgpt_lora.block_numels(
                model, job.lora
            )
        else:  # LoRA trains the adapters: decide for them
            numels = list(adapter_numels(model, job.lora))
        small_params = tuple(n < BNB_MIN_8BIT_SIZE for n in numels)
        if job.paged_optimizer:
            small_params += tuple(n < BNB_PAGED_MIN_NUMEL for n in numels)
    return StructureKey(
        heads_span_hidden=model.n_heads * model.head_dim == model.hidden,
        multi_query=model.n_kv_heads == 1,
        sliding=model.sliding_window is not None,
        prompt_one=prompt_one,
        window_in_context=window_in_context,
        small_params=small_params,
        model_fields=tuple((name, getattr(model, name)) for name in _FROM_MODEL)
        + _derived_fields(model, job)
        + _torchtune_fields(model, job)
        + _litgpt_fields(model, job),
        gqa=model.n_kv_heads != model.n_heads,
        opts=opts,
        attention_kernel=attention_kernel(
            model, job, opts.dp is not None and compute_16bit_of(opts.dp.param_itemsize)
        ),
        flash_head_pad=flash_head_pad(model.head_dim),
        job=_job_structure(job),
    )


def is_derived(model: ModelSpec, job: Training | Inference) -> bool:
    """Whether the replay is derived from the modeling code (`calc.derive`): a model type with
    no hand-written graph, or ``implementation="derived"``."""
    return model.derived or job.implementation == "derived"


def _torchtune_fields(
    model: ModelSpec, job: Training | Inference
) -> tuple[tuple[str, object], ...]:
    """torchtune's RoPE cache holds ``max_positions`` rows (`calc.models.torchtune.buffers`): a
    constant of its replay; nothing for the other implementations."""
    if job.implementation != "torchtune":
        return ()
    return (("max_positions", model.max_positions),)


def _litgpt_fields(model: ModelSpec, job: Training | Inference) -> tuple[tuple[str, object], ...]:
    """litgpt's loss chunks and RoPE tables change the replay's walk with the sizes
    (`calc.models.litgpt.Regime`); nothing for the other implementations."""
    if not isinstance(job, Training) or job.implementation != "litgpt":
        return ()
    regime = litgpt.Regime.of_job(job, model)
    return (("litgpt_regime", regime.key()), ("max_positions", model.max_positions))


def _derived_fields(model: ModelSpec, job: Training | Inference) -> tuple[tuple[str, object], ...]:
    """What else decides a derived replay: the config and the job's size regime
    (`calc.derive.lift.Regime`); nothing for the hand-written replays. A hand-modelled type
    replayed as derived has no config of its own: the recording is of the config its spec
    writes, lifted in the batch and sequence sizes only, so the spec itself is part of the
    key; two sizes of one family must not share a structure."""
    if not is_derived(model, job):
        return ()
    config = model.hf_config if model.hf_config is not None else model
    return (("hf_config", config), ("regime", regime_of(model, job)))


def _branch(n_layers: int) -> int:
    return min(n_layers, timeline.GENERAL_LAYERS)


_EXEMPLAR: dict[StructureKey, tuple[ModelSpec, Training | Inference, ReplayOptions]] = {}


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a replay runs: a replay makes hundreds of
    thousands of small objects and keeps nearly all of them, so each collection would walk a
    growing heap (with it on, a 7B structure's replay took about three times as long; see
    benchmarks/bench_compile.py). It is switched back on (if it was) afterwards."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@lru_cache(maxsize=512)
def _compile(key: StructureKey, device: str, branch: int) -> Compiled:
    with _collector_paused():
        return _compile_now(key, device, branch)


def _compile_now(key: StructureKey, device: str, branch: int) -> Compiled:
    model, job, opts = _EXEMPLAR[key]
    order: list = []
    exact = opts.exact_layers
    units: int | None = None
    derived_order: tuple = ()
    if is_derived(model, job):
        shard = None
        if opts != SINGLE:
            shard, derived_order = _derived_dp(model, job, opts, branch)
        recorded = derived_events(model, job, branch, shard)
        events, units = recorded.events, recorded.units
        exact = exact or recorded.every_layer
    elif isinstance(job, Inference):
        if opts != SINGLE:
            raise NotImplementedError("parallel inference is not modelled yet")
        events = replay_inference(model, job, device, branch)
    elif opts.stage is not None:
        events = replay_stage(model, job, opts.stage, device, n_layers=branch,
                              tp_comm=opts.tp_comm, grad_order=order)  # fmt: skip
    else:
        events = replay_training(
            model,
            job,
            device,
            branch,
            tp_comm=opts.tp_comm,
            tp_vocab=opts.tp_vocab,
            sp=opts.sp,
            dp=opts.dp,
            grad_order=order,
        )
    grad_order = derived_order or tuple((t.name, t.storage.tag, t.numel, t.itemsize) for t in order)
    if branch >= timeline.GENERAL_LAYERS and not exact:
        cands = timeline.candidates_general(events, units)
    else:
        cands = timeline.candidates_exact(events)
    tl = timeline.build(cands, l_min=branch)
    fn = sp.lambdify(S.ALL_SYMBOLS, list(tl.sizes), modules="math", cse=True)
    phase_index = tuple(
        (phase, np.array([j for j, c in enumerate(tl.candidates) if c.phase == phase]))
        for phase in dict.fromkeys(c.phase for c in tl.candidates)
    )
    return Compiled(tl, fn, branch, phase_index, grad_order)


def _derived_dp(
    model: ModelSpec, job: Training | Inference, opts: ReplayOptions, branch: int
) -> tuple[Rank | None, tuple]:
    """(FSDP2 wrapping, gradient order) of a derived model's data-parallel rank: FSDP2's rank
    is recorded wrapped (`calc.derive.sharding`); DDP's step is the recorded single-process
    one plus its buckets, sized from the gradient order (`calc.derive.data_parallel`).
    ``NotImplementedError`` for any other layout."""
    if isinstance(job, Training) and opts.native is not None:
        if replace(opts, native=None) != SINGLE:
            raise NotImplementedError(
                "transformers' tensor parallelism with data parallelism on a derived model"
            )
        return opts.native, ()
    plain = replace(opts, dp=None, exact_layers=False)  # ZeRO-1 by parameter: every layer
    if not isinstance(job, Training) or opts.dp is None or plain != SINGLE:
        raise NotImplementedError(
            f"model_type={model.model_type!r} (derived replay): of the parallel layouts only "
            "DDP and FSDP2 are modelled on derived architectures (not TP, SP, PP)"
        )
    shard = fsdp_shard(model, job, opts.dp)
    if isinstance(shard, Shard):
        return shard, ()
    return shard, grad_order(model, job, branch)  # DDP (ZeRO-1: its optimizer) plus buckets


DERIVED_NOTE = (
    "derived from the modeling code (transformers, recorded on fake tensors with CPU kernels)"
)
"""The note every derived estimate carries."""


def evaluate(
    comp: Compiled,
    key: StructureKey,
    model: ModelSpec,
    job: Training | Inference,
    device: str,
    extras: tuple[tuple[str, int, int], ...] = (),
    notes: tuple[str, ...] = (),
) -> Estimate:
    """The estimate of one compiled replay at ``model``/``job``'s sizes. ``extras`` are constant
    storages outside the replay: ``(breakdown key, bytes in step 1, bytes from step 2 on)``."""
    vals = values_for(model, job)
    args = [vals[sym] for sym in S.ALL_SYMBOLS]
    tl = comp.timeline
    raw_sizes = comp.sizes_fn(*args)
    if timeline.exceeds_exact_range(tl, raw_sizes, model.n_layers):
        raise ValueError(too_large_message(model, job))
    sizes = np.array(raw_sizes, dtype=np.int64)
    tot = timeline.totals(tl, sizes, model.n_layers)
    extra, dev_notes = _device_terms(job, device)
    tot = tot + extra
    first = timeline.step1_mask([c.phase for c in tl.candidates])
    for _name, step1, later in extras:
        tot = tot + np.where(first, step1, later)
    i = int(np.argmax(tot))
    phases = {phase: int(tot[idx].max()) for phase, idx in comp.phase_index}
    cand = tl.candidates[i]
    n_layers = model.n_layers
    const = {name: (step1 if first[i] else later) for name, step1, later in extras}
    const_total = extra + sum(const.values())
    return Estimate(
        peak_bytes=int(tot[i]),
        peak_phase=cand.phase,
        peak_event=cand.label.lstrip("+"),
        breakdown_fn=lambda: _breakdown(cand, sizes, tl, n_layers, extra, device, const),
        phases=phases,
        expression_fn=lambda: comp.expression() + const_total,
        peak_expression_fn=lambda: timeline.candidate_expression(tl, i, S.L) + const_total,
        values=vals,
        device=device,
        notes=(
            f"attention kernel: {key.attention_kernel}",
            *dev_notes,
            *_derived_note(key),
            *notes,
        ),
    )


def _derived_note(key: StructureKey) -> tuple[str, ...]:
    fields = dict(key.model_fields)
    if "regime" not in fields:
        return ()
    config = fields.get("hf_config")
    kernel = key.attention_kernel
    return (DERIVED_NOTE, *(notes_of(config, kernel) if isinstance(config, str) else ()))


def too_large_message(model: ModelSpec, job: Training | Inference) -> str:
    """The message for a job whose byte counts leave the exact range (`timeline.EXACT_BYTES_LIMIT`)."""
    if isinstance(job, Training):
        sizes = f"micro_batch={job.micro_batch:,}, seq_len={job.seq_len:,}"
    else:
        sizes = f"batch={job.batch:,}, context={job.context:,}"
    return (
        f"{sizes} with {model.name}: the memory of this job reaches 2**53 bytes (8 PiB), beyond "
        "what the estimate computes exactly; use smaller sizes (or check the model's "
        "hidden_size, num_hidden_layers and vocab_size)"
    )


def recorded_only(plan: ReplayPlan, model: ModelSpec, job: Training | Inference) -> bool:
    """Whether ``plan`` asks for what only the recorded (derived) replay models: FSDP1 and
    FSDP2's output casts (`calc.parallel.data.ReplayPlan.recorded_only`), except LitGPT's own
    FSDP1 (Lightning's FSDPStrategy, written by hand: `calc.parallel.fsdp1`)."""
    if not plan.recorded_only or is_derived(model, job):
        return False
    return not (job.implementation == "litgpt" and plan.fsdp_version == 1)


@lru_cache(maxsize=4096)
def compiled_for(
    model: ModelSpec, job: Training | Inference, device: str, opts: ReplayOptions = SINGLE
) -> tuple[Compiled, StructureKey]:
    """The compiled replay of this structure (cached) and its key."""
    plan = opts.dp
    if plan is not None and recorded_only(plan, model, job):
        raise NotImplementedError(
            f"{plan.recorded_only}: recorded from torch's code (implementation='derived'), not "
            "written into the hand graphs"
        )
    opts = replay_options(job, opts)
    key = _structure_key(model, job, opts)
    _EXEMPLAR.setdefault(key, (model, job, opts))
    branch = model.n_layers if opts.exact_layers else _branch(model.n_layers)
    return _compile(key, device, branch), key


def replay_options(job: Training | Inference, opts: ReplayOptions) -> ReplayOptions:
    """``opts`` with every layer replayed where the layers differ in a way the five-layer
    generalisation cannot carry: torchtitan checkpointing every n-th block only
    (``recompute_every``, `calc.models.torchtitan`; the recording's periodic units,
    `calc.derive.period`, do that for transformers' code)."""
    if isinstance(job, Training) and job.implementation == "torchtitan":
        if job.recompute_every != 1 and not opts.exact_layers:
            return replace(opts, exact_layers=True)
    return opts


def _device_terms(job: Training | Inference, device: str) -> tuple[int, tuple[str, ...]]:
    if device != "cuda":
        return 0, ()
    handles = CUBLAS_HANDLES_TRAINING if isinstance(job, Training) else 1
    notes: tuple[str, ...] = (
        f"cuBLAS workspaces: {handles} x 32 MiB (sm90 default; measured on an H200)",
    )
    if isinstance(job, Inference) and job.new_tokens > 0 and job.cache_impl == "static":
        notes = (*notes, STATIC_COMPILE_NOTE)
    return handles * CUBLAS_WORKSPACE_BYTES, notes


STATIC_COMPILE_NOTE = (
    "generate with a static cache on CUDA: transformers compiles the decode step unless "
    "generate(..., disable_compile=True) (generation/utils.py, _valid_auto_compile_criteria); "
    "this estimate is the eager generate, as verified (the compiled one's CUDA graphs and "
    "generated buffers are not modelled)"
)
"""The note of a static-cache generate on CUDA."""


_GROUP = {"embed": "embedding", "head": "head", "base": "model", "optimizer": "optimizer"}


def _group(tag: object) -> str:
    return "layers" if isinstance(tag, int) else _GROUP.get(str(tag), str(tag))


def _breakdown(
    cand: timeline.Candidate, sizes: np.ndarray, tl: timeline.Timeline, n_layers: int,
    extra: int, device: str, const: dict[str, int] | None = None,
) -> dict[str, int]:  # fmt: skip
    index = {size: j for j, size in enumerate(tl.sizes)}
    leaf: dict[str, int] = defaultdict(int)
    for (kind, name, tag, size), (k0, k1) in cand.counts.items():
        nbytes = (k0 + k1 * n_layers) * int(sizes[index[size]])
        if nbytes == 0:
            continue
        group = _group(tag)
        key = {
            "weight": f"weights/{group}",
            "qscale": f"weights/quant_scales/{group}",
            "adapter": f"weights/lora_adapters/{group}",
            "grad": f"gradients/{group}",
            "state": f"optimizer/{name.split(':')[0]}",
            "input": "inputs",
            "buffer": "buffers",
            "saved": f"activations/{group}/{name}",
            "kv_cache": f"kv_cache/{group}",
            "act": f"temporaries/{name}",
            "pruning": f"pruning/{name}",
            "teacher": f"teacher/{name}",
        }.get(kind, f"other/{name}")
        leaf[key] += nbytes
    if extra:
        leaf[f"{device}/cublas_workspace"] += extra
    for name, nbytes in (const or {}).items():
        if nbytes:
            leaf[name] += nbytes
    tree: dict[str, int] = defaultdict(int)
    for key, nbytes in leaf.items():
        parts = key.split("/")
        for depth in range(1, len(parts) + 1):
            tree["/".join(parts[:depth])] += nbytes
    tree["total"] = sum(leaf.values())
    return dict(sorted(tree.items(), key=lambda kv: (kv[0] != "total", kv[0])))
