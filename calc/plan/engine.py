"""The planner's engine: validating a request, building its grid of jobs, and evaluating
jobs in bulk, grouped by compiled structure (``calc.plan.grid``). ``calc.plan`` and
``calc.plan.search`` are its callers; results are the dataclasses of ``calc.plan.result``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TypeGuard

import numpy as np

from calc.compress.lora import check_parallel
from calc.compress.quant import check_fits, library_of, shards_of
from calc.config.compression import LoRA, Quant, QuantMethod
from calc.config.jobs import Inference, Training, check_choice, check_size
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.data.cards import load_verify_report
from calc.data.gpus import GPU, get_gpu
from calc.derive.replay import check_cuda
from calc.estimate.api import estimate
from calc.estimate.core import ReplayOptions, StructureKey
from calc.estimate.ranks import expand_layers, rank_replays
from calc.estimate.workspace import gpu_delta_bytes
from calc.plan import grid as plan_grid
from calc.plan import grid_eval as plan_eval
from calc.plan.axes import (
    INFERENCE,
    TRAINING,
    Axis,
    Context,
    axes_for,
)
from calc.plan.evidence import ErrorBar, VerifiedCase, error_bar, verified_cases
from calc.plan.layouts import default_layout, layout_of
from calc.plan.result import TASKS, Config, Evaluated, RankBy, rank
from calc.plan.throughput import communication_factor, throughput_proxy

KIND_OF_TASK = {
    "pretrain": TRAINING,
    "full-finetune": TRAINING,
    "lora": TRAINING,
    "qlora": TRAINING,
    "inference": INFERENCE,
}
"""Job kind of each task (pretraining and full fine-tuning hold the same tensors; LoRA and
QLoRA are training jobs with ``lora`` (and ``quant``) set, ``task_fields``)."""
NOT_MODELLED_TASKS: dict[str, str] = {}
"""Tasks of ``plan_result.TASKS`` the cost model does not cover (none today)."""
HELD_ON_MANY_GPUS = ("precision", "optimizer")
"""Axes held at the base job's value for training on 2+ GPUs unless ``fixed`` lists values.
Evaluation is vectorised and persisted there too (one table per rank class, layout and
structure, ``calc.plan.grid``), but each table is one symbolic replay (about 0.4 s for
qwen2.5-7b on one core): the default grid of layouts x recompute x micro-batch compiles 33-90
tables once (13-48 s on 2, 4 or 8 GPUs, ``benchmarks/bench_plan.py``); enumerating the
5 precisions x 8 optimizers as well would make that about 40 times more, so they stay held."""
LORA_RANK = 16
"""Adapter rank of ``task="lora"``/``"qlora"`` unless ``base`` sets ``lora`` (a common
default: the QLoRA paper's Guanaco runs use r=64, PEFT's examples 8-16)."""
QLORA_METHOD: QuantMethod = "nf4"
"""Base-weight quantization of ``task="qlora"`` unless ``base`` sets ``quant``: 4-bit
NormalFloat, the QLoRA paper's data type (Dettmers et al. 2023, arXiv 2305.14314, §3)."""


# ---------------------------------------------------------------------------------------------
# validation and the request's context


def check_plannable(model: ModelSpec, kind: str) -> None:
    """Raise ``ValueError`` unless ``model`` is a ``calc.ModelSpec``. Every kind is planned for
    every model; a derived model's training grid holds its structural axes
    (`held_axes`)."""
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a calc.ModelSpec, got {type(model).__name__}")


def held_axes(model: ModelSpec, kind: str, gpu_count: int) -> tuple[str, ...]:
    """Axes held at the base job's value unless ``fixed`` lists values. Training on 2+ GPUs:
    `HELD_ON_MANY_GPUS`. A derived model's training (`calc.derive`), on any count: the same
    axes, since each of its structures is recorded from transformers' code (seconds each,
    ``benchmarks/bench_derive.py``): the grid of one GPU is then recompute x accumulation, 6
    recordings instead of 240."""
    if kind != TRAINING:
        return ()
    if gpu_count > 1 or model.derived:
        return HELD_ON_MANY_GPUS
    return ()


def kind_of(task: object) -> str:
    check_choice("task", task, TASKS)
    if task in NOT_MODELLED_TASKS:
        raise NotImplementedError(NOT_MODELLED_TASKS[str(task)])
    return KIND_OF_TASK[str(task)]


def gpu_of(gpu: object) -> GPU:
    if isinstance(gpu, GPU):
        return gpu
    if not isinstance(gpu, str):
        raise ValueError(
            f"gpu={gpu!r} must be a catalog id (calc.data.gpus.gpu_catalog()) or a GPU"
        )
    return get_gpu(gpu)


def context(kind: str, seq_len: object, global_batch: object, gpu_count: object) -> Context:
    check_size("seq_len", seq_len, 1, 1 << 24)
    check_size("global_batch", global_batch, 1, 1 << 20)
    check_size("gpu_count", gpu_count, 1, 1 << 16)
    assert isinstance(global_batch, int) and isinstance(gpu_count, int)
    assert isinstance(seq_len, int)
    if global_batch % gpu_count:
        raise ValueError(
            f"global_batch={global_batch} must be a multiple of gpu_count={gpu_count} "
            "(each GPU takes the same number of sequences)"
        )
    return Context(kind=kind, seq_len=seq_len, global_batch=global_batch, gpu_count=gpu_count)


def base_fields_of(kind: str, base: Training | Inference | None, task: str = "") -> dict:
    """The fields every job of the grid shares: ``base``'s, less the sizes, plus the task's
    (``task_fields``)."""
    fields: dict = {}
    if base is not None:
        want = Training if kind == TRAINING else Inference
        if not isinstance(base, want):
            raise ValueError(f"base must be a calc.{want.__name__} for this task, got {base!r}")
        fields = {f: getattr(base, f) for f in base.__slots__}
        for size in ("micro_batch", "seq_len", "grad_accum", "batch", "context", "prompt"):
            fields.pop(size, None)
    return task_fields(task, fields)


def task_fields(task: str, fields: dict) -> dict:
    """``fields`` with what ``task`` implies: ``lora`` gets ``calc.LoRA(rank=LORA_RANK)``,
    ``qlora`` also ``calc.Quant(method=QLORA_METHOD)``, unless ``fields`` (the base job) set
    them; ``pretrain``/``full-finetune`` refuse a base with adapters or quantized weights."""
    out = dict(fields)
    if task in ("lora", "qlora") and out.get("lora") is None:
        out["lora"] = LoRA(rank=LORA_RANK)
    if task == "qlora" and out.get("quant") is None:
        out["quant"] = Quant(method=QLORA_METHOD)
    if task == "lora" and out.get("quant") is not None:
        raise ValueError("base.quant is set: quantized-base adapters are task='qlora'")
    if task in ("pretrain", "full-finetune") and out.get("lora") is not None:
        raise ValueError(f"base.lora is set: adapters are task='lora'/'qlora', not {task!r}")
    return out


def make_job(kind: str, fields: Mapping, ctx: Context) -> Training | Inference:
    """The job of ``fields`` at the request's sizes (raises ``ValueError`` if invalid)."""
    fields = {k: v for k, v in fields.items() if k != "parallel"}  # the layout: in choices
    if kind == TRAINING:
        return Training(**{"micro_batch": 1, "seq_len": ctx.seq_len, **fields})
    return Inference(**{"batch": 1, "context": ctx.seq_len, **fields})


def axis_values(
    kind: str, ctx: Context, fixed: Mapping[str, object] | None, base_fields: Mapping,
    held: tuple[str, ...] = (),
) -> list[tuple[Axis, tuple]]:  # fmt: skip
    """Each axis of ``kind`` with the values the grid takes: ``fixed``'s, every allowed value
    of an enumerated axis, else the base job's; ``held`` (`held_axes`) names enumerated axes
    held at the base job's value unless ``fixed`` lists them."""
    axes = axes_for(kind)
    names = {a.name: a for a in axes}
    fixed = dict(fixed or {})
    impls = fixed.get("implementation", base_fields.get("implementation", "hf"))
    listed = impls if isinstance(impls, tuple | list) else (impls,)
    ctx = replace(ctx, implementations=tuple(str(x) for x in listed))
    for name in fixed:
        if name not in names:
            raise ValueError(f"fixed: {name!r} is not an axis of {kind}; axes: {', '.join(names)}")
    out = []
    for axis in axes:
        allowed = axis.values(ctx)
        if axis.name in fixed:
            want = fixed[axis.name]
            values = tuple(want) if isinstance(want, tuple | list) else (want,)
            for v in values:
                if v not in allowed:
                    raise ValueError(
                        f"fixed[{axis.name!r}]={v!r} is not allowed here; allowed: "
                        f"{', '.join(map(repr, allowed))}"
                    )
            if not values:
                raise ValueError(f"fixed[{axis.name!r}] is empty; allowed: {allowed}")
        elif axis.enumerated and axis.name not in held:
            values = allowed
        else:
            values = (axis.current(make_job(kind, base_fields, ctx)),)
        out.append((axis, values))
    return _policy_layouts_with_fp32(out, fixed, ctx.gpu_count)


def _policy_layouts_with_fp32(
    out: list[tuple[Axis, tuple]], fixed: Mapping[str, object], gpu_count: int
) -> list[tuple[Axis, tuple]]:
    """``out`` without the layouts of FSDP2's ``MixedPrecisionPolicy`` (``fsdp-mp``: it casts
    an fp32 model) where the grid takes no ``precision="fp32"``, unless ``fixed`` names the
    layouts."""
    precisions = next((v for a, v in out if a.name == "precision"), ())
    if "parallel" in fixed or "fp32" in precisions:
        return out
    return [
        (a, tuple(x for x in v if layout_of(x, gpu_count).fsdp_param_dtype == "none"))
        if a.name == "parallel"
        else (a, v)
        for a, v in out
    ]


# ---------------------------------------------------------------------------------------------
# evaluation of a list of jobs, grouped by compiled structure


class Evaluator:
    """Evaluates jobs of one model against one GPU, sharing structures and sizes."""

    def __init__(
        self, model: ModelSpec, ctx: Context, gpu: GPU, device: str,
        cases: Sequence[VerifiedCase], progress: Callable[[int, int], None] | None = None,
        layout: str | None = None,
    ) -> None:  # fmt: skip
        """``layout``: the training layout of jobs given without one (``choices``); default
        ``calc.plan.layouts.default_layout``."""
        self.model, self.ctx, self.gpu, self.device = model, ctx, gpu, device
        if layout is not None:
            layout_of(layout, ctx.gpu_count)  # ValueError naming the allowed labels
        self.layout = layout
        self.cases = cases
        self.progress = progress
        self.compiled_now = 0
        self._bars: dict = {}

    def choices(self, job: Training | Inference) -> dict[str, object]:
        out = {a.name: a.current(job) for a in axes_for(self.ctx.kind)}
        if "parallel" in out:  # a job does not carry its layout: the default one
            out["parallel"] = self.layout or default_layout(self.ctx.gpu_count)
        return out

    def _row(
        self, choices: Mapping, job: Training | Inference | None, *, reason: str,
        peak_bytes: int | None = None, fits: bool = False, headroom_bytes: int | None = None,
        throughput_proxy: float = 0.0, error_bar: ErrorBar | None = None, peak_phase: str = "",
        parallel: Parallelism | None = None,
    ) -> Evaluated:  # fmt: skip
        """A row of the answer; without a peak, a configuration excluded for ``reason``."""
        grad_accum = job.grad_accum if isinstance(job, Training) else 1
        config = Config(
            job=job, gpu_count=self.ctx.gpu_count, choices=dict(choices), grad_accum=grad_accum
        )
        return Evaluated(
            config=config, usable_bytes=self.gpu.usable_for(parallel), gpu_id=self.gpu.id,
            peak_bytes=peak_bytes, fits=fits, headroom_bytes=headroom_bytes,
            throughput_proxy=throughput_proxy, reason=reason, error_bar=error_bar,
            peak_phase=peak_phase,
        )  # fmt: skip

    def _bar(self, key: object, job: Training | Inference) -> ErrorBar | None:
        if key not in self._bars:
            self._bars[key] = error_bar(job, self.model, self.cases, self.device)
        return self._bars[key]

    def _workspace(self, job: Training | Inference) -> int:
        """This GPU's cuBLAS workspaces less the Hopper charge the compiled tables carry
        (`calc.estimate.workspace.gpu_delta_bytes`: by compute capability)."""
        return gpu_delta_bytes(job, self.device, self.gpu)

    def _verdict(self, peak: int, parallel: Parallelism | None = None) -> tuple[int, bool, str]:
        """Headroom, fits and the reason against ``GPU.usable_for(parallel)``: the total less
        the memory outside PyTorch (`calc.data.outside`, NCCL's buffers on several GPUs)."""
        usable = self.gpu.usable_for(parallel)
        headroom = usable - peak
        reason = "" if headroom >= 0 else (
            f"peak {peak / 2**30:.2f} GiB > {usable / 2**30:.2f} GiB "
            f"usable on {self.gpu.id}: needs {-headroom / 2**30:.2f} GiB more"
        )  # fmt: skip
        return headroom, headroom >= 0, reason

    def _layout(
        self, choices: Mapping, job: Training | Inference
    ) -> tuple[Mapping, Training | Inference, str, Parallelism]:
        return layout_job(choices, job, self.ctx.gpu_count)

    def _parallel_done(
        self, choices: Mapping, job: Training | Inference, label: str, parallel: Parallelism,
        peak: int, phase: str,
    ) -> Evaluated:  # fmt: skip
        headroom, fits, reason = self._verdict(peak, parallel)
        key = ("parallel", label, plan_grid.structure_id(self.model, job))
        comm = communication_factor(parallel)
        return self._row(
            choices, job, peak_bytes=peak, fits=fits, headroom_bytes=headroom,
            throughput_proxy=throughput_proxy(self.model, job, comm), reason=reason,
            error_bar=self._bar(key, job), peak_phase=phase, parallel=parallel,
        )  # fmt: skip

    def _parallel_row(self, choices: Mapping, job: Training | Inference) -> Evaluated:
        """One multi-GPU training configuration through ``calc.estimate(model, job, parallel)``
        (``calc.estimate.ranks``), one call per configuration: the fallback for what ``_parallel_group``
        does not vectorise (``vectorised``: pipeline or context parallelism, pruning,
        distillation)."""
        choices, job, label, parallel = self._layout(choices, job)
        try:
            est = estimate(self.model, job, parallel, self.device, gpu=self.gpu)
        except NotImplementedError as exc:
            return self._row(choices, job, reason=f"not modelled: {exc}")
        except ValueError as exc:
            return self._row(choices, job, reason=f"invalid: {exc}")
        return self._parallel_done(choices, job, label, parallel, est.peak_bytes, est.peak_phase)

    def _parallel_entry(
        self, choices: Mapping, job: Training | Inference
    ) -> Evaluated | tuple[tuple, tuple]:
        """A multi-GPU training entry: its row when it is settled now (invalid, not modelled,
        or not vectorised: ``_parallel_row``), else its group key and what its rows need."""
        choices, job, label, parallel = self._layout(choices, job)
        if not vectorised(job, parallel):
            return self._parallel_row(choices, job)
        try:
            check_compressed(self.model, job, parallel)
            replays = rank_replays(self.model, job, parallel, self.device)
        except NotImplementedError as exc:
            return self._row(choices, job, reason=f"not modelled: {exc}")
        except ValueError as exc:
            return self._row(choices, job, reason=f"invalid: {exc}")
        key = (label, plan_grid.structure_id(self.model, job))
        return key, (choices, job, label, parallel, replays)

    def _parallel_group(self, items: list[tuple], points: dict) -> list[Evaluated]:
        """Rows of multi-GPU entries sharing a layout and a structure: per class of ranks, one
        vectorised evaluation of every micro-batch (``calc.plan.grid_eval.grid_peaks`` over the
        class's table, ``calc.plan.grid``, with DDP's buckets and the other constants of
        ``calc.estimate.ranks`` as per-step extras); each row's peak is the most-loaded class's (ties:
        the lowest rank), as ``calc.estimate.ranks.estimate_parallel`` takes it."""
        replays = items[0][4]
        jobs = [it[1] for it in items]
        b, s, c = (np.array(v) for v in zip(*(sizes_of(j) for j in jobs), strict=True))
        best_peak = np.full(len(items), -1, dtype=np.int64)
        best_rank = np.zeros(len(items), dtype=np.int64)
        best_phase = [""] * len(items)
        for rr in replays:
            try:
                table, fresh = plan_grid.structure_table(rr.model, rr.job, self.device,
                                                         opts=rr.options)  # fmt: skip
            except ValueError:
                return [self._parallel_row(it[0], it[1]) for it in items]
            self.compiled_now += int(fresh)
            if table.not_modelled:
                reason = f"not modelled: {table.not_modelled}"
                return [self._row(it[0], it[1], reason=reason) for it in items]
            grads = None
            if rr.ddp:
                grads = plan_eval.grad_numels(table, rr.model)
                if grads is None:  # sizes that depend on the job: evaluate one by one
                    return [self._parallel_row(it[0], it[1]) for it in items]
                grads = expand_layers(grads, rr.model.n_layers)
            extras, _notes = rr.finish(grads)
            step1 = sum(e[1] for e in extras)
            later = sum(e[2] for e in extras)
            dims = tuple(int(v) for v in rr.model.dims().values())
            memo = points.setdefault((dims, tuple(b), tuple(s), tuple(c)), {})
            peaks = plan_eval.grid_peaks(
                rr.model, rr.job, b, s, c, device=self.device, table=table, memo=memo,
                extras=(step1, later),
            )  # fmt: skip
            rank0 = rr.rank_class.ranks[0]
            for n in range(len(items)):
                peak = int(peaks.peak_bytes[n])
                if peak > best_peak[n] or (peak == best_peak[n] and rank0 < best_rank[n]):
                    best_peak[n], best_rank[n] = peak, rank0
                    best_phase[n] = peaks.phases[int(peaks.phase_index[n])]
        return [
            self._parallel_done(
                ch, job, label, par, int(best_peak[n]) + self._workspace(job), best_phase[n]
            )
            for n, (ch, job, label, par, _r) in enumerate(items)
        ]

    def _single_group(
        self, key: StructureKey, members: list[tuple[Mapping, Training | Inference]], points: dict
    ) -> list[Evaluated]:
        """Rows of one-GPU entries ``(choices, job)`` sharing the compiled structure ``key``:
        one vectorised evaluation of all their sizes (``calc.plan.grid_eval.grid_peaks``)."""
        jobs = [job for _, job in members]
        exemplar = jobs[0]
        refused = self._cuda_refusal(exemplar)
        if refused:
            return [self._row(choices, job, reason=refused) for choices, job in members]
        table, fresh = plan_grid.structure_table(self.model, exemplar, self.device)
        self.compiled_now += int(fresh)
        if table.not_modelled:
            reason = f"not modelled: {table.not_modelled}"
            return [self._row(choices, job, reason=reason) for choices, job in members]
        b, s, c = zip(*(sizes_of(j) for j in jobs), strict=True)
        memo_here = points.setdefault((b, s, c), {})
        peaks = plan_eval.grid_peaks(
            self.model, exemplar, np.array(b), np.array(s), np.array(c),
            device=self.device, table=table, memo=memo_here,
        )  # fmt: skip
        bar = self._bar(key, exemplar)
        rows = []
        for n, (choices, job) in enumerate(members):
            peak = int(peaks.peak_bytes[n]) + self._workspace(job)
            headroom, fits, reason = self._verdict(peak)
            rows.append(self._row(
                choices, job, peak_bytes=peak, fits=fits, headroom_bytes=headroom,
                throughput_proxy=throughput_proxy(self.model, job), reason=reason,
                error_bar=bar, peak_phase=peaks.phases[int(peaks.phase_index[n])],
            ))  # fmt: skip
        return rows

    def _cuda_refusal(self, job: Training | Inference) -> str:
        """Why a derived model's ``job`` is not modelled on CUDA (``calc.derive.replay.
        check_cuda``: the recording's CPU kernel is not the one CUDA runs, as ``calc.estimate``
        refuses it), or ``""``. A hand graph refuses such a job while it compiles."""
        if self.device != "cuda" or not self.model.derived:
            return ""
        try:
            check_cuda(self.model, job)
        except (NotImplementedError, ValueError) as exc:
            return f"not modelled: {exc}"
        return ""

    def _group(
        self, entries: Sequence[tuple[Mapping, Training | Inference | str]],
        out: list[Evaluated | None],
    ) -> tuple[dict[StructureKey, list], dict[tuple, list]]:  # fmt: skip
        """Rows settled now (invalid, not modelled) into ``out``; the other entries grouped for
        evaluation in bulk: ``(one-GPU groups by structure, multi-GPU groups by layout and
        structure)``, each member led by its index in ``entries``."""
        groups: dict[StructureKey, list] = {}
        par_groups: dict[tuple, list] = {}
        for i, (choices, job) in enumerate(entries):
            if not isinstance(job, str) and job.quant is not None:
                job = _check_quant(self.model, job, job.quant)
            if isinstance(job, str):
                out[i] = self._row(choices, None, reason=job)
            elif self.ctx.kind == TRAINING and self.ctx.gpu_count > 1:
                got = self._parallel_entry(choices, job)
                if isinstance(got, Evaluated):
                    out[i] = got
                else:
                    par_groups.setdefault(got[0], []).append((i, got[1]))
            else:
                key = plan_grid.structure_id(self.model, job)
                groups.setdefault(key, []).append((i, (choices, job)))
        return groups, par_groups

    def run(self, entries: Sequence[tuple[Mapping, Training | Inference | str]]) -> list[Evaluated]:
        """``entries``: (choices, job) or (choices, "invalid: ..." message)."""
        out: list[Evaluated | None] = [None] * len(entries)
        groups, par_groups = self._group(entries, out)
        points: dict = {}  # sizes evaluated once per set of points, shared by structures
        total = len(groups) + len(par_groups)
        for n_done, members in enumerate(par_groups.values()):
            if self.progress is not None:
                self.progress(n_done, total)
            rows = self._parallel_group([item for _, item in members], points)
            for (i, _), row in zip(members, rows, strict=True):
                out[i] = row
        for n_done, (key, members) in enumerate(groups.items(), start=len(par_groups)):
            if self.progress is not None:
                self.progress(n_done, total)
            rows = self._single_group(key, [item for _, item in members], points)
            for (i, _), row in zip(members, rows, strict=True):
                out[i] = row
        if self.progress is not None:
            self.progress(total, total)
        return [e for e in out if e is not None]


def layout_job(
    choices: Mapping, job: Training | Inference, gpu_count: int
) -> tuple[Mapping, Training | Inference, str, Parallelism]:
    """A multi-GPU row's choices and job, its layout label and ``Parallelism``: tensor
    parallelism runs the reference modeling code (the row's choices say so)."""
    label = str(choices.get("parallel") or default_layout(gpu_count))
    parallel = layout_of(label, gpu_count)
    if parallel.tp > 1 and isinstance(job, Training) and job.implementation == "hf":
        # tensor parallelism is replayed for the reference modeling code only (Megatron-
        # style column/row splits, calc.parallel.tensor): the row says so in its choices
        job = replace(job, implementation="reference")
        choices = {**choices, "implementation": "reference"}
    return choices, job, label, parallel


def vectorised(job: Training | Inference, parallel: Parallelism) -> TypeGuard[Training]:
    """Whether the planner evaluates ``job`` under ``parallel`` from its rank classes' tables
    (``calc.estimate.ranks.rank_replays``; LoRA and QLoRA jobs after ``calc.compress.lora.check_parallel``, as
    ``calc.estimate`` checks them); else one ``calc.estimate`` call per configuration:
    pipeline and context parallelism, pruning and distillation."""
    other = any(getattr(job, f, None) is not None for f in ("pruning", "distill"))
    return isinstance(job, Training) and not other and parallel.pp == 1 and parallel.cp == 1


def check_compressed(model: ModelSpec, job: Training, parallel: Parallelism) -> None:
    """``calc.estimate``'s check of a LoRA/QLoRA job on several GPUs (``NotImplementedError``
    for the layouts the cost model does not cover with adapters; ``ValueError`` for a
    quantized base its shards cannot split)."""
    if job.lora is not None or job.quant is not None:
        check_parallel(job, parallel)
    if job.quant is not None:
        check_fits(model, job.quant, library_of(job), shards_of(parallel))


def parallel_tables(
    model: ModelSpec,
    ctx: Context,
    entries: Sequence[tuple[Mapping, Training | Inference | str]],
    device: str,
) -> dict[tuple, tuple[ModelSpec, Training, ReplayOptions]]:
    """The rank-class tables (``calc.plan.grid.structure_table`` arguments: rank model, rank
    job, replay options) a multi-GPU training plan of ``entries`` evaluates, by structure;
    each job also with grad_accum 1 or 2 (the other of the two structures)."""
    out: dict[tuple, tuple[ModelSpec, Training, ReplayOptions]] = {}
    for choices, job in entries:
        if isinstance(job, str):
            continue
        _ch, job, _label, parallel = layout_job(choices, job, ctx.gpu_count)
        if not vectorised(job, parallel):
            continue
        for accum in dict.fromkeys((job.grad_accum, 2 if job.grad_accum == 1 else 1)):
            try:
                check_compressed(model, job, parallel)
                replays = rank_replays(model, replace(job, grad_accum=accum), parallel, device)
            except (NotImplementedError, ValueError):
                continue
            for rr in replays:
                key = plan_grid.structure_id(rr.model, rr.job, rr.options)
                out.setdefault((key, rr.options.exact_layers and rr.model.n_layers),
                               (rr.model, rr.job, rr.options))  # fmt: skip
    return out


def _check_quant(
    model: ModelSpec, job: Training | Inference, quant: Quant
) -> Training | Inference | str:
    """``job``, or an ``invalid:`` reason when its quantization (``quant``) has a group size
    that does not divide the model's linears (``calc.compress.quant.check_fits``, as
    ``calc.estimate`` checks)."""
    try:
        check_fits(model, quant, library_of(job))
    except ValueError as exc:
        return f"invalid: {exc}"
    return job


def sizes_of(job: Training | Inference) -> tuple[int, int, int]:
    if isinstance(job, Training):
        return job.micro_batch, job.seq_len, job.seq_len
    return job.batch, job.prompt_len, job.context


def grid_entries(
    kind: str, ctx: Context, axis_values: list[tuple[Axis, tuple]], base_fields: Mapping
) -> list[tuple[dict, Training | Inference | str]]:
    entries: list[tuple[dict, Training | Inference | str]] = []
    names = [a.name for a, _ in axis_values]
    for combo in itertools.product(*(values for _, values in axis_values)):
        fields = dict(base_fields)
        for (axis, _), value in zip(axis_values, combo, strict=True):
            axis.apply(fields, value, ctx)
        choices = dict(zip(names, combo, strict=True))
        try:
            entries.append((choices, make_job(kind, fields, ctx)))
        except ValueError as exc:
            entries.append((choices, f"invalid: {exc}"))
    return entries


def split(rows: Iterable[Evaluated], rank_by: RankBy) -> tuple[tuple, tuple]:
    rows = list(rows)
    fitting = rank(tuple(e for e in rows if e.fits), rank_by)
    missing = sorted(
        (e for e in rows if not e.fits and e.modelled),
        key=lambda e: (-(e.headroom_bytes or 0), -e.throughput_proxy),
    )
    other = [e for e in rows if not e.modelled]
    return fitting, tuple(missing + other)


def verified_cases_of(report: Mapping | None, use_report: bool) -> tuple[VerifiedCase, ...]:
    if not use_report:
        return ()
    if report is None:
        report = load_verify_report()
    return verified_cases(report)


def job_context(job: Training | Inference, gpu_count: int, layout: str | None = None) -> Context:
    """The request a single job stands for: training's global batch is ``micro_batch x
    grad_accum x dp`` (``dp`` of ``layout``, default DDP over every GPU)."""
    check_size("gpu_count", gpu_count, 1, 1 << 16)
    if isinstance(job, Training):
        dp = layout_of(layout or default_layout(gpu_count), gpu_count).dp
        per_replica = job.micro_batch * job.grad_accum
        return Context(kind=TRAINING, seq_len=job.seq_len, global_batch=per_replica * dp,
                       gpu_count=gpu_count)  # fmt: skip
    return Context(kind=INFERENCE, seq_len=job.context, global_batch=job.batch * gpu_count,
                   gpu_count=gpu_count)  # fmt: skip
