"""``python -m calc serve``: what a vLLM server holds per GPU once it has started.

The flags are vLLM's own (``--gpu-memory-utilization``, ``--max-model-len``, ``-tp``, ...),
wired to `calc.Serving` and `calc.serve`; the output prints the terms in the order and words of
vLLM's start-up log ("Model loading took ...", "Available KV cache memory", "GPU KV cache size",
"Maximum concurrency"), in GiB (2**30 bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from calc.cli import model_source, progress_bar
from calc.cli.exits import run_reporting_errors
from calc.config.serving import DEFAULT_VLLM_VERSION, Serving
from calc.present.serving import startup_failure
from calc.serving.api import ServeEstimate, serve
from calc.serving.inverse import largest_max_model_len
from calc.units import GIB

DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16",
          "float32": "fp32", "float": "fp32", "fp32": "fp32"}  # fmt: skip
"""vLLM's ``--dtype`` spellings -> `calc.Serving.dtype`."""
QUANTIZATIONS = {"fp8": "fp8", "w8a8": "w8a8", "int8": "w8a8", "w4a16": "w4a16", "awq": "w4a16",
                 "gptq": "w4a16", "awq_marlin": "w4a16", "gptq_marlin": "w4a16"}  # fmt: skip
"""``--quantization`` methods -> the checkpoint format `calc.Serving.quant` models."""


def build_parser() -> argparse.ArgumentParser:
    p = model_source.parser(
        "python -m calc serve",
        "Predict what vLLM logs at start-up per GPU: weights, non-torch memory, the profiling "
        "run's activation peak, CUDA graphs, the KV cache in GiB and tokens, the concurrency.",
    )
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", metavar="ID", help="catalog GPU (its cudaMemGetInfo total)")
    gpu.add_argument("--total-gib", type=float, help="the total vLLM logs (GiB), instead")
    p.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION, help="vLLM release")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", help=", ".join(DTYPES))
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3, fp8_e5m2")
    p.add_argument(
        "--quantization",
        "-q",
        help=f"{', '.join(QUANTIZATIONS)}; unset: the checkpoint's quantization_config, as vLLM",
    )
    p.add_argument(
        "--block-size",
        type=int,
        help="tokens per KV block; unset: vLLM's default (16, or what vLLM forces for MLA)",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--enable-expert-parallel", action="store_true", help="MoE experts over the TP ranks"
    )
    p.add_argument("--entrypoint", default="serve", help="serve (vllm serve) or llm (vllm.LLM)")
    p.add_argument("--sampler", default="auto", help="auto, pytorch, flashinfer")
    p.add_argument("--json", action="store_true", help="print JSON instead of the log lines")
    return p


def _choice(field: str, value: str, table: dict[str, str]) -> str:
    if value not in table:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(table)}")
    return table[value]


def serving_from(args: argparse.Namespace) -> Serving:
    """The `calc.Serving` the flags describe (it validates every field)."""
    quant = args.quantization
    return Serving(
        vllm_version=args.vllm_version,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel=args.tensor_parallel_size,
        pipeline_parallel=args.pipeline_parallel_size,
        dtype=_choice("dtype", args.dtype, DTYPES),  # type: ignore[arg-type]
        kv_cache_dtype=args.kv_cache_dtype,
        quant=None if quant is None else _choice("quantization", quant, QUANTIZATIONS),  # type: ignore[arg-type]
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        expert_parallel=args.enable_expert_parallel,
        entrypoint=args.entrypoint,
        sampler=args.sampler,
    )


def log_lines(est: ServeEstimate) -> list[str]:
    """The estimate as vLLM's start-up log words it (GiB = 2**30 bytes)."""

    def g(value: int) -> str:
        return f"{value / GIB:.2f} GiB"

    return [
        f"engine: {est.engine}; max_num_batched_tokens={est.max_num_batched_tokens}, "
        f"max_num_seqs={est.max_num_seqs}, max_model_len={est.max_model_len}",
        f"total GPU memory {g(est.total_bytes)} x utilization = {g(est.budget_bytes)}",
        f"Model loading took {g(est.weights_bytes)}",
        f"non-torch memory {g(est.non_torch_bytes)} (estimated)",
        f"PyTorch activation peak memory {g(est.activation_peak_bytes)}",
        f"CUDA graphs {g(est.cuda_graph_bytes)} (estimated)",
        f"Available KV cache memory: {g(est.kv_cache_bytes)}",
        f"GPU KV cache size: {est.kv_cache_tokens:,} tokens ({est.gpu_blocks:,} blocks of "
        f"{est.block_size})",
        f"Maximum concurrency for {est.max_model_len:,} tokens per request: "
        f"{est.max_concurrency:.2f}x",
    ]


def run(args: argparse.Namespace) -> int:
    model, label = model_source.load_config(args)
    serving = serving_from(args)
    total = None if args.total_gib is None else round(args.total_gib * GIB)
    gpu = args.gpu if total is None else None
    if total is None and gpu is None:
        raise ValueError("give --gpu ID (the catalog) or --total-gib X (the total vLLM logs)")
    with progress_bar.shown_on(sys.stderr):  # a first profiling forward may record
        est = serve(model, serving, total_bytes=total, gpu=gpu)
    if args.json:
        out = {"model": label, "serving": asdict(serving), **asdict(est),
               "startup_failure": startup_failure(est)}  # fmt: skip
        print(json.dumps(out, indent=2))
        return 0
    print(f"model: {label}; vLLM {serving.vllm_version}")
    print("\n".join(log_lines(est)))
    failure = startup_failure(est)
    print(f"vLLM does not start: {failure}" if failure else "vLLM starts")
    if failure and est.kv_cache_bytes > 0:
        longest = largest_max_model_len(model, serving, 1.0, total_bytes=total, gpu=gpu)
        print(f"the largest max_model_len that starts here: {longest:,} tokens")
    for note in est.notes:
        print(f"note: {note}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m calc serve ...``: 0 on success, 2 on bad input (one line on stderr)."""
    args = build_parser().parse_args(argv)
    return run_reporting_errors(run, args)
