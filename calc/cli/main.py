"""``python -m calc``: the memory estimate of one job, as a table and a verdict.

The command line only wires arguments to the library: a model (a card id or a user's
``config.json``), a job (``calc.Training`` or ``calc.Inference``, whose constructors validate
every field), ``calc.estimate``, and the display. Bytes stay bytes until this module prints
them, in GiB (2**30 bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from calc.cli import compression as cli_compression
from calc.cli import plan as cli_plan
from calc.cli import progress_bar
from calc.cli import prune_distill as cli_prune_distill
from calc.cli import report as cli_report
from calc.cli import serve as cli_serve
from calc.cli.exits import run_reporting_errors
from calc.cli.model_source import DEFAULT_CARD, MODEL_HELP, load_model
from calc.config import jobs
from calc.config.jobs import Inference, Sampling, Training
from calc.config.parallelism import OFFLOADS, PIPELINE_SCHEDULES, Parallelism
from calc.data.cards import list_cards
from calc.data.gpus import DEFAULT_GPU, GPU, get_gpu
from calc.derive.replay import param_count
from calc.estimate.api import estimate
from calc.estimate.device_fit import DeviceFit, device_fits
from calc.estimate.result import GIB, Estimate

DEFAULT_TRAINING: dict[str, int] = {"micro_batch": 1, "seq_len": 2048}
"""Sizes of the default training job: ``calc.Training`` requires them."""
DEFAULT_INFERENCE: dict[str, int] = {"batch": 1, "context": 4096}
"""Sizes of the default inference job: ``calc.Inference`` requires them."""

# Command-line option dest -> the job field it sets. Options shared by both jobs are in both.
TRAINING_FIELDS: tuple[str, ...] = (
    "micro_batch",
    "seq_len",
    "precision",
    "optimizer",
    "optimizer_impl",
    "recompute",
    "recompute_every",
    "attention",
    "implementation",
    "grad_accum",
    "weight_decay",
    "dropout",
    "zero_grad",
    "loop",
    "loss",
    "loss_chunks",
    "optimizer_in_backward",
    "paged_optimizer",
    "offload_activations",
    "compile",
)
INFERENCE_FIELDS: tuple[str, ...] = (
    "batch",
    "context",
    "prompt",
    "precision",
    "attention",
    "implementation",
    "new_tokens",
    "num_beams",
    "num_return_sequences",
    "output_scores",
    "output_logits",
    "cache",
    "padding",
)


def _choices(values: Sequence[str]) -> str:
    return ", ".join(values)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser. Choice-valued job fields are validated by the job classes (one
    message naming the field, the value and the allowed values), not by argparse."""
    p = argparse.ArgumentParser(
        prog="python -m calc",
        description="Predict the peak GPU memory (torch.cuda.max_memory_allocated) of one "
        "training step or one inference prefill, per GPU, and whether it fits.",
        epilog="subcommands: 'python -m calc plan ...' (which configurations fit on which GPUs; "
        "plan --help) and 'python -m calc report ...' (the least memory per task and weight "
        "width; report --help).",
    )
    model = p.add_argument_group("model")
    src = model.add_mutually_exclusive_group()
    src.add_argument("--card", metavar="ID", help=f"model card id (default {DEFAULT_CARD})")
    src.add_argument(
        "--config", metavar="PATH", type=Path, help="a Hugging Face config.json to read instead"
    )
    src.add_argument("--model", metavar="ORG/NAME", help=MODEL_HELP)
    src.add_argument("--list-cards", action="store_true", help="print the card ids and exit")

    p.add_argument("--task", choices=("train", "infer"), default="train", help="default: train")

    both = p.add_argument_group("training and inference")
    both.add_argument(
        "--precision",
        help=f"training: {_choices(jobs.PRECISIONS)} (default amp-bf16); "
        f"inference: {_choices(jobs.INFERENCE_PRECISIONS)} (default bf16)",
    )
    both.add_argument("--attention", help=f"{_choices(jobs.ATTENTIONS)} (default sdpa)")
    both.add_argument(
        "--implementation", help=f"modeling code: {_choices(jobs.IMPLEMENTATIONS)} (default hf)"
    )

    train = p.add_argument_group("training (--task train)")
    train.add_argument(
        "--micro-batch",
        type=int,
        help=f"sequences per micro-batch (default {DEFAULT_TRAINING['micro_batch']})",
    )
    train.add_argument(
        "--seq-len", type=int, help=f"tokens per sequence (default {DEFAULT_TRAINING['seq_len']})"
    )
    train.add_argument(
        "--optimizer",
        help=f"{_choices(jobs.OPTIMIZERS)}, or none for forward and backward alone (default adamw)",
    )
    train.add_argument(
        "--optimizer-impl", help=f"{_choices(jobs.OPTIMIZER_IMPLS)} (default foreach)"
    )
    train.add_argument("--recompute", help=f"{_choices(jobs.RECOMPUTES)} (default none)")
    train.add_argument(
        "--recompute-every",
        type=int,
        help="with --recompute full: checkpoint layers 0, n, 2n, ... only (default 1: all)",
    )
    train.add_argument(
        "--grad-accum", type=int, help="micro-batches per optimizer step (default 1)"
    )
    train.add_argument("--weight-decay", type=float, help="weight decay (default 0)")
    train.add_argument(
        "--dropout", type=float, help="dropout probability everywhere (default: the config's)"
    )
    train.add_argument("--zero-grad", help=f"{_choices(jobs.ZERO_GRADS)} (default after_step)")
    train.add_argument(
        "--loop", help=f"who holds the model's output: {_choices(jobs.LOOPS)} (default drop-output)"
    )
    train.add_argument("--loss", help=f"{_choices(jobs.LOSSES)} (default cross-entropy)")
    train.add_argument("--loss-chunks", type=int, help="chunks of --loss chunked-ce (default 8)")
    train.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        default=None,
        help="step each parameter as soon as its gradient is ready (torchtune optimizer_in_bwd)",
    )
    train.add_argument(
        "--offload-activations",
        action="store_true",
        default=None,
        help="saved activations in pinned host memory (needs --recompute full): torchtune's "
        "enable_activation_offloading, or transformers' checkpoint offload (hf)",
    )
    train.add_argument(
        "--paged-optimizer",
        action="store_true",
        default=None,
        help="bitsandbytes' paged optimizer (with --optimizer adam8bit or adam32bit): large "
        "params' states in CUDA managed memory, outside PyTorch's allocator",
    )
    train.add_argument(
        "--compile",
        help=f"{_choices(jobs.COMPILES)}: default is torch.compile(model), recorded from "
        "Inductor's generated code at this batch and sequence, one GPU (default none)",
    )
    cli_compression.add_arguments(p)  # --quant, --kv-quant, --lora-rank, ...

    infer = p.add_argument_group("inference (--task infer)")
    infer.add_argument(
        "--batch",
        type=int,
        help=f"sequences served together (default {DEFAULT_INFERENCE['batch']})",
    )
    infer.add_argument(
        "--context",
        type=int,
        help=f"tokens in the KV cache per sequence (default {DEFAULT_INFERENCE['context']})",
    )
    infer.add_argument("--prompt", type=int, help="tokens in the prefill (default: --context)")
    infer.add_argument(
        "--new-tokens",
        type=int,
        help="tokens HF generate makes after --prompt (greedy); the context is then prompt + "
        "new tokens (default 0: the prefill alone)",
    )
    infer.add_argument(
        "--num-beams",
        type=int,
        help="generate with beam search of this many beams per sequence (default 1: none); "
        "with --sample, beam sampling",
    )
    infer.add_argument(
        "--num-return-sequences",
        type=int,
        help="sequences generate returns per prompt (default 1); more needs --sample (each "
        "prompt then decoded as that many rows) or --num-beams at least as large",
    )
    infer.add_argument(
        "--cache", help=f"generate's KV cache: {_choices(jobs.CACHE_IMPLS)} (default dynamic)"
    )
    infer.add_argument(
        "--padding",
        help=f"the prompts' attention mask: {_choices(jobs.PADDINGS)} (default none; left: "
        "prompts of different lengths left-padded to --prompt, their mask passed)",
    )
    infer.add_argument(
        "--output-scores",
        action="store_true",
        default=None,
        help="generate(return_dict_in_generate=True, output_scores=True): each step's fp32 "
        "scores kept until generate returns",
    )
    infer.add_argument(
        "--output-logits",
        action="store_true",
        default=None,
        help="generate(return_dict_in_generate=True, output_logits=True): each step's raw fp32 "
        "logits kept the same way",
    )
    infer.add_argument(
        "--sample",
        action="store_true",
        help="generate with do_sample=True (calc.Sampling; default greedy); its processors: "
        "--temperature, --top-k (default 50), --top-p, --repetition-penalty",
    )
    infer.add_argument("--temperature", type=float, help="sampling temperature (default 1)")
    infer.add_argument("--top-k", type=int, help="top-k of sampling (default 50; 0: off)")
    infer.add_argument("--top-p", type=float, help="top-p of sampling (default 1: off)")
    infer.add_argument(
        "--repetition-penalty", type=float, help="repetition penalty (default 1: off)"
    )

    par = p.add_argument_group("parallelism (training; calc.Parallelism, default: one GPU)")
    for flag, hlp in (
        ("--dp", "data-parallel degree (default 1)"),
        ("--tp", "tensor-parallel degree (default 1)"),
        ("--pp", "pipeline-parallel degree (default 1)"),
        ("--cp", "context-parallel degree (default 1)"),
        ("--zero", "ZeRO stage over dp: 0 (DDP), 1, 2, 3 (default 0)"),
        ("--pp-microbatches", "micro-batches per step through the pipeline (default 1)"),
        ("--pp-virtual-stages", "model chunks per pipeline rank (default 1)"),
        ("--ddp-bucket-mib", "DDP bucket_cap_mb (default: torch's, 1 MiB first then 25 MiB)"),
        ("--dp-replicate", "with --fsdp: HSDP replicas, each sharding over dp / N ranks"),
    ):
        par.add_argument(flag, type=int, help=hlp)
    par.add_argument("--pp-schedule", help=f"{_choices(PIPELINE_SCHEDULES)} (default 1f1b)")
    par.add_argument("--offload", help=f"{_choices(OFFLOADS)} (default none)")
    par.add_argument(
        "--fsdp-version",
        type=int,
        help="with --fsdp: 2 (fully_shard, default) or 1 (FullyShardedDataParallel)",
    )
    par.add_argument(
        "--fsdp-output-dtype",
        help="FSDP2 MixedPrecisionPolicy output_dtype: none, fp32, bf16 (default none)",
    )
    par.add_argument(
        "--fsdp-param-dtype",
        help="FSDP2 MixedPrecisionPolicy param_dtype: none, bf16 (default none)",
    )
    par.add_argument(
        "--fsdp-reduce-dtype",
        help="FSDP2 MixedPrecisionPolicy reduce_dtype: none, fp32, bf16 (default none)",
    )
    for flag, hlp in (
        ("--sp", "sequence parallelism with --tp"),
        ("--fsdp", "PyTorch FSDP per layer and root (ZeRO-3 sharding; --fsdp-version)"),
        ("--fsdp-use-orig-params", "FSDP1 use_orig_params=True (LoRA under FSDP1)"),
        ("--gradient-as-bucket-view", "DDP gradient_as_bucket_view=True"),
        ("--vocab-parallel", "with --tp: vocabulary-parallel embedding and loss"),
        ("--expert-parallel", "with --tp on a derived MoE model: experts spread over tp ranks"),
        ("--no-reshard-after-forward", "FSDP2 reshard_after_forward=False"),
        ("--no-fsdp-cast-forward-inputs", "FSDP2 MixedPrecisionPolicy cast_forward_inputs=False"),
    ):
        par.add_argument(flag, action="store_true", default=None, help=hlp)

    cli_prune_distill.add_arguments(p)

    out = p.add_argument_group("output")
    out.add_argument(
        "--device",
        choices=jobs.DEVICES,
        default="cuda",
        help="predict torch.cuda.max_memory_allocated (cuda, default) or the CPU tracker (cpu)",
    )
    out.add_argument(
        "--gpu",
        default=DEFAULT_GPU,
        help=f"GPU catalog id for the verdict: its usable memory, as the app and the planner "
        f"use it (default {DEFAULT_GPU}; python -m calc plan --list-gpus)",
    )
    out.add_argument(
        "--gpu-gib", type=float, help="GPU memory for the verdict in GiB, instead of --gpu's"
    )
    out.add_argument(
        "--reserved",
        action="store_true",
        help="also replay the CUDA caching allocator (default and expandable segments): "
        "reserved memory and what nvidia-smi would show against --gpu's total (seconds)",
    )
    out.add_argument("--depth", type=int, help="show the breakdown down to this depth (1 = top)")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--latex", action="store_true", help="also print the peak formula (LaTeX)")
    return p


# ----------------------------------------------------------------------------- input


def build_job(args: argparse.Namespace) -> Training | Inference:
    """``calc.Training`` or ``calc.Inference`` from the arguments; options of the other task are
    rejected rather than silently ignored."""
    own, other = (
        (TRAINING_FIELDS, INFERENCE_FIELDS)
        if args.task == "train"
        else (INFERENCE_FIELDS, TRAINING_FIELDS)
    )
    stray = [f for f in other if f not in own and getattr(args, f) is not None]
    if stray:
        names = ", ".join("--" + f.replace("_", "-") for f in stray)
        raise ValueError(f"task={args.task!r} does not take {names}")
    kwargs = {f: getattr(args, f) for f in own if getattr(args, f) is not None}
    if kwargs.get("optimizer") == "none":  # forward and backward alone
        kwargs["optimizer"] = None
    if args.task == "train":
        if getattr(args, "sample", False):
            raise ValueError("task='train' does not take --sample (generate's sampling)")
        return cli_compression.apply(args, Training(**{**DEFAULT_TRAINING, **kwargs}))
    # generate: the context follows from --prompt and --new-tokens (calc.Inference)
    defaults = {"batch": 1} if kwargs.get("new_tokens") else DEFAULT_INFERENCE
    sampling = _sampling(args)
    if sampling is not None:
        kwargs["sampling"] = sampling
    return cli_compression.apply(args, Inference(**{**defaults, **kwargs}))


SAMPLING_FIELDS: tuple[str, ...] = ("temperature", "top_k", "top_p", "repetition_penalty")


def _sampling(args: argparse.Namespace) -> Sampling | None:
    """``calc.Sampling`` from ``--sample`` and its processors (``ValueError`` for a processor
    given without ``--sample``)."""
    given = {f: getattr(args, f) for f in SAMPLING_FIELDS if getattr(args, f, None) is not None}
    if not getattr(args, "sample", False):
        if given:
            names = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ValueError(f"{names} need --sample (generate is greedy without it)")
        return None
    return Sampling(**given)


PARALLEL_FIELDS: tuple[str, ...] = (
    "dp", "tp", "pp", "cp", "zero", "pp_microbatches", "pp_virtual_stages", "ddp_bucket_mib",
    "pp_schedule", "offload", "sp", "fsdp", "gradient_as_bucket_view", "vocab_parallel",
    "fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_version", "fsdp_use_orig_params",
    "fsdp_output_dtype", "expert_parallel", "dp_replicate",
)  # fmt: skip


def build_parallel(args: argparse.Namespace) -> Parallelism | None:
    """``calc.Parallelism`` from the parallelism options (None when none is given); its
    constructor validates every field."""
    kwargs = {f: getattr(args, f) for f in PARALLEL_FIELDS if getattr(args, f) is not None}
    if args.no_reshard_after_forward:
        kwargs["reshard_after_forward"] = False
    if args.no_fsdp_cast_forward_inputs:
        kwargs["fsdp_cast_forward_inputs"] = False
    if not kwargs:
        return None
    if args.task != "train":
        names = ", ".join("--" + f.replace("_", "-") for f in kwargs)
        raise ValueError(f"task={args.task!r} does not take {names} (parallel inference)")
    return Parallelism(**kwargs)


def check_output_args(args: argparse.Namespace) -> None:
    """Validate the display options (the job classes validate the job's)."""
    if args.gpu_gib is not None and not (math.isfinite(args.gpu_gib) and args.gpu_gib > 0):
        raise ValueError(f"gpu_gib={args.gpu_gib} must be a positive, finite number of GiB")
    if args.depth is not None and args.depth < 1:
        raise ValueError(f"depth={args.depth} must be an integer >= 1")


# ----------------------------------------------------------------------------- display


def breakdown_rows(breakdown: Mapping[str, int]) -> list[tuple[int, str, int]]:
    """``(depth, key, bytes)`` rows of a slash-keyed tree in display order: each parent before
    its children, siblings in first-seen order, ``total`` last. A parent missing from the
    mapping is shown as the sum of its children."""
    children: dict[str, list[str]] = {"": []}
    for key in breakdown:
        if key == "total":
            continue
        parts = key.split("/")
        for i in range(1, len(parts) + 1):
            node, parent = "/".join(parts[:i]), "/".join(parts[: i - 1])
            if node not in children:
                children[node] = []
                children[parent].append(node)

    def value(node: str) -> int:
        if node in breakdown:
            return int(breakdown[node])
        return sum(value(c) for c in children[node])

    rows: list[tuple[int, str, int]] = []

    def walk(node: str, depth: int) -> None:
        for child in children[node]:
            rows.append((depth, child, value(child)))
            walk(child, depth + 1)

    walk("", 0)
    total = int(breakdown["total"]) if "total" in breakdown else sum(value(c) for c in children[""])
    rows.append((0, "total", total))
    return rows


def format_gib(nbytes: int) -> str:
    """Bytes as GiB (2**30), two decimals, labelled."""
    return f"{nbytes / GIB:.2f} GiB"


def capacity(args: argparse.Namespace, parallel: Parallelism | None = None) -> tuple[int, str]:
    """The bytes the verdict compares with and their name: ``--gpu-gib`` when given, else the
    usable memory of the ``--gpu`` catalog entry on one rank of ``parallel``
    (`calc.data.gpus.GPU.usable_for`: the total less the memory outside PyTorch, what the web
    app and the planner compare with, so the three agree)."""
    if args.gpu_gib is not None:
        return int(args.gpu_gib * GIB), f"{args.gpu_gib:g} GiB"
    gpu = get_gpu(args.gpu)
    usable = gpu.usable_for(parallel)
    return usable, f"{gpu.id} ({format_gib(usable)} usable)"


def verdict(peak_bytes: int, capacity_bytes: int, size: str) -> tuple[bool, int, str]:
    """Whether ``peak_bytes`` fits in ``capacity_bytes`` (named ``size``), the headroom in bytes
    (negative when it does not fit), and the sentence saying so."""
    headroom = capacity_bytes - peak_bytes
    if headroom >= 0:
        share = 100 * headroom / capacity_bytes
        return True, headroom, f"fits in {size} with {format_gib(headroom)} ({share:.1f}%) headroom"
    return False, headroom, f"does not fit in {size}: needs {format_gib(-headroom)} more"


def fit_lines(rows: Sequence[DeviceFit], gpu: GPU) -> list[str]:
    """The ``--reserved`` lines: per allocator setting, allocated, reserved and what nvidia-smi
    would show against the GPU's total (`calc.estimate.device_fit`), then the terms outside
    PyTorch with their ranges and sources (`calc.data.outside`)."""
    lines = []
    for f in rows:
        verdict_word = "fits" if f.fits else "does not fit"
        lines.append(
            f"{f.setting + ':':<21}allocated {format_gib(f.allocated_bytes)}, reserved "
            f"{format_gib(f.reserved_bytes)} ({f.segments} segments) + outside PyTorch "
            f"{format_gib(f.outside_bytes)} = {format_gib(f.shown_bytes)} of {gpu.id}'s "
            f"{format_gib(f.total_bytes)}: {verdict_word}"
        )
    if rows:
        lines.append(
            "(allocated/reserved: modelled from PyTorch's source, checked against H200 runs; "
            "outside PyTorch: the upper end of each term's range below)"
        )
        lines.extend(outside_lines(gpu))
    return lines


def device_lines(
    args: argparse.Namespace, peak_bytes: int, parallel: Parallelism | None,
    fit_rows: Sequence[DeviceFit],
) -> list[str]:  # fmt: skip
    """The ``device:`` line (a catalog GPU, not ``--gpu-gib``) and the ``--reserved`` lines."""
    gpu = get_gpu(args.gpu)
    head = (
        []
        if args.gpu_gib is not None
        else [f"device:     {device_line(peak_bytes, gpu, parallel)}"]
    )
    return head + fit_lines(fit_rows, gpu)


def device_line(peak_bytes: int, gpu: GPU, parallel: Parallelism | None) -> str:
    """The verdict's terms side by side: the allocated peak, the memory outside PyTorch (upper
    end, with its range) and their sum against the GPU's total (what ``nvidia-smi`` shows,
    less the allocator's reserve above the peak: ``--reserved`` replays it)."""
    out = gpu.outside(parallel)
    shown = peak_bytes + gpu.total_bytes - gpu.usable_for(parallel)
    return (
        f"allocated peak {format_gib(peak_bytes)} + outside PyTorch "
        f"{format_gib(shown - peak_bytes)} (range {format_gib(out.low_bytes)} to "
        f"{format_gib(out.high_bytes)}) = {format_gib(shown)} of {gpu.id}'s "
        f"{format_gib(gpu.total_bytes)} total (reserved above the peak: --reserved)"
    )


def outside_json(gpu: GPU, parallel: Parallelism | None) -> list[dict[str, object]]:
    """The terms outside PyTorch's allocator on ``gpu`` (one rank of ``parallel``)."""
    return [dataclasses.asdict(t) for t in gpu.outside(parallel).terms]


def outside_lines(gpu: GPU, parallel: Parallelism | None = None) -> list[str]:
    """One line per term outside PyTorch's allocator: its range, basis and source."""
    return [
        f"  outside/{t.key}: {format_gib(t.low_bytes)} to {format_gib(t.high_bytes)} "
        f"({t.basis}: {t.source})"
        for t in gpu.outside(parallel).terms
    ]


def render_table(est: Estimate, depth: int | None) -> list[str]:
    """The breakdown at the peak: one row per node, indented by depth, GiB and % of peak."""
    peak = int(est.peak_bytes)
    tree = {k: v for k, v in est.breakdown.items() if not k.startswith("ranks/")}
    rows = [
        (d, key, n)
        for d, key, n in breakdown_rows(tree)
        if depth is None or d < depth or key == "total"
    ]
    labels = [
        ("  " * d) + (key if key == "total" else key.rsplit("/", 1)[-1]) for d, key, _ in rows
    ]
    width = max(len("component"), *(len(s) for s in labels))
    lines = [f"{'component':<{width}}  {'GiB':>12}  {'% of peak':>9}"]
    lines.append("-" * len(lines[0]))
    for (_, key, n), label in zip(rows, labels, strict=True):
        if key == "total":
            lines.append("-" * len(lines[0]))
        share = 100 * n / peak if peak else 0.0
        lines.append(f"{label:<{width}}  {format_gib(n):>12}  {share:>8.1f}%")
    return lines


def run(args: argparse.Namespace) -> int:
    """Estimate and print; raises ``ValueError`` on bad input."""
    check_output_args(args)
    model, label = load_model(args)
    job = build_job(args)
    model, job = cli_prune_distill.apply(args, model, job)
    stored = cli_prune_distill.storage(args, model, job)
    parallel = build_parallel(args)
    catalog_gpu = None if args.gpu_gib is not None else args.gpu  # its cuBLAS workspace size
    with progress_bar.shown_on(sys.stderr):  # a first estimate may record for minutes
        est = estimate(model, job, parallel, device=args.device, gpu=catalog_gpu)
    peak = int(est.peak_bytes)
    capacity_bytes, size = capacity(args, parallel)
    fits, headroom, sentence = verdict(peak, capacity_bytes, size)
    fit_rows = device_fits(est, get_gpu(args.gpu)) if args.reserved else []

    if args.json:
        out = {
            "model": label,
            "n_params": param_count(model),
            "task": args.task,
            "job": dataclasses.asdict(job),
            "device": args.device,
            "peak_bytes": peak,
            "peak_gib": peak / GIB,
            "peak_phase": est.peak_phase,
            "peak_event": est.peak_event,
            "phases": {k: int(v) for k, v in est.phases.items()},
            "breakdown": {k: int(v) for k, v in est.breakdown.items()},
            "gpu": None if args.gpu_gib is not None else args.gpu,
            "gpu_gib": capacity_bytes / GIB,
            "fits": fits,
            "headroom_bytes": headroom,
            "outside_pytorch": outside_json(get_gpu(args.gpu), parallel),
        }
        if fit_rows:
            out["device_fit"] = [
                {**dataclasses.asdict(f), "shown_bytes": f.shown_bytes, "fits": f.fits}
                for f in fit_rows
            ]
        if parallel is not None:
            out["parallel"] = dataclasses.asdict(parallel)
            out["most_loaded_rank"] = est.rank
            out["rank_peaks"] = {str(r): int(v) for r, v in est.rank_peaks.items()}
        if args.latex:
            out["latex"] = est.latex()
        if stored is not None:
            out["pruned_storage"] = cli_prune_distill.storage_json(stored)
        print(json.dumps(out, indent=2, default=str))
        return 0

    job_desc = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(job).items())
    print(f"model: {label} ({param_count(model):,} parameters)")
    print(f"job:   {type(job).__name__}({job_desc}), device={args.device}")
    if parallel is not None:
        changed = {
            k: v for k, v in dataclasses.asdict(parallel).items()
            if v != getattr(Parallelism(), k)
        }  # fmt: skip
        print(f"parallel: {', '.join(f'{k}={v}' for k, v in changed.items())} "
              f"({parallel.world_size} GPUs)")  # fmt: skip
    print()
    print("\n".join(render_table(est, args.depth)))
    print()
    print(f"peak phase: {est.peak_phase} (at {est.peak_event})")
    print(f"peak:       {format_gib(peak)} ({peak:,} bytes)")
    if parallel is not None and parallel.is_single:
        print("rank:       one GPU: the layout options above have no effect")
    elif parallel is not None:
        peaks = sorted(set(est.rank_peaks.values()))
        spread = f"; ranks range {format_gib(peaks[0])} to {format_gib(peaks[-1])}"
        print(f"rank:       the most-loaded GPU is rank {est.rank} of {parallel.world_size}"
              f"{spread if len(peaks) > 1 else ' (every rank the same)'}")  # fmt: skip
    print(f"verdict:    {sentence}")
    print("\n".join(f"note:       {note}" for note in est.notes), end="\n" if est.notes else "")
    for line in device_lines(args, peak, parallel, fit_rows):
        print(line)
    if stored is not None:
        print()
        print("\n".join(cli_prune_distill.storage_lines(stored, GIB)))
    if args.latex:
        print()
        print(f"peak = {est.latex()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m calc``: 0 on success, 2 on bad input or a job the cost model
    does not cover (one line on stderr, no traceback). ``python -m calc plan ...`` runs the
    capacity planner (``calc.cli.plan``); ``report`` runs `calc.cli.report` (least memory per
    task and weight width); ``serve`` runs `calc.cli.serve` (a vLLM server's start-up terms)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        return cli_plan.main(argv[1:])
    if argv[:1] == ["report"]:
        return cli_report.main(argv[1:])
    if argv[:1] == ["serve"]:
        return cli_serve.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.list_cards:
        print("\n".join(list_cards()))
        return 0
    return run_reporting_errors(run, args)
