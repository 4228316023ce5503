"""Print docs/parallelism.md's multi-GPU table: Qwen2.5-32B full fine-tuning on 8 GPUs, per-GPU GiB.

Every number is ``calc.estimate(model, job, parallel)`` (device ``cuda``), the most-loaded
rank. A layout the cost model does not cover yet is printed as pending, with calc's reason.

    python scripts/parallel_table.py
"""

from __future__ import annotations

import dataclasses

import calc

JOB = calc.Training(
    micro_batch=1,
    seq_len=2048,
    precision="bf16-master",
    optimizer="adamw",
    implementation="reference",
)
ROWS: tuple[tuple[str, calc.Parallelism], ...] = (
    ("DDP (8 replicas)", calc.Parallelism(dp=8)),
    ("ZeRO-1 (dp=8)", calc.Parallelism(dp=8, zero=1)),
    ("ZeRO-2 (dp=8)", calc.Parallelism(dp=8, zero=2)),
    ("ZeRO-3 / FSDP2 (dp=8)", calc.Parallelism(dp=8, zero=3)),
    ("FSDP2, reshard_after_forward=False", calc.Parallelism(dp=8, fsdp=True,
                                                           reshard_after_forward=False)),
    ("ZeRO-3 + offload optimizer and params", calc.Parallelism(dp=8, zero=3,
                                                              offload="optimizer+params")),
    ("TP=8", calc.Parallelism(tp=8)),
    ("TP=4 x PP=2 (1F1B, 8 micro-batches)", calc.Parallelism(tp=4, pp=2, pp_microbatches=8)),
)  # fmt: skip
VERIFIED = {
    "DDP (8 replicas)": "DDP engine, exact",
    "ZeRO-1 (dp=8)": "analytic (verify runs ZeroRedundancyOptimizer's by-parameter partition, exact)",
    "ZeRO-2 (dp=8)": "analytic",
    "ZeRO-3 / FSDP2 (dp=8)": "FSDP2 engine, exact",
    "FSDP2, reshard_after_forward=False": "FSDP2 engine, exact",
    "ZeRO-3 + offload optimizer and params": "analytic (offload is not measurable on CPU)",
    "TP=8": "parallelize_module engine (see the TP cases)",
    "TP=4 x PP=2 (1F1B, 8 micro-batches)": "pipelining engine (see the PP cases)",
}


def job_for(par: calc.Parallelism) -> calc.Training:
    """The job of one layout: every layout trains a global batch of 8 sequences per step, so a
    pipeline's ``micro_batch`` (the batch it splits into ``pp_microbatches``) is 8 per replica
    (``calc.step.pipeline``), one sequence per micro-batch like one per GPU under data parallelism."""
    if par.pp > 1:
        return dataclasses.replace(JOB, micro_batch=JOB.micro_batch * par.pp_microbatches)
    return JOB


def main() -> None:
    model = calc.load_card("qwen2.5-32b")
    single = calc.estimate(model, JOB)
    print("| layout | per-GPU peak (GiB) | most-loaded rank | peak phase | how it is verified |")
    print("|---|---:|---|---|---|")
    print(f"| one GPU (no parallelism) | {single.peak_gib:.2f} | - | {single.peak_phase} | - |")
    for name, par in ROWS:
        try:
            est = calc.estimate(model, job_for(par), par)
        except NotImplementedError as exc:
            print(f"| {name} | pending | - | - | not modelled yet: {exc} |")
            continue
        print(f"| {name} | {est.peak_gib:.2f} | {est.rank} of {par.world_size} | "
              f"{est.peak_phase} | {VERIFIED[name]} |")  # fmt: skip


if __name__ == "__main__":
    main()
