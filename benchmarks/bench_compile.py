"""Time the one-time cost of a new structure: the symbolic replay and its compilation.

    python benchmarks/bench_compile.py [--json]

Every structure ``calc.estimate`` has not seen in this process is replayed (``calc.step.training``),
reduced to its candidate peaks (``calc.replay.timeline``) and compiled (``calc.estimate.core._compile``).
The web calculator pays this on the first rerun with a new structure, the planner once per
structure it has not cached. Each case runs in a fresh Python process (nothing cached in
memory; ``calc.estimate`` does not read the planner's persistent cache), one CPU core for
BLAS, and reports the seconds of its first ``calc.estimate`` call and of a second call with a
different micro-batch (the compiled path). Cases: Qwen2.5-32B on one GPU (default recipe,
full recomputation, LoRA), Qwen2.5-7B on 2 GPUs (DDP, FSDP2, TP 2).

Run it with ``PYTHONPATH=<checkout>`` to time another checkout of the code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES: dict[str, tuple[str, dict, dict | None]] = {
    "qwen2.5-32b 1 GPU": ("qwen2.5-32b", {}, None),
    "qwen2.5-32b 1 GPU recompute=full": ("qwen2.5-32b", {"recompute": "full"}, None),
    "qwen2.5-32b 1 GPU lora r16": ("qwen2.5-32b", {"lora_rank": 16}, None),
    "qwen2.5-7b dp2 DDP": ("qwen2.5-7b", {"implementation": "reference"}, {"dp": 2}),
    "qwen2.5-7b dp2 FSDP2": ("qwen2.5-7b", {"implementation": "reference"}, {"dp": 2, "fsdp": True}),
    "qwen2.5-7b tp2": ("qwen2.5-7b", {"implementation": "reference"}, {"tp": 2}),
}  # fmt: skip
"""Case name -> (card, ``calc.Training`` fields besides the sizes, ``calc.Parallelism``
fields or None)."""

_CHILD = """
import json, sys, time, calc
card, fields, par_fields = json.loads(sys.argv[1])
model = calc.load_card(card)
rank = fields.pop("lora_rank", None)
if rank is not None:
    fields["lora"] = calc.LoRA(rank=rank)
par = None if par_fields is None else calc.Parallelism(**par_fields)
t = time.perf_counter()
calc.estimate(model, calc.Training(micro_batch=1, seq_len=2048, **fields), par)
first = time.perf_counter() - t
t = time.perf_counter()
calc.estimate(model, calc.Training(micro_batch=2, seq_len=2048, **fields), par)
again = time.perf_counter() - t
print(json.dumps({"first_s": first, "again_s": again}))
"""


def run_case(case: tuple[str, dict, dict | None]) -> dict:
    """One case in a fresh process: seconds of the first and of a second estimate."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(case)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    results = {}
    for name, case in CASES.items():
        results[name] = run_case(case)
        if not args.json:
            r = results[name]
            print(f"{name:36s} first estimate {r['first_s']:7.2f} s   "
                  f"compiled {r['again_s'] * 1e3:7.2f} ms", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
