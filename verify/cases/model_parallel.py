"""Distributed verification cases of model parallelism: tensor (and sequence) parallelism.

Engines are in `verify.dist.tp_plans` (``parallelize_module`` on a ``DeviceMesh``). Sizes are chosen so
that tp divides the heads, the kv heads and the MLP width (``kv_heads=tp``). Tolerance 1 % (the
reference implementation's bar) where no all-reduce runs, 3 % for tensor-parallel cases, for one
named reason, "gloo's late release": gloo's worker thread holds a finished all-reduce's work
object, and with it the all-reduced output, until that thread is scheduled again
(``ProcessGroupGloo::runLoop`` resets ``workInProgress_`` after ``execute``). On 2 cores shared
by 2-4 ranks (each with a main and two gloo threads) that can outlive the tensor's last use by
milliseconds, so on some ranks and steps the tracker sees one ``[b, s, h]`` all-reduce output
more than the replay, alive across the peak (measured: a forward all-reduce output alive at
the loss-gradient peak; a backward one in the optimizer step). Its lifetime is a thread
schedule, not a tensor reference the model holds: the communication-buffer allowance of
issue 4. The replay (what calc predicts) has no such hold, as on a GPU with NCCL.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from calc.config.parallelism import Parallelism
from verify.cases.case import LLAMA3 as LLAMA
from verify.cases.case import DistCase, Q, pairs, training_job

QWEN = "qwen2.5-7b"
MODEL_PARALLEL_JOB = {"seq_len": 64, "optimizer_impl": "for-loop"}
"""How the model-parallel cases' jobs differ from `verify.cases.case.JOB_DEFAULTS`."""
LATE = (
    "3 %: gloo's late release (module docstring) may keep one [b, s, h] all-reduce output "
    "alive across the peak on some ranks/steps"
)

SP_NOTE = (
    "sequence parallel (calc.parallel.sequence); 3 %: gloo's late release (module docstring) "
    "may keep the head's logits all-gather (its [b*s, V/tp] input and [b*s, V] output) or a "
    "backward all-gather buffer alive across the peak on some ranks/steps (measured with "
    "vocab 512: +393216 B, 6 % of the peak, on one rank in one of three steps; hence the "
    "small vocabulary)"
)


def _tp(
    name: str,
    parallel: Parallelism,
    *,
    card: str = LLAMA,
    scale: dict[str, Any] | None = None,
    tags: tuple[str, ...] = (),
    note: str = LATE,
    tolerance_pct: float = 3.0,
    **job: Any,
) -> DistCase:
    sc = {"layers": 2, "kv_heads": parallel.tp, "tied_embeddings": False}
    sc.update(scale or {})
    return DistCase(
        name=name,
        card=card,
        scale=pairs(sc),
        job=training_job(**{**MODEL_PARALLEL_JOB, **job}),
        parallel=parallel,
        engine="tp",
        tags=("tp", *tags),
        note=note,
        tolerance_pct=tolerance_pct,
    )


TP2 = Parallelism(tp=2)
TP4 = Parallelism(tp=4)

CASES: tuple[DistCase, ...] = (
    _tp("tp2-adamw", TP2, tags=Q),
    _tp("tp2-sgd-longseq", TP2, optimizer="sgd", seq_len=128,
        note=f"{LATE} (here 131072 B, 1.8 % of the peak)"),
    _tp("tp2-recompute-full", TP2, optimizer="sgd", seq_len=128, recompute="full",
        scale={"vocab": 16, "layers": 3},
        note=f"peak inside a recomputed layer's backward (small vocabulary); {LATE}"),
    _tp("tp2-qwen-bias", TP2, card=QWEN, tags=Q, note=f"q/k/v biases column-split; {LATE}"),
    _tp("tp2-amp-bf16", TP2, precision="amp-bf16"),
    _tp("tp4-adamw", TP4),
    _tp("tp4-sgd-longseq", TP4, optimizer="sgd", seq_len=128,
        note=f"{LATE} (here 262144 B, 2.5 % of the peak)"),
    _tp("tp4-gqa-kv1", TP4, scale={"kv_heads": 4, "head_dim": 8},
        note=f"one kv head per rank (GQA groups kept whole); {LATE}"),
    _tp("tp2-sp", Parallelism(tp=2, sp=True), tags=("sp",), scale={"vocab": 128}, note=SP_NOTE),
    _tp("tp4-sp", Parallelism(tp=4, sp=True), tags=("sp",), scale={"vocab": 128}, note=SP_NOTE),
    _tp("tp2-sp-recompute-full", Parallelism(tp=2, sp=True), tags=("sp",), optimizer="sgd",
        recompute="full", scale={"vocab": 16, "layers": 3},
        note="peak inside a recomputed layer's backward (small vocabulary); 3 %: gloo's late "
        "release (module docstring): measured up to 98304 B (an all-gather's [b, s, h] buffer "
        "and its shard, 2.9 % of the peak) on one rank in one step"),
    _tp("tp2-sp-amp-bf16", Parallelism(tp=2, sp=True), tags=("sp",), scale={"vocab": 128},
        precision="amp-bf16", note=SP_NOTE),
    _tp("tp2-vocab-parallel", Parallelism(tp=2, vocab_parallel=True), tags=("vocab",),
        note="embedding row-parallel over the vocabulary, head column-parallel, loss_parallel; "
        f"its max/sum all-reduces and masks run inside DTensor's dispatch (unseen); {LATE}"),
    _tp("tp4-vocab-parallel-sgd", Parallelism(tp=4, vocab_parallel=True), tags=("vocab",),
        optimizer="sgd", seq_len=128, note=f"as tp2-vocab-parallel on 4 ranks; {LATE}"),
    _tp("tp2-sp-vocab-parallel", Parallelism(tp=2, sp=True, vocab_parallel=True),
        tags=("sp", "vocab"), note=f"torchtitan's full plan: embedding reduce-scattered over "
        f"the sequence, vocabulary-sharded logits under loss_parallel; {LATE}"),
    _tp("tp4-sp-vocab-parallel", Parallelism(tp=4, sp=True, vocab_parallel=True),
        tags=("sp", "vocab"), note=f"as tp2-sp-vocab-parallel on 4 ranks (the embedding's "
        f"gradient is the whole [V, h] table on every rank: calc.parallel.sequence); {LATE}"),
)  # fmt: skip


def _pp(name: str, parallel: Parallelism, *, layers: int = 4, tags: tuple[str, ...] = (),
        note: str = "", tolerance_pct: float = 1.0, scale_kv: int | None = None,
        **job: Any) -> DistCase:  # fmt: skip
    return DistCase(
        name=name, card=LLAMA,
        scale=(("layers", layers), ("tied_embeddings", False),
               *((("kv_heads", scale_kv),) if scale_kv else ())),
        job=training_job(**{**MODEL_PARALLEL_JOB, "micro_batch": 4, **job}), parallel=parallel,
        engine="pp", tags=("pp", *tags), note=note, tolerance_pct=tolerance_pct,
    )  # fmt: skip


def _pl(pp: int, schedule: str, m: int) -> Parallelism:
    return Parallelism(pp=pp, pp_schedule=schedule, pp_microbatches=m)


ONE_F_ONE_B = (
    "1F1B: on a non-last stage with w = min(m, pp - r) >= 2 warm-up forwards, the Work of the "
    "last send the warm-up fires keeps micro-batch w - 2's output alive past its backward, "
    "until the 1B1F loop ends (calc.step.pipeline._warmup_send); every rank exact"
)

PP_DDP = (
    "the engine gives PipelineStage its shapes (input_args, output_args, grads): torch 2.13's "
    "shape inference runs the DDP stage outside no_sync, which arms DDP's hooks, and GPipe's "
    "next bucket rebuild then fails (reducer.cpp INTERNAL ASSERT); without that run the last "
    "stage holds 512-1,024 B less than the replay"
)

CASES += (
    _pp("pp2-gpipe-m2", _pl(2, "gpipe", 2), tags=Q),
    _pp("pp2-1f1b-m4", _pl(2, "1f1b", 4), note=ONE_F_ONE_B),
    _pp("pp2-1f1b-m2-uneven", _pl(2, "1f1b", 2), layers=3,
        note=f"3 layers on 2 stages: the first stage takes 2; {ONE_F_ONE_B}"),
    _pp("pp2-gpipe-m4-deep-sgd", _pl(2, "gpipe", 4), layers=10, optimizer="sgd",
        note="5 layers per stage: the replay of 5 layers generalised (calc.replay.timeline)"),
    _pp("pp4-gpipe-m4", _pl(4, "gpipe", 4), note="middle stages: both receive buffers"),
    _pp("pp4-1f1b-m4", _pl(4, "1f1b", 4), note=ONE_F_ONE_B),
    _pp("pp2-interleaved-v2-m4",
        Parallelism(pp=2, pp_schedule="interleaved-1f1b", pp_microbatches=4,
                    pp_virtual_stages=2),
        note="ScheduleInterleaved1F1B, 2 chunks per rank (loop placement), replayed by "
        "calc.step.pipeline (interleaved_actions)"),
    _pp("pp2-interleaved-v2-m8-l8",
        Parallelism(pp=2, pp_schedule="interleaved-1f1b", pp_microbatches=8,
                    pp_virtual_stages=2),
        layers=8, micro_batch=8, note="2 layers per chunk, 4 rounds of 2 micro-batches"),
    # what real pipeline runs add: recomputation and autocast inside each stage's forward
    _pp("pp2-1f1b-m4-full-recompute", _pl(2, "1f1b", 4), recompute="full",
        note=f"every layer checkpointed (non-reentrant) inside the stage; {ONE_F_ONE_B}"),
    _pp("pp2-gpipe-m4-amp-bf16", _pl(2, "gpipe", 4), precision="amp-bf16",
        note="autocast inside each stage's forward, left before the loss: every micro-batch "
        "in flight keeps its own bf16 copies of the weights its linears saved"),
    _pp("pp2-1f1b-m4-amp-bf16-full-recompute", _pl(2, "1f1b", 4), precision="amp-bf16",
        recompute="full", note=f"autocast and full recomputation together; {ONE_F_ONE_B}"),
    _pp("pp2-interleaved-v2-m4-selective",
        Parallelism(pp=2, pp_schedule="interleaved-1f1b", pp_microbatches=4,
                    pp_virtual_stages=2),
        recompute="selective", note="the attention core checkpointed in every chunk"),
    # data parallelism around the stages: mesh [dp, pp], each stage DDP over its dp group
    _pp("pp2-dp2-1f1b-m4", Parallelism(pp=2, dp=2, pp_schedule="1f1b", pp_microbatches=4),
        tags=("2d",), note="DDP around each stage, the stage shapes given (PP_DDP below): "
        "no_sync on all but the last backward, which fills the buckets; the buckets rebuilt "
        f"by step 2's first forward; {PP_DDP}"),
    _pp("pp2-dp2-gpipe-m2-amp-bf16-full-recompute",
        Parallelism(pp=2, dp=2, pp_schedule="gpipe", pp_microbatches=2), tags=("2d",),
        precision="amp-bf16", recompute="full",
        note="what real pipeline runs combine: data parallelism, recomputation and "
        f"autocast; {PP_DDP}"),
)  # fmt: skip


def _fsdp_tp(
    name: str, parallel: Parallelism, *, tags: tuple[str, ...] = (), **job: Any
) -> DistCase:
    case = _tp(name, parallel, tags=("2d", *tags), **job)
    return DistCase(
        name=case.name, card=case.card, scale=case.scale, job=case.job, parallel=parallel,
        engine="fsdp-tp", tags=case.tags, note=f"2-D mesh [dp, tp]: FSDP2 over dp, TP over tp; {LATE}",
        tolerance_pct=case.tolerance_pct,
    )  # fmt: skip


MP_2D = Parallelism(dp=2, tp=2, fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32")
"""torchtitan's 2-D layout: FSDP2 with its bf16/fp32 ``MixedPrecisionPolicy`` over dp, TP over tp."""

CASES += (
    _fsdp_tp("fsdp2-tp2-dp2", Parallelism(dp=2, tp=2, fsdp=True)),
    _fsdp_tp("fsdp2-tp2-dp2-noreshard",
             Parallelism(dp=2, tp=2, fsdp=True, reshard_after_forward=False)),
    _fsdp_tp("fsdp2-mp-tp2-dp2", MP_2D, precision="fp32"),
    _fsdp_tp("fsdp2-tp2-dp2-sp-vocab", Parallelism(dp=2, tp=2, fsdp=True, sp=True,
             vocab_parallel=True), scale={"vocab": 128}),
    _fsdp_tp("fsdp2-tp2-dp2-vocab-dellogits", Parallelism(dp=2, tp=2, fsdp=True,
             vocab_parallel=True), loop="del-logits"),
    _fsdp_tp("fsdp2-mp-tp2-dp2-sp-vocab-dellogits-recompute",
             replace(MP_2D, sp=True, vocab_parallel=True), scale={"vocab": 128},
             precision="fp32", loop="del-logits", recompute="full"),
)  # fmt: skip
CASES += (
    _tp("tp2-dellogits", TP2, loop="del-logits"),
    _tp("tp2-vocab-parallel-dellogits", Parallelism(tp=2, vocab_parallel=True),
        tags=("vocab",), loop="del-logits"),
)  # fmt: skip


CASES += (
    _pp("pp2-tp2-1f1b-m2", Parallelism(pp=2, tp=2, pp_schedule="1f1b", pp_microbatches=2),
        scale_kv=2, tags=("2d",), tolerance_pct=3.0,
        note=f"2-D mesh [pp, tp]: TP inside each stage; {LATE}; {ONE_F_ONE_B}"),
    _pp("pp2-tp2-gpipe-m2", Parallelism(pp=2, tp=2, pp_schedule="gpipe", pp_microbatches=2),
        scale_kv=2, tags=("2d",), tolerance_pct=3.0,
        note=f"2-D mesh [pp, tp]: TP inside each stage; {LATE}"),
)  # fmt: skip
