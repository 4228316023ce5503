"""The most-loaded GPU of a parallel job: one replay per kind of rank, then the maximum.

`estimate_parallel` splits the world (``dp x tp x pp x cp`` ranks) into classes of ranks that
hold the same tensors (`calc.parallel.layout.rank_classes`), replays the step once per class with the
sharding layer's view of that rank (`calc.parallel.layout.holding` decides, tensor by tensor, what
the rank keeps), adds the constant storages outside the replay (DDP's buckets), and returns
the estimate of the rank with the highest peak, with every rank's peak in
``Estimate.rank_peaks`` and in the breakdown under ``ranks/<r>``.

`rank_replays` gives what each class replays (its model, job, `ReplayOptions`, the extras
known before the replay, its notes) without evaluating anything: `estimate_parallel` and the
planner (``calc.plan.engine``, through tables of ``calc.plan.grid``) both start from it, so
they evaluate the same replays with the same extras.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from calc.compress.lora import trainable_numels
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism, check_divisibility
from calc.derive.native import Native
from calc.derive.replay import derived_trainable_numels
from calc.estimate.core import (
    Compiled,
    ReplayOptions,
    StructureKey,
    evaluate,
    is_derived,
    recorded_only,
    values_for,
)
from calc.estimate.fallback import compiled_or_derived, derived_fallback
from calc.estimate.result import Estimate
from calc.estimate.stages import stage_results
from calc.models import torchtitan
from calc.parallel import data as dpm
from calc.parallel.context import rank_job, ring_kv_bytes
from calc.parallel.layout import RankClass, rank_classes
from calc.replay.timeline import MIDDLE
from calc.symbols import JOB_SYMBOLS

Extra = tuple[str, int, int]
"""A constant storage outside the replay: (breakdown key, bytes in step 1, bytes later)."""


@dataclass(frozen=True, slots=True)
class RankReplay:
    """What one class of ranks replays, before any evaluation (`rank_replays`)."""

    rank_class: RankClass
    model: ModelSpec
    """The model one rank replays (tensor parallelism: its part)."""
    job: Training
    """The job one rank runs (context parallelism: its share of the sequence)."""
    options: ReplayOptions
    """How the replay differs from the single-GPU step (part of the compile key)."""
    parallel: Parallelism
    extras: tuple[Extra, ...]
    """Constant storages known without the replay (CP ring K/V, FSDP DeviceMesh tensors)."""
    notes: tuple[str, ...]
    """Notes of the class, then those of ``extras``."""

    @property
    def ddp(self) -> bool:
        """DDP gradient buckets are held: their sizes need the replay's gradient order."""
        return self.rank_class.ddp

    def finish(self, grads: Sequence[tuple[int, int]] | None) -> tuple[tuple[Extra, ...], tuple]:
        """Every extra and note of this class, in `estimate_parallel`'s order; ``grads``:
        ``(itemsize, numel)`` of every parameter in gradient-ready order (`expand_layers`),
        needed when ``ddp``."""
        extras: list[Extra] = []
        notes = list(self.rank_class.notes)
        if self.ddp:
            assert grads is not None, "DDP buckets need the gradient order"
            extra, note = _bucket_extra(grads, self.parallel)
            extras.append(extra)
            notes.append(note)
        extras.extend(self.extras)
        notes.extend(self.notes[len(self.rank_class.notes) :])
        return tuple(extras), tuple(notes)


def estimate_parallel(
    model: ModelSpec, job: Training | Inference, parallel: Parallelism, device: str
) -> Estimate:
    """The most-loaded rank of ``job`` run under ``parallel`` (see the module docstring)."""
    if not isinstance(job, Training):
        raise NotImplementedError("parallel layouts are modelled for training only")
    parallel = implementation_parallel(job, parallel)
    results: list[tuple[RankClass, Estimate]] = []
    if parallel.pp > 1:  # one replay per pipeline stage (calc.step.pipeline)
        check_divisibility(model, parallel)
        results = stage_results(
            model, _rank_job(job, parallel), parallel, device,
            lambda comp, key, local, mb_job: _stage_ddp(comp, key, local, mb_job, parallel),
        )  # fmt: skip
    else:
        for rr in rank_replays(model, job, parallel, device):
            results.append((rr.rank_class, _estimate_class(rr, device)))
    rank_peaks: dict[int, int] = {}
    for rc, est in results:
        for r in rc.ranks:
            rank_peaks[r] = est.peak_bytes
    worst_rc, worst = max(results, key=lambda x: (x[1].peak_bytes, -x[0].ranks[0]))
    fn = worst.breakdown_fn

    def breakdown() -> dict[str, int]:
        tree = dict(fn())
        for r, peak in sorted(rank_peaks.items()):
            tree[f"ranks/{r}"] = peak
        return tree

    notes = (*worst.notes, f"most-loaded rank: {worst_rc.ranks[0]} ({worst_rc.label})")
    return replace(
        worst, breakdown_fn=breakdown, rank=worst_rc.ranks[0], rank_peaks=rank_peaks, notes=notes
    )


def _stage_ddp(
    comp: Compiled, key: StructureKey, model: ModelSpec, job: Training, parallel: Parallelism
) -> tuple[tuple[Extra, ...], tuple[str, ...]]:
    """DDP's gradient buckets around one pipeline stage (`calc.estimate.stages`): one bucket
    per dtype in step 1; ``PipelineStage`` calls ``prepare_for_backward`` on the last
    micro-batch's backward only, so the ready order is recorded there and the buckets are
    rebuilt by step 2's first forward (``_pre_forward``: ``reducer._rebuild_buckets()``)."""
    extra, note = _bucket_extra(_ddp_grads(comp, key, model, job), parallel)
    return (extra,), (note,)


def _bucket_extra(grads: Sequence[tuple[int, int]], parallel: Parallelism) -> tuple[Extra, str]:
    """DDP's gradient buckets as an extra of the breakdown, and its note (`ddp_buckets`)."""
    first, later, n_buckets = ddp_buckets(grads, parallel)
    view = parallel.gradient_as_bucket_view
    note = (
        f"DDP gradient buckets: 1 bucket in step 1, {n_buckets} after the rebuild "
        f"({'gradients are bucket views' if view else 'plus .grad'})"
    )
    return ("ddp/gradient_buckets", first, later), note


def implementation_parallel(job: Training, parallel: Parallelism) -> Parallelism:
    """``parallel`` with the defaults of the job's implementation filled in: torchtitan's DDP
    buckets of 100 MiB (`calc.models.torchtitan.ddp_parallel`) where PyTorch's default is
    left."""
    if job.implementation == "torchtitan":
        return torchtitan.ddp_parallel(parallel)
    return parallel


def _rank_job(job: Training, parallel: Parallelism) -> Training:
    if parallel.cp > 1:  # analytic: each rank runs s / cp tokens (calc.parallel.context)
        return rank_job(job, parallel)
    return job


def rank_replays(
    model: ModelSpec, job: Training, parallel: Parallelism, device: str
) -> list[RankReplay]:
    """One `RankReplay` per class of ranks of ``parallel`` (``pp == 1``; pipeline stages are
    `calc.step.pipeline`'s), with the checks and errors of `estimate_parallel` in its order:
    ``ValueError`` for a layout that cannot split the model or the sequence,
    ``NotImplementedError`` for what the cost model does not cover."""
    if parallel.pp > 1:
        raise NotImplementedError("rank_replays: pipeline stages are calc.step.pipeline's")
    parallel = implementation_parallel(job, parallel)
    if job.implementation == "litgpt" and parallel.world_size != parallel.dp:
        raise NotImplementedError(
            "implementation='litgpt' on several devices is Lightning's FSDPStrategy, which "
            "shards over every device: dp only (no tensor, pipeline or context parallelism)"
        )
    if parallel.tp > 1 and is_derived(model, job):
        return [_native_replay(model, job, parallel)]
    if parallel.expert_parallel:
        raise NotImplementedError(
            f"expert_parallel=True: {model.name} is a hand-written graph without experts; "
            "expert parallelism is recorded on derived mixture-of-experts models"
        )
    check_divisibility(model, parallel)
    if parallel.tp > 1 and job.implementation == "hf":
        return [_hf_tensor_parallel(model, job, parallel, device)]
    job = _rank_job(job, parallel)
    classes = rank_classes(model, parallel, _trained_numels(model, job, parallel))
    if job.implementation == "litgpt":  # FSDP1 by hand: each rank's piece is its own
        classes = [one for rc in classes for one in _flat_param_ranks(rc)]
    return [_rank_replay(model, job, parallel, rc, device) for rc in classes]


def _flat_param_ranks(rc: RankClass) -> list[RankClass]:
    """FSDP1's ranks one by one (`calc.parallel.fsdp1`): every rank holds ``1/dp`` of each
    flat parameter, but each piece cuts the original parameters elsewhere, so each rank steps
    other views (optimizer states and their temporaries rounded one by one); ``rc`` itself for
    any other layout."""
    if not (rc.replay.fsdp and rc.replay.fsdp_version == 1):
        return [rc]
    return [
        replace(rc, ranks=(r,), label=f"dp rank {i}", replay=replace(rc.replay, fsdp_rank=i))
        for i, r in enumerate(rc.ranks)
    ]


def _trained_numels(model: ModelSpec, job: Training, parallel: Parallelism) -> list[int] | None:
    """Elements of the trained parameters in ``parameters()`` order, for ZeRO-1's partition:
    transformers' model built on the meta device for a derived one (the ModelSpec has no
    parameter list of its own), the adapters under LoRA, None for all of a hand-written one."""
    if is_derived(model, job) and parallel.zero == 1 and parallel.zero_partition != "shard":
        return derived_trainable_numels(model, job)
    return trainable_numels(model, job)


def _native_replay(model: ModelSpec, job: Training, parallel: Parallelism) -> RankReplay:
    """A derived model's tensor-parallel rank: transformers' own ``DistributedConfig`` plans
    recorded (`calc.derive.native`). Every rank holds the same shapes (the plans split evenly)."""
    alone = replace(parallel, tp=1, expert_parallel=False, sp=False, vocab_parallel=False)
    if alone != Parallelism() or parallel.sp or parallel.vocab_parallel:
        raise NotImplementedError(
            f"model_type={model.model_type!r} (derived replay): tp={parallel.tp} is recorded "
            "with transformers' own tp_plan alone (dp, pp, cp, sp, ZeRO/FSDP and "
            "vocab_parallel are not combined with it; the plan splits the vocabulary itself)"
        )
    if job.optimizer is not None and job.optimizer_impl != "for-loop":
        raise NotImplementedError(
            f"optimizer_impl={job.optimizer_impl!r} under transformers' tensor parallelism: "
            "its plans leave norms and routers plain tensors beside the DTensor shards, and "
            "torch's foreach and fused optimizers refuse the mix ('got mixed torch.Tensor and "
            "DTensor'); use optimizer_impl='for-loop' (torch's default on the CPU)"
        )
    plan = Native(tp=parallel.tp, expert_parallel=parallel.expert_parallel)
    every = tuple(range(parallel.world_size))
    what = "experts over the ranks (base_model_ep_plan)" if plan.expert_parallel else "tp plan"
    note = (
        f"tensor parallel: transformers' own DistributedConfig(tp_size={parallel.tp}) on "
        f"{model.name} ({what}), recorded"
    )
    rc = RankClass(every, "every rank", model, dpm.ReplayPlan(), False, (note,))
    opts = ReplayOptions(native=plan)
    return RankReplay(rc, model, job, opts, parallel, (), (note,))


HF_TP_NOTE = (
    "derived from transformers' code: the hand-written graph models tensor parallelism for "
    "implementation='reference' (Megatron-style) only; implementation='hf' is transformers' "
    "own tp_plan (from_pretrained(tp_plan=...), DistributedConfig), recorded"
)


def _hf_tensor_parallel(
    model: ModelSpec, job: Training, parallel: Parallelism, device: str
) -> RankReplay:
    """A hand-modelled type's ``implementation="hf"`` tensor-parallel rank: transformers' own
    plans, recorded as for a derived type (`_native_replay`), where `derived_fallback` allows
    the recording; the hand graph's refusal otherwise."""
    derived = derived_fallback(model, job, device)
    if not isinstance(derived, Training):
        raise NotImplementedError(
            "tensor parallelism with implementation='hf' is transformers' own tp_plan, "
            "recorded from its code (torch and transformers installed); the hand-written graph "
            "models implementation='reference'"
        )
    rr = _native_replay(model, derived, parallel)
    return replace(rr, notes=(*rr.notes, HF_TP_NOTE))


def _rank_replay(
    model: ModelSpec, job: Training, parallel: Parallelism, rc: RankClass, device: str
) -> RankReplay:
    local = rc.model
    plan = rc.replay
    if parallel.sp and job.seq_len % parallel.tp:
        raise ValueError(
            f"seq_len={job.seq_len} is not divisible by tp={parallel.tp} (sequence parallelism "
            f"splits the sequence over tp): allowed seq_len: multiples of {parallel.tp}"
        )
    opts = ReplayOptions(
        tp_comm=parallel.tp > 1,
        tp_vocab=parallel.tp > 1 and parallel.vocab_parallel,
        sp=parallel.tp if parallel.sp else 1,
        dp=plan,
        exact_layers=plan.optimizer_params is not None,
    )
    extras: list[Extra] = []
    notes: list[str] = list(rc.notes)
    if parallel.cp > 1:
        kv = ring_kv_bytes(local, job)
        extras.append(("context_parallel/ring_kv", kv, kv))
        notes.append(
            f"context parallel (analytic, not verified): {job.seq_len} tokens per rank, "
            f"ring attention K/V chunks in flight {kv} B"
        )
    if recorded_only(plan, model, job):
        derived = derived_fallback(model, job, device)
        if not isinstance(derived, Training):
            raise NotImplementedError(
                f"{plan.recorded_only} is recorded from torch's own FSDP code on transformers' "
                "model (the derived replay): it needs implementation='hf' or 'derived' and "
                "torch and transformers installed"
                + ("" if device == "cpu" else ", and the recorded CPU kernels those CUDA runs")
            )
        job = derived
        notes.append(
            f"{plan.recorded_only}: recorded from torch's FSDP on transformers' model (derived)"
        )
    if (
        plan.fsdp
        and plan.fsdp_version == 2
        and device == "cpu"
        and parallel.world_size == parallel.dp
        and parallel.dp_replicate == 1
    ):
        # One DeviceMesh per fully_shard call holds its ranks as a CPU int64 tensor
        # (``init_device_mesh``: ``torch.arange(world_size)``); on a GPU run it stays in host
        # memory, under the CPU tracker it counts (measured: one 512 B block per group). With
        # a 2-D layout the dp mesh is built once, before the model (none per call); torchtitan
        # builds its one dp mesh before its apply_fsdp (one block). HSDP's 2-D mesh is built
        # before the model too, as torchtitan builds it (none).
        groups = 1 if job.implementation == "torchtitan" else local.n_layers + 1
        extras.append(("fsdp/device_mesh_cpu", groups * 512, groups * 512))
        notes.append(f"CPU only: {groups} DeviceMesh rank tensors of 512 B")
    return RankReplay(rc, local, job, opts, parallel, tuple(extras), tuple(notes))


def _estimate_class(rr: RankReplay, device: str) -> Estimate:
    # a job the hand graph refuses on this rank: the derived replay of the same layout
    comp, key, job, notes = compiled_or_derived(rr.model, rr.job, device, rr.options)
    if job is not rr.job:
        assert isinstance(job, Training)
        rr = replace(rr, job=job, notes=(*rr.notes, *notes))
    grads = _ddp_grads(comp, key, rr.model, rr.job) if rr.ddp else None
    extras, notes = rr.finish(grads)
    return evaluate(comp, key, rr.model, rr.job, device, extras, notes)


_GRADS: dict[tuple, tuple] = {}
"""Memo of `_ddp_grads`: the gradients' sizes depend on the model's dimensions only (not on
the job's sizes), so an app rerun with a new micro-batch reuses them."""


def _ddp_grads(comp: Compiled, key: StructureKey, model: ModelSpec, job: Training) -> tuple:
    """(itemsize, numel) of every gradient in ready order for the real layer count
    (`expand_layers`), memoised in `_GRADS`."""
    vals = values_for(model, job)
    sized = any(
        sym in numel.free_symbols
        for _, _, numel, _ in comp.grad_order
        if hasattr(numel, "free_symbols")
        for sym in JOB_SYMBOLS
    )
    memo = (key, model, tuple(vals[sym] for sym in JOB_SYMBOLS) if sized else ())
    if memo not in _GRADS:
        if len(_GRADS) > 1024:
            _GRADS.clear()
        entries = [(tag, int(numel.xreplace(vals)) if hasattr(numel, "xreplace") else numel,
                    itemsize) for _, tag, numel, itemsize in comp.grad_order]  # fmt: skip
        _GRADS[memo] = tuple(expand_layers(entries, model.n_layers))
    return _GRADS[memo]


def ddp_buckets(grads: Sequence[tuple[int, int]], parallel: Parallelism) -> tuple[int, int, int]:
    """(bytes of the step-1 buckets, bytes of the rebuilt buckets, number rebuilt) for the
    gradients ``(itemsize, numel)`` in ready order (`calc.parallel.data`: one bucket per dtype
    in step 1, then ``compute_bucket_assignment_by_size``)."""
    one: dict[int, int] = {}
    for itemsize, numel in grads:
        one[itemsize] = one.get(itemsize, 0) + itemsize * numel
    first = sum(-(-b // 512) * 512 for b in one.values())
    buckets = dpm.assign_buckets(grads, dpm.bucket_limits(parallel))
    return first, sum(dpm.bucket_bytes(grads, buckets)), len(buckets)


def expand_layers(entries: Sequence[tuple], n_layers: int) -> list[tuple[int, int]]:
    """``(itemsize, numel)`` of every parameter in ready order for the real layer count, from
    the replay's ``(tag, numel, itemsize)`` in first-backward order (numels evaluated): a
    replay of five layers stands for ``L`` (the middle layer's sequence repeated)."""
    tags = [tag for tag, _, _ in entries if _is_layer(tag)]
    replayed = max(tags) + 1 if tags else 0
    if replayed == n_layers:
        return [(itemsize, int(numel)) for _, numel, itemsize in entries]
    out: list[tuple[int, int]] = []
    done_layers = False
    middle = [(itemsize, int(numel)) for tag, numel, itemsize in entries if tag == MIDDLE]
    for tag, numel, itemsize in entries:
        if _is_layer(tag):
            if not done_layers:
                out.extend(middle * n_layers)
                done_layers = True
            continue
        out.append((itemsize, int(numel)))
    return out


def _is_layer(tag: object) -> bool:
    return isinstance(tag, int) and not isinstance(tag, bool)
