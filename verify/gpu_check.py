"""The first GPU run, prepared: which cases, how the two allocator runs merge into one recorded
measurement file, and how calc is checked against every recorded file.

``bash scripts/gpu_check.sh`` runs ``python -m verify --device cuda --cases <CASES>`` once per
allocator setting (``--cuda-alloc default`` and ``expandable``), then ``python -m
verify.gpu_check merge`` writes ``verify/measurements/<gpu>-<date>.json``:

    {"schema": "vramplan-gpu-check/1", "synthetic": false,
     "gpu": "...", "driver": "...", "memory_total_mib": N, "capability": [9, 0],
     "torch": "...", "cuda": "...", "date": "YYYY-MM-DD",
     "cases": [<verify's case record> + {"alloc": "default"|"expandable",
                "allocated_peak": B, "reserved_peak": B, "mem_get_info": [free, total]}, ...]}

Each case record is verify's own (``spec``, ``job``, ``measured_peak`` =
``max_memory_allocated``, ``tolerance_pct``, ``status``); the stat peaks come from its
``extra``. `check_file` compares calc with a recorded file: with expandable segments the
allocated peak is calc's ``peak_bytes`` (every block is split to its rounded size); with the
default allocator it is the allocator model's allocated peak (unsplit blocks included), and the
reserved peak the model's reserved bytes, within ``RESERVED_TOLERANCE_PCT``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import calc
from calc.config.compression import LoRA, Quant
from calc.config.jobs import Sampling
from calc.replay.caching_allocator import AllocatorConfig

SCHEMA = "vramplan-gpu-check/1"
CASES = (
    # SDPA kernels (with and without dropout) and eager attention
    "attn-sdpa-llama3", "attn-math-llama3", "attn-eager-llama3", "attn-math-bf16-mistral",
    "dropout-on-llama-sdpa", "dropout-off-gpt2", "dropout-card-gpt2-math",
    "dropout-on-gpt2-eager", "act-long-seq-llama3",
    # every precision recipe
    "prec-fp32-llama", "prec-amp-bf16-llama", "prec-amp-fp16-llama", "prec-bf16-llama",
    "prec-bf16-master-llama",
    # optimizers: 8-bit Adam, fused and foreach AdamW
    "opt-adam8bit", "opt-adamw-fused", "opt-adamw-foreach",
    # NF4 (QLoRA training, inference)
    "qlora-nf4-bf16-llama", "quant-nf4-infer-qwen3",
    # KV cache and inference
    "kv-int8-infer-llama", "kv-fp8-infer-mistral", "infer-llama-bf16", "infer-hf-mistral-bf16",
    # Hugging Face models (GPT-2 under autocast: its CUDA fp32 ops)
    "hf-gpt2-fp32", "hf-llama3-amp-bf16", "hf-qwen2-amp-long",
)  # fmt: skip
"""The most informative single-process cases (names of `verify.cases.single`). Not here:
``attn-flash-llama3`` and ``attn-efficient-llama3`` force kernels CUDA cannot run on them
(flash takes no fp32, memory-efficient no grouped key/value heads; `calc.models.attention`)."""
FULL_CASES = (
    "full-gpt2-sdpa-dropout-fp32-4x512", "full-gpt2-sdpa-dropout-fp32-4x1024",
    "full-gpt2-eager-dropout-fp32-4x1024", "full-gpt2-adamw-fp32-dropout",
    "full-qwen2.5-0.5b-adamw-bf16-2x1024", "full-qwen2.5-0.5b-amp-bf16-2x512",
    "full-qwen2.5-0.5b-adamw-bf16", "full-qwen2.5-0.5b-generate-bf16",
)  # fmt: skip
"""Full-size cases (`verify.cases.full_size`): real vocabularies, attention at 1024 tokens; run
after `CASES` in their own process per allocator setting, so a slow one cannot lose the rest."""
DERIVED_GROUPS = (
    ("derived-",), ("dtrain-",), ("gen-", "act-long-seq-llama3"),
    ("full-gemma-3-1b-sgd-bf16", "full-qwen2.5-0.5b-generate-bf16", "full-gpt2-generate-fp32"),
)  # fmt: skip
"""The second selection (``cases --set derived``), as ``--cases`` name fragments, one process
per group and allocator setting: every architecture calc derives from transformers' code
(`verify.cases.derived`, ``derived_train``: training and prefill of gemma2/3, phi3, olmo2,
granite, starcoder2, cohere, mixtral, qwen2/3_moe, deepseek_v2/v3), Hugging Face ``generate``
(``gen-`` also selects the derived ``dgen-`` cases), the first run's unexplained miss again,
and full-size Gemma-3-1B (derived, a 262,144-token vocabulary) and generate (the first run's
reserved peak of Qwen2.5-0.5B's generate counted its fp32 build, which the harness now leaves
out)."""
SETS: dict[str, tuple[tuple[str, ...], ...]] = {
    "first": (CASES, FULL_CASES),
    "derived": DERIVED_GROUPS,
}
"""Selections by name, each a sequence of groups; the last is the full-size one."""
CATEGORIES = {
    "sdpa": ("attn-sdpa",),
    "dropout": ("dropout-on",),
    "eager": ("eager",),
    "precision": ("prec-",),
    "adam8bit": ("adam8bit",),
    "nf4": ("nf4",),
    "kv_cache": ("kv-",),
    "inference": ("infer-",),
}
"""What the selection must cover (issue 14), as name fragments."""
ALLOC = {"default": AllocatorConfig(), "expandable": AllocatorConfig(expandable_segments=True)}
RESERVED_TOLERANCE_PCT = 5.0
"""The first bar for reserved memory (no measurement yet: to be tightened by the first one)."""
REQUIRED = ("gpu", "driver", "torch", "date", "cases")


def merge(
    default_report: dict,
    expandable_report: dict,
    smi_line: str,
    synthetic: bool = False,
    probe: dict | None = None,
) -> dict[str, Any]:
    """One measurement file from the two runs' report.json and ``nvidia-smi --query-gpu=name,
    driver_version,memory.total --format=csv,noheader`` (``"NVIDIA H200, 570.86.15, 143771
    MiB"``), with `verify.gpu_probe`'s reading of the memory outside PyTorch under ``outside``
    when given."""
    parts = [p.strip() for p in smi_line.split(",")]
    if len(parts) != 3:
        raise ValueError(f"nvidia-smi line {smi_line!r}: expected 'name, driver, total MiB'")
    name, driver, total = parts
    cases = []
    env: dict[str, Any] = {}
    for alloc, report in (("default", default_report), ("expandable", expandable_report)):
        for rec in report.get("cases", []):
            extra = rec.get("extra") or {}
            env = env or {k: extra.get(k) for k in ("torch", "cuda", "capability")}
            peaks = extra.get("stat_peaks") or {}
            cases.append({
                **rec, "alloc": alloc,
                "allocated_peak": peaks.get("allocated_bytes"),
                "reserved_peak": peaks.get("reserved_bytes"),
                "mem_get_info": extra.get("mem_get_info"),
                "reserved_now": extra.get("reserved_now"),
            })  # fmt: skip
    return {
        "schema": SCHEMA,
        "synthetic": synthetic,
        "gpu": name,
        "driver": driver,
        "memory_total_mib": int(total.split()[0]),
        "capability": env.get("capability"),
        "torch": env.get("torch") or default_report.get("meta", {}).get("torch"),
        "cuda": env.get("cuda"),
        "transformers": default_report.get("meta", {}).get("transformers"),
        "date": default_report.get("meta", {}).get("date"),
        "cases": cases,
        "outside": probe,
    }


def file_name(data: dict, suffix: str = "") -> str:
    """``<gpu>-<date>[-<suffix>].json``, the GPU name in lower case with runs of other
    characters as ``-``."""
    gpu = re.sub(r"[^a-z0-9]+", "-", str(data["gpu"]).lower()).strip("-")
    tail = f"-{suffix}" if suffix else ""
    return f"{gpu}-{data['date']}{tail}.json"


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples the frozen configs hold."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


NESTED = {"lora": LoRA, "quant": Quant, "sampling": Sampling}
"""Job fields recorded as dicts, and their config classes (the GPU selection uses no pruning,
distillation or KV quantization object: ``kv_quant`` is a plain string)."""


def job_from_record(rec: dict) -> calc.Training | calc.Inference:
    """The ``calc`` job a recorded case ran (nested configs rebuilt)."""
    fields = {k: _tuples(v) for k, v in rec["job"].items()}
    for key, cls in NESTED.items():
        if isinstance(fields.get(key), dict):
            fields[key] = cls(**{k: _tuples(v) for k, v in fields[key].items()})
    for key in ("pruning", "distill"):
        if fields.get(key) is not None:
            raise NotImplementedError(f"{rec['name']}: a recorded {key} job is not rebuilt")
    job_cls = calc.Training if rec["kind"] == "training" else calc.Inference
    return job_cls(**fields)


def _estimate(rec: dict) -> calc.Estimate:
    model = calc.ModelSpec(**{k: _tuples(v) for k, v in rec["spec"].items()})
    return calc.estimate(model, job_from_record(rec), device="cuda")


def _pct(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured * 100


def check_record(rec: dict) -> list[str]:
    """What is off in one recorded case (empty when calc agrees within the tolerances). A case
    measured without a prediction (status ``measured``) is predicted here."""
    if rec.get("device") != "cuda" or rec.get("status") not in ("ok", "fail", "measured"):
        return []
    name = f"{rec['name']} ({rec.get('alloc', '?')})"
    est = _estimate(rec)
    problems = []
    config = ALLOC.get(rec.get("alloc", "expandable"), ALLOC["expandable"])
    expandable = config.expandable_segments
    stats = None if expandable else est.reserved(config)
    predicted = est.peak_bytes if stats is None else stats.allocated_bytes
    err = _pct(predicted, rec["measured_peak"])
    if abs(err) > rec["tolerance_pct"]:
        problems.append(f"{name}: allocated {err:+.2f}% (tolerance {rec['tolerance_pct']}%)")
    if rec.get("reserved_peak"):
        reserved = (stats or est.reserved(config)).reserved_bytes
        err = _pct(reserved, rec["reserved_peak"])
        if abs(err) > RESERVED_TOLERANCE_PCT:
            problems.append(f"{name}: reserved {err:+.2f}% (tolerance {RESERVED_TOLERANCE_PCT}%)")
    return problems


def check_file(path: Path) -> list[str]:
    """Every problem of one recorded file: a schema field missing, or a case off."""
    data = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        return [f"{path.name}: missing {', '.join(missing)}"]
    return [p for rec in data["cases"] for p in check_record(rec)]


def _combined(paths: Sequence[Path]) -> dict[str, Any]:
    """The reports at ``paths`` as one: the first one's ``meta``, every case in order. A report
    that is missing (its run was stopped before writing it) is skipped and named on stderr."""
    meta: dict[str, Any] = {}
    cases: list[dict] = []
    for path in paths:
        if not path.is_file():
            print(f"verify.gpu_check: {path} is missing (its run did not finish)", file=sys.stderr)
            continue
        report = json.loads(path.read_text(encoding="utf-8"))
        meta = meta or report.get("meta", {})
        cases.extend(report.get("cases", []))
    return {"meta": meta, "cases": cases}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m verify.gpu_check cases`` prints the selection (comma-separated; ``cases
    --full``: `FULL_CASES`; ``--set derived --groups``: `DERIVED_GROUPS`, one per line);
    ``merge SMI_LINE DEST_DIR --default R.. --expandable R.. [--probe P] [--suffix S]`` writes
    the measurement file and prints its path."""
    p = argparse.ArgumentParser(prog="python -m verify.gpu_check")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cases")
    c.add_argument("--full", action="store_true", help="the full-size group (the last)")
    c.add_argument("--set", choices=tuple(SETS), default="first", help="which selection")
    c.add_argument(
        "--groups", action="store_true", help="every group of the selection, one per line"
    )
    m = sub.add_parser("merge")
    m.add_argument("smi_line")
    m.add_argument("dest", type=Path)
    m.add_argument("--default", type=Path, nargs="+", required=True, help="report.json files")
    m.add_argument("--expandable", type=Path, nargs="+", required=True, help="report.json files")
    m.add_argument(
        "--probe", type=Path, help="verify.gpu_probe's JSON (the memory outside PyTorch)"
    )
    m.add_argument("--suffix", default="", help="file name suffix: <gpu>-<date>-<suffix>.json")
    args = p.parse_args(argv)
    if args.cmd == "cases":
        groups = SETS[args.set]
        if args.groups:
            print("\n".join(",".join(g) for g in groups))
        else:
            print(",".join(groups[-1] if args.full else groups[0]))
        return 0
    default, expandable = _combined(args.default), _combined(args.expandable)
    if not default["cases"] and not expandable["cases"]:
        print("verify.gpu_check: no case was recorded", file=sys.stderr)
        return 1
    if not default["meta"]:
        default["meta"] = expandable["meta"]
    probe = None
    if args.probe is not None and args.probe.is_file():
        probe = json.loads(args.probe.read_text(encoding="utf-8"))
    data = merge(default, expandable, args.smi_line, probe=probe)
    args.dest.mkdir(parents=True, exist_ok=True)
    path = args.dest / file_name(data, args.suffix)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
