"""Time the estimate of a ``torch.compile``'d step (`calc.derive.inductor`).

    python benchmarks/bench_torch_compile.py [--json] [--card qwen2.5-0.5b --card ...]

Each case runs in a fresh Python process with an empty ``VRAMPLAN_CACHE_DIR`` and one BLAS
thread: ``first_s`` (``first_cpu_s``) is the first ``calc.estimate`` of the compiled job
(build the model on fake tensors, compile it with Inductor, record verify's protocol at the
job's sizes, play the stream); ``disk_s`` the same estimate in a second fresh process that finds
the recording on disk. ``compile="default"`` records every layer (one graph); ``"regional"``
compiles each layer and records five of them.
"""

from __future__ import annotations

import argparse
import json

from _child import first_and_disk

CARDS = ("qwen2.5-0.5b", "qwen3-32b")
"""The cards timed by default: 24 and 64 decoder layers."""
MODES = ("default", "regional")
_JOB = {"micro_batch": 1, "seq_len": 2048, "precision": "amp-bf16", "implementation": "hf"}

_CHILD = """
import json, sys, time
import calc
card, mode, fields = json.loads(sys.argv[1])
job = calc.Training(compile=mode, **fields)
t, cpu = time.perf_counter(), time.process_time()
peak = calc.estimate(calc.load_card(card), job, device="cpu").peak_bytes
print(json.dumps({"s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu, "peak": peak}))
"""


def run_case(card: str, mode: str) -> dict:
    """The first estimate with an empty cache, then again in a new process from the disk."""
    first, disk = first_and_disk(_CHILD, [card, mode, _JOB])
    return {"first_s": first["s"], "first_cpu_s": first["cpu_s"], "disk_s": disk["s"],
            "peak": first["peak"], "same_from_disk": disk["peak"] == first["peak"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--card", action="append", help="model card (repeat; default CARDS)")
    args = parser.parse_args(argv)
    results = {card: {mode: run_case(card, mode) for mode in MODES} for card in args.card or CARDS}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for card, modes in results.items():
        for mode, r in modes.items():
            print(
                f"{card:14s} compile={mode:9s} first {r['first_s']:6.1f} s "
                f"(cpu {r['first_cpu_s']:6.1f} s)   disk cache {r['disk_s']:5.2f} s   "
                f"peak {r['peak']:,} B"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
