"""The most-loaded GPU of a parallel job: one replay per kind of rank, then the maximum.

`estimate_parallel` splits the world (``dp x tp x pp x cp`` ranks) into classes of ranks that
hold the same tensors (`calc.parallel.rank_classes`), replays the step once per class with the
sharding layer's view of that rank (`calc.parallel.holding` decides, tensor by tensor, what
the rank keeps), adds the constant storages outside the replay (DDP's buckets), and returns
the estimate of the rank with the highest peak, with every rank's peak in
``Estimate.rank_peaks`` and in the breakdown under ``ranks/<r>``.
"""

from __future__ import annotations

from dataclasses import replace

from calc import data_parallel as dpm
from calc.estimate import ReplayOptions, compiled_for, evaluate, values_for
from calc.jobs import Training
from calc.model_spec import ModelSpec
from calc.parallel import Parallelism, RankClass, check_divisibility, rank_classes
from calc.result import Estimate
from calc.timeline import MIDDLE


def estimate_parallel(
    model: ModelSpec, job: Training, parallel: Parallelism, device: str
) -> Estimate:
    """The most-loaded rank of ``job`` run under ``parallel`` (see the module docstring)."""
    if not isinstance(job, Training):
        raise NotImplementedError("parallel layouts are modelled for training only")
    check_divisibility(model, parallel)
    if parallel.cp > 1:  # analytic: each rank runs s / cp tokens (calc.context_parallel)
        from calc.context_parallel import rank_job

        job = rank_job(job, parallel)
    results: list[tuple[RankClass, Estimate]] = []
    if parallel.pp > 1:  # one replay per pipeline stage (calc.pipeline)
        from calc.pipeline import stage_results

        results = stage_results(model, job, parallel, device)
    from calc.lora import trainable_numels

    for rc in (
        rank_classes(model, parallel, trainable_numels(model, job)) if parallel.pp == 1 else ()
    ):
        results.append((rc, _estimate_class(model, job, parallel, rc, device)))
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


def _estimate_class(
    model: ModelSpec, job: Training, parallel: Parallelism, rc: RankClass, device: str
) -> Estimate:
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
    comp, key = compiled_for(local, job, device, opts)
    extras: list[tuple[str, int, int]] = []
    notes: list[str] = list(rc.notes)
    if rc.ddp:
        first, later, n_buckets = _ddp_buckets(comp.grad_order, local, job, parallel)
        extras.append(("ddp/gradient_buckets", first, later))
        notes.append(
            f"DDP gradient buckets: 1 bucket in step 1, {n_buckets} after the rebuild "
            f"({'gradients are bucket views' if parallel.gradient_as_bucket_view else 'plus .grad'})"
        )
    if parallel.cp > 1:
        from calc.context_parallel import ring_kv_bytes

        kv = ring_kv_bytes(local, job)
        extras.append(("context_parallel/ring_kv", kv, kv))
        notes.append(
            f"context parallel (analytic, not verified): {job.seq_len} tokens per rank, "
            f"ring attention K/V chunks in flight {kv} B"
        )
    if plan.fsdp and device == "cpu" and parallel.world_size == parallel.dp:
        # One DeviceMesh per fully_shard call holds its ranks as a CPU int64 tensor
        # (``init_device_mesh``: ``torch.arange(world_size)``); on a GPU run it stays in host
        # memory, under the CPU tracker it counts (measured: one 512 B block per group). With
        # a 2-D layout the dp mesh is built once, before the model (none per call).
        groups = local.n_layers + 1
        extras.append(("fsdp/device_mesh_cpu", groups * 512, groups * 512))
        notes.append(f"CPU only: {groups} DeviceMesh rank tensors of 512 B")
    return evaluate(comp, key, local, job, device, tuple(extras), tuple(notes))


def _ddp_buckets(
    grad_order: tuple, model: ModelSpec, job: Training, parallel: Parallelism
) -> tuple[int, int, int]:
    """(bytes of the step-1 buckets, bytes of the rebuilt buckets, number rebuilt)."""
    vals = values_for(model, job)
    entries = _expand_layers(grad_order, model.n_layers)
    grads = [(itemsize, int(numel.subs(vals)) if hasattr(numel, "subs") else int(numel))
             for numel, itemsize in entries]  # fmt: skip
    one: dict[int, int] = {}
    for itemsize, numel in grads:
        one[itemsize] = one.get(itemsize, 0) + itemsize * numel
    first = sum(-(-b // 512) * 512 for b in one.values())
    buckets = dpm.assign_buckets(grads, dpm.bucket_limits(parallel))
    return first, sum(dpm.bucket_bytes(grads, buckets)), len(buckets)


def _expand_layers(grad_order: tuple, n_layers: int) -> list[tuple]:
    """``(numel, itemsize)`` of every parameter in ready order for the real layer count: a
    replay of five layers stands for ``L`` (the middle layer's sequence repeated)."""
    tags = [tag for _, tag, _, _ in grad_order if isinstance(tag, int)]
    replayed = max(tags) + 1 if tags else 0
    if replayed == n_layers:
        return [(numel, itemsize) for _, _, numel, itemsize in grad_order]
    out: list[tuple] = []
    done_layers = False
    middle = [(numel, itemsize) for _, tag, numel, itemsize in grad_order if tag == MIDDLE]
    for _, tag, numel, itemsize in grad_order:
        if isinstance(tag, int):
            if not done_layers:
                out.extend(middle * n_layers)
                done_layers = True
            continue
        out.append((numel, itemsize))
    return out
