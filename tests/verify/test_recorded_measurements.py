"""The calculator against every GPU measurement recorded under verify/measurements/.

Expected values here are measurements (``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` on a real GPU), never numbers the calculator produced; the checking
logic is `verify.gpu_check.check_file` (exercised without a GPU in tests/verify/test_gpu_check.py
on synthetic files made in a temporary folder). With no file recorded yet the test is skipped,
and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calc.data.outside import NCCL_COMMUNICATOR_HIGH_BYTES, context_term
from verify.gpu_check import _estimate, check_file

MEASUREMENTS = Path(__file__).resolve().parents[2] / "verify" / "measurements"
FILES = sorted(MEASUREMENTS.glob("*.json"))  # superseded/ holds runs kept as evidence only
H200 = MEASUREMENTS / "nvidia-h200-2026-12-04.json"
H200_DERIVED = MEASUREMENTS / "nvidia-h200-2026-12-04-derived.json"


def _h200() -> dict:
    return json.loads(H200.read_text(encoding="utf-8"))


KNOWN_GAPS = {
    "nvidia-h200-2026-12-04.json": {
        # The GPU run's memory snapshot (torch.cuda.memory._snapshot at the peak): CUDA's math
        # SDPA on grouped k/v heads at 512 tokens holds two _softmax_backward_data results
        # (4 MiB = one fp32 [a, s, s] each) at the backward peak where calc holds one. Not yet
        # modelled; the CPU tracker's math path (which calc matches) frees it sooner.
        "act-long-seq-llama3 (default): allocated -4.45% (tolerance 1.0%)",
        "act-long-seq-llama3 (expandable): allocated -4.45% (tolerance 1.0%)",
        "act-long-seq-llama3 (expandable): reserved -17.86% (tolerance 5.0%)",
        # That run took the reserved peak over every phase, the model's build included (HF
        # initialises Qwen2.5-0.5B in fp32 and casts it to bf16: about 1.5 GB of segments
        # cached through the prefill). The harness now leaves the build out (CudaMeter skips
        # "setup" and empties the cache after it); the next GPU run re-measures this case.
        "full-qwen2.5-0.5b-generate-bf16 (default): reserved -59.21% (tolerance 5.0%)",
        "full-qwen2.5-0.5b-generate-bf16 (expandable): reserved -58.88% (tolerance 5.0%)",
    },
}
KNOWN_GAPS["nvidia-h200-2026-12-04-derived.json"] = [
    # the same miss as the first run's (above), measured again
    "act-long-seq-llama3 (default): allocated -4.45% (tolerance 1.0%)",
    "act-long-seq-llama3 (expandable): allocated -4.45% (tolerance 1.0%)",
    "act-long-seq-llama3 (expandable): reserved -17.86% (tolerance 5.0%)",
    # The harness's, not calc's: earlier LoRA builds of the same process left 5,564,928 B
    # allocated (extra["baseline"], taken off the allocated peaks), in blocks of segments the
    # default allocator keeps; the case's small blocks then fit in those segments' free part, so
    # its own reserved growth is 6.25 % less than a fresh process's (expandable segments: exact)
    # (these three ran twice: "derived-" and "dtrain-" both select them)
    *2
    * [
        "dtrain-derived-hf-lora-dropout-amp-bf16-llama3 (default): reserved +6.25% (tolerance 5.0%)",
        "dtrain-derived-hf-lora-r8-amp-bf16-llama3 (default): reserved +6.25% (tolerance 5.0%)",
        "dtrain-derived-hf-lora-r8-bf16-qwen2 (default): reserved +6.25% (tolerance 5.0%)",
    ],
    "dgen-llama-derived-decode-fp32 (default): reserved +6.25% (tolerance 5.0%)",
    "dgen-llama-derived-fp32 (default): reserved +6.25% (tolerance 5.0%)",
    # The build's segments: transformers builds Qwen2.5-0.5B in fp32 and casts it to bf16, the
    # default allocator places the bf16 weights in segments the fp32 copies shared, and
    # empty_cache cannot return those; with expandable segments the reserved peak is within
    # 0.3 % (a model loaded with torch_dtype=bf16 makes no fp32 copy)
    "full-qwen2.5-0.5b-generate-bf16 (default): reserved -18.41% (tolerance 5.0%)",
]
"""Misses of a recorded file that are understood and listed with their cause: the test fails if
one disappears (then it is removed here) or a new one appears."""


# The derived file's 154 cases each record transformers' model once (about 7 s a recording on
# two cores with an empty cache: 19 min here); the disk cache makes the later test quick.
COLD_RECORDING_TIMEOUT_S = 2400


@pytest.mark.skipif(not FILES, reason="no GPU measurement recorded yet (verify/measurements/)")
@pytest.mark.timeout(COLD_RECORDING_TIMEOUT_S)
@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES] or None)
def test_calc_within_tolerance_of_every_recorded_gpu_file(path: Path) -> None:
    assert sorted(check_file(path)) == sorted(KNOWN_GAPS.get(path.name, ()))


def test_the_first_h200_run_is_exact_to_the_byte_with_expandable_segments() -> None:
    # with expandable segments every block is split to its rounded size, so the allocated peak
    # is calc's peak_bytes: 7 of the 8 full-size cases to the byte (GPT-2 SDPA/eager with
    # dropout at 4 x 1024, Qwen2.5-0.5B bf16/amp training; its generate is 512 B over) and 26
    # of the 30 small ones; every case but act-long-seq-llama3 (KNOWN_GAPS) within 0.25 MiB
    data = _h200()
    runs = [c for c in data["cases"] if c["alloc"] == "expandable" and c["status"] == "ok"]
    diff = {c["name"]: c["measured_peak"] - _estimate(c).peak_bytes for c in runs}
    exact = [n for n, d in diff.items() if d == 0]
    assert len([n for n in exact if n.startswith("full-")]) == 7 and len(exact) >= 33
    assert all(abs(d) <= 256 * 1024 for n, d in diff.items() if n != "act-long-seq-llama3")


def test_memory_outside_pytorch_measured_on_the_h200_lies_in_calcs_ranges() -> None:
    # calc.data.outside states the CUDA context as [287,047,680 B, 1000 MiB] from published
    # figures; the H200 run measured total - free - reserved after each stage
    stages = {s["stage"]: s for s in _h200()["outside"]["stages"]}
    ctx = context_term("lazy")
    for stage in ("init", "cublas", "kernels"):
        assert ctx.low_bytes <= stages[stage]["outside_bytes"] <= ctx.high_bytes, stage
    # a one-rank NCCL communicator adds less than the two-GPU figure calc charges per
    # communicator (one rank has no ring peers)
    nccl = stages["nccl"]["outside_bytes"] - stages["kernels"]["outside_bytes"]
    assert 0 < nccl <= NCCL_COMMUNICATOR_HIGH_BYTES


@pytest.mark.timeout(COLD_RECORDING_TIMEOUT_S)
def test_derived_architectures_on_the_h200_within_4_kib_and_1_percent() -> None:
    # the second H200 run (scripts/gpu_check.sh --set derived): training, prefill and generate
    # of 13 architectures calc derives from transformers' code (recorded with CPU kernels) and
    # Hugging Face generate, measured on CUDA with expandable segments: 135 of 154 runs within
    # 4 KiB, every one but act-long-seq-llama3 (KNOWN_GAPS) within 1 %
    data = json.loads(H200_DERIVED.read_text(encoding="utf-8"))
    runs = [c for c in data["cases"] if c["alloc"] == "expandable" and c["status"] == "measured"]
    assert len(runs) == 154
    diff = [(c["name"], _estimate(c).peak_bytes - c["measured_peak"], c) for c in runs]
    assert len([d for _, d, _ in diff if abs(d) <= 4096]) >= 135
    far = {n for n, d, c in diff if abs(d) > c["measured_peak"] / 100}
    assert far == {"act-long-seq-llama3"}
