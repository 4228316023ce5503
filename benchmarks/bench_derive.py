"""Time the derived path (`calc.derive`): the first estimate of an architecture, then cached.

    python benchmarks/bench_derive.py [--json] [--card qwen3-32b --card ...]

Each case runs in a fresh Python process with an empty ``VRAMPLAN_CACHE_DIR`` (a temporary
folder) and one BLAS thread, and reports: ``first_s``, the first ``calc.estimate`` of the
structure (build the model on fake tensors, record the step at every sample point, fit the
sizes, play the stream, compile), with ``first_cpu_s`` its CPU time (the process's: steady
when other jobs load the machine); ``disk_s`` (``disk_cpu_s``), the same estimate in a second
fresh process that finds the fitted stream on disk (play and compile only); ``again_us``, a
further estimate with other sizes in the same regime (the compiled path). The card's model runs as
``implementation="derived"`` (its transformers code), so the same sizes can be compared with
the hand-written graph where the card has one (on ``device="cpu"``: the derived replay records
CPU kernels). Default cards: Qwen3-32B (a hand graph to compare with), Qwen3-30B-A3B (MoE)
and the Gemma cards present (layers that differ: `CARDS`).
"""

from __future__ import annotations

import argparse
import json

from _child import first_and_disk

import calc

CASES: dict[str, dict] = {
    "training b=2 s=2048 amp-bf16": {"kind": "training", "micro_batch": 2, "seq_len": 2048},
    "prefill b=4 prompt=2048 ctx=4096": {"kind": "inference", "batch": 4, "prompt": 2048,
                                          "context": 4096},
}  # fmt: skip
"""Case name -> job fields (``kind`` picks calc.Training or calc.Inference)."""

_CHILD = """
import json, sys, time
from dataclasses import replace
import calc
card, fields = json.loads(sys.argv[1])
kind = fields.pop("kind")
model = calc.load_card(card)
if kind == "training":
    job = calc.Training(precision="amp-bf16", implementation="derived", **fields)
    other = replace(job, micro_batch=job.micro_batch + 1, seq_len=job.seq_len * 2)
else:
    job = calc.Inference(precision="bf16", implementation="derived", **fields)
    other = replace(job, batch=job.batch + 1)
t, cpu = time.perf_counter(), time.process_time()
peak = calc.estimate(model, job, device="cpu").peak_bytes
first, first_cpu = time.perf_counter() - t, time.process_time() - cpu
t = time.perf_counter()
for _ in range(100):
    calc.estimate(model, other, device="cpu")
again = (time.perf_counter() - t) / 100
hand = None if model.derived else calc.estimate(
    model, replace(job, implementation="hf"), device="cpu").peak_bytes
print(json.dumps({"first_s": first, "first_cpu_s": first_cpu, "again_us": again * 1e6, "peak": peak, "hand": hand}))
"""


CARDS = ("qwen3-32b", "qwen3-30b-a3b", "gemma-3-27b", "gemma-2-9b", "deepseek-v3")
"""The cards timed by default (those `calc.load_card` knows)."""
EAGER_TYPES = ("gemma2", "deepseek_v2", "deepseek_v3")
"""Model types estimated with eager attention: transformers builds Gemma-2 (soft-capping) with
eager only, and CPU SDPA has no kernel for DeepSeek's narrower value heads."""


def run_case(card: str, fields: dict) -> dict:
    """First estimate in a fresh process with an empty cache, then again with the disk cache."""
    first, disk = first_and_disk(_CHILD, [card, dict(fields)])
    return {**first, "disk_s": disk["first_s"], "disk_cpu_s": disk["first_cpu_s"]}


def _line(card: str, name: str, r: dict) -> str:
    if r["hand"] is None:
        same = "none"
    else:
        same = "equal" if r["peak"] == r["hand"] else f"differs by {r['peak'] - r['hand']:,} B"
    return (
        f"{card:14s} {name:34s} first {r['first_s']:6.1f} s (cpu {r['first_cpu_s']:5.1f} s)   "
        f"disk cache {r['disk_s']:5.2f} s (cpu {r['disk_cpu_s']:4.2f} s)   "
        f"compiled {r['again_us']:6.0f} us   hand graph {same}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--card", action="append", help="model card (repeat; default CARDS)")
    args = parser.parse_args(argv)
    cards = args.card or [c for c in CARDS if c in calc.list_cards()]
    results = {}
    for card in cards:
        eager = {"attention": "eager"} if calc.load_card(card).model_type in EAGER_TYPES else {}
        results[card] = {name: run_case(card, {**f, **eager}) for name, f in CASES.items()}
    lines = [_line(card, name, r) for card, rs in results.items() for name, r in rs.items()]
    print(json.dumps(results, indent=2) if args.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
