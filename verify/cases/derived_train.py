"""Training recipes on derived architectures: the loops, losses and optimizer variants of
`calc.Training` (``loop``, ``loss``, ``optimizer=None``, ``optimizer_in_backward``) on models
whose replay calc records from transformers' code (`calc.derive`, `calc.derive.loops`).

The ``dtrain-<type>-*`` cases run the tiny configs of `verify.cases.derived` (vocabulary 4096,
so that the logits a loop holds, or does not, weigh); the ``dtrain-derived-*`` cases run the
jobs of the hand-graph loop cases (`verify.cases.single`, ``_loop_cases``) with
``implementation="derived"``: the same measured run, predicted by the derived replay instead
of the hand-written graph (tests/calc/derive/test_loops.py checks both predictions agree).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from calc.config.compression import LoRA, Quant
from calc.config.jobs import Training
from calc.config.parallelism import Parallelism
from verify.cases.case import (
    GLOO_ASYNC_NOTE,
    GLOO_ASYNC_PCT,
    LLAMA,
    LLAMA3,
    QWEN2,
    TOLERANCE_PCT,
    Case,
    DistCase,
    pairs,
)
from verify.cases.case import train as _train
from verify.cases.derived import CONFIGS

VOCAB = 4096
MP: dict[str, Any] = {"fsdp_param_dtype": "bf16", "fsdp_reduce_dtype": "fp32"}
"""The MixedPrecisionPolicy of FSDP2 recipes (bf16 parameters, fp32 reduction)."""
"""Vocabulary of the tiny configs here (the loop cases' ``scale={"vocab": 4096}``)."""


def derived_case(
    model_type: str, label: str, layers: int | None = None, *, prefix: str = "dtrain",
    tag: str = "loop",
    note: str = "derived replay: the job's loop/loss/optimizer variant recorded as verify runs it",
    **job: Any,
) -> Case:  # fmt: skip
    """``<prefix>-<model_type>-<label>``: a training step of the tiny config of ``model_type``
    (`verify.cases.derived`, vocabulary `VOCAB`, ``layers`` decoder layers if given), 2 x 64
    tokens, fp32 AdamW, the hf model (eager attention for Gemma and DeepSeek), then ``job``."""
    attention = "eager" if model_type.startswith(("gemma", "deepseek")) else "sdpa"
    config = {**CONFIGS[model_type], "vocab_size": VOCAB}
    if layers is not None:
        config["num_hidden_layers"] = layers
    fields = {"micro_batch": 2, "seq_len": 64, "precision": "fp32", "optimizer": "adamw",
              "implementation": "hf", "attention": attention, **job}  # fmt: skip
    return Case(
        name=f"{prefix}-{model_type}-{label}",
        card=model_type,
        job=Training(**fields),
        impl="hf",
        tolerance_pct=TOLERANCE_PCT["hf"],
        tags=("training", "hf", "derived", tag),
        note=note,
        config=json.dumps(config, sort_keys=True),
        scale=pairs(None),
    )


def _derived(name: str, card: str, **job: Any) -> Case:
    """A hand-graph loop case's job, predicted by the derived replay."""
    v = {"scale": {"vocab": VOCAB}, "micro_batch": 2, "seq_len": 64}
    return _train(f"dtrain-derived-{name}", card, impl="derived", tags=("derived", "loop"),
                  note="the job of the hf loop case of this name, derived", **v, **job)  # fmt: skip


def derived_training_cases() -> list[Case]:
    """The loop, loss and optimizer variants on derived types, and on llama/qwen2 derived."""
    return [
        derived_case("gemma2", "hold-fp32", loop="hold-output"),
        # Training(dropout=p): every dropout key of the config at p (calc.derive.dropout)
        derived_case("phi3", "dropout-fp32", dropout=0.1),
        derived_case("gemma2", "dropout-bf16", dropout=0.1, precision="bf16"),
        derived_case("starcoder2", "dropout-amp", dropout=0.1, precision="amp-bf16"),
        derived_case("mixtral", "dropout-hold-fp32", dropout=0.05, loop="hold-output"),
        # every n-th layer checkpointed (transformers' every_n_layers): with 14 layers the
        # pattern repeats often enough to record five units; with 8, every layer is recorded
        derived_case("phi3", "recompute-every2-fp32", layers=14, recompute="full", recompute_every=2),
        derived_case("gemma2", "recompute-every3-bf16", layers=8, recompute="full", recompute_every=3,
              precision="bf16"),
        derived_case("mixtral", "recompute-every2-hold-amp", layers=6, recompute="full",
              recompute_every=2, loop="hold-output", precision="amp-bf16"),
        # activation_checkpointing_enable(offload=True): the checkpoints' inputs on the host
        derived_case("gemma2", "offload-bf16", recompute="full", offload_activations=True,
              precision="bf16"),
        derived_case("mixtral", "offload-lora-fp32", recompute="full", offload_activations=True,
              lora=LoRA(rank=4, modules=("q", "k", "v", "o"))),
        # torchtitan's op-level selective checkpointing: eager attention (bmm, recomputed),
        # experts' mm counted per layer
        derived_case("gemma2", "op-sac-fp32", recompute="op"),
        derived_case("mixtral", "op-sac-lora-bf16", recompute="op", precision="bf16",
              lora=LoRA(rank=4, modules=("q", "k", "v", "o"))),
        # Adafactor (torch.optim.Adafactor): factored second moments, 3-D expert tensors too
        derived_case("phi3", "adafactor-fp32", optimizer="adafactor"),
        derived_case("mixtral", "adafactor-for-loop-bf16", optimizer="adafactor",
              optimizer_impl="for-loop", precision="bf16"),
        derived_case("qwen3_moe", "adafactor-step-fp32", optimizer="adafactor", micro_batch=1,
              seq_len=8),
        derived_case("deepseek_v2", "adafactor-amp", optimizer="adafactor", precision="amp-bf16"),
        # Lion (calc.derive.lion): one momentum per parameter, the sign update a temporary per
        # parameter (for-loop) or per dtype group (foreach)
        derived_case("gemma2", "lion-fp32", optimizer="lion"),
        derived_case("qwen3_moe", "lion-for-loop-bf16", optimizer="lion", precision="bf16",
              optimizer_impl="for-loop"),
        derived_case("olmo2", "lion-amp-wd", optimizer="lion", precision="amp-bf16",
              weight_decay=0.1),
        # amp-fp16: torch's GradScaler (scale, unscale_, found_inf, update) recorded
        derived_case("phi3", "amp-fp16", precision="amp-fp16"),
        derived_case("gemma2", "amp-fp16-hold", precision="amp-fp16", loop="hold-output"),
        derived_case("mixtral", "amp-fp16-accum2", precision="amp-fp16", grad_accum=2),
        # bf16-master: fp32 masters and states over bf16 weights (calc.derive.loops.Masters)
        derived_case("phi3", "bf16-master", precision="bf16-master"),
        derived_case("gemma2", "bf16-master-sgdm-hold", precision="bf16-master",
              optimizer="sgd-momentum", loop="hold-output"),
        derived_case("qwen3_moe", "bf16-master-for-loop", precision="bf16-master",
              optimizer_impl="for-loop"),
        derived_case("phi3", "chunked-bf16", loss="chunked-ce", precision="bf16"),
        derived_case("phi3", "chunked-hold-amp", loss="chunked-ce", loop="hold-output",
              precision="amp-bf16", loss_chunks=4),
        derived_case("olmo2", "del-logits-bf16", loop="del-logits", precision="bf16"),
        derived_case("granite", "sum-hold-fp32", loss="sum", loop="hold-output"),
        derived_case("mixtral", "hold-fp32", loop="hold-output"),
        derived_case("qwen3_moe", "chunked-bf16", loss="chunked-ce", precision="bf16"),
        derived_case("gemma2", "noopt-fp32", optimizer=None),
        derived_case("phi3", "noopt-hold-bf16", optimizer=None, loop="hold-output", precision="bf16"),
        derived_case("phi3", "opt-in-bwd-fp32", optimizer_in_backward=True),
        derived_case("gemma2", "opt-in-bwd-sgdm-bf16", optimizer_in_backward=True,
              optimizer="sgd-momentum", precision="bf16"),
        derived_case("mixtral", "opt-in-bwd-bf16", optimizer_in_backward=True, precision="bf16"),
        derived_case("olmo2", "hold-accum2-amp", loop="hold-output", grad_accum=2,
              precision="amp-bf16"),
        derived_case("granite", "noopt-chunked-accum2-fp32", optimizer=None, loss="chunked-ce",
              grad_accum=2),
        _derived("loop-hold-qwen2-bf16", QWEN2, loop="hold-output", precision="bf16"),
        _derived("loop-hold-llama-amp", LLAMA, loop="hold-output", precision="amp-bf16"),
        _derived("loop-del-logits-qwen2-bf16", QWEN2, loop="del-logits", precision="bf16"),
        _derived("loss-sum-hold-qwen2-fp32", QWEN2, loss="sum", loop="hold-output"),
        _derived("loss-chunked-qwen2-amp", QWEN2, loss="chunked-ce", precision="amp-bf16"),
        _derived("loss-chunked-hold-llama-bf16", LLAMA, loss="chunked-ce", loop="hold-output",
                 precision="bf16"),
        _derived("loop-noopt-qwen2-bf16", QWEN2, optimizer=None, precision="bf16"),
        _derived("opt-in-bwd-adamw-qwen2-bf16", QWEN2, optimizer_in_backward=True,
                 precision="bf16"),
    ]  # fmt: skip


def derived_lora_cases() -> list[Case]:
    """LoRA on derived types (verify's own adapters, `verify.models.compress`): Phi-3's fused
    ``qkv_proj``/``gate_up_proj`` adapted whole, Gemma-2's llama-named projections; and the
    jobs of three hand-graph LoRA cases (`verify.cases.compression`) derived."""

    def hf_case(name: str, card: str, **job: Any) -> Case:
        return _train(
            f"dtrain-derived-{name}",
            card,
            impl="derived",
            tags=("derived", "lora"),
            note="the job of the hf LoRA case of this name, derived",
            **job,
        )

    return [
        derived_case("phi3", "lora-r8-fp32", lora=LoRA(rank=8)),
        derived_case("phi3", "lora-r8-qkv-o-bf16", precision="bf16",
              lora=LoRA(rank=8, modules=("q", "k", "v", "o"))),
        derived_case("phi3", "lora-r4-amp-recompute", precision="amp-bf16", recompute="full",
              lora=LoRA(rank=4, modules=("gate", "up", "down"))),
        derived_case("gemma2", "lora-r8-fp32", lora=LoRA(rank=8)),
        derived_case("gemma2", "lora-r8-qv-amp-hold", precision="amp-bf16", loop="hold-output",
              lora=LoRA(rank=8, modules=("q", "v"))),
        derived_case("olmo2", "lora-r16-bf16-fp32-adapters", precision="bf16",
              lora=LoRA(rank=16, adapter_dtype="fp32")),
        derived_case("phi3", "lora-dropout-bf16", precision="bf16", lora=LoRA(rank=8, dropout=0.1)),
        # QLoRA: every decoder linear quantized (calc.derive.quantized, verify's module), the
        # adapters on top; MoE experts are no nn.Linear and stay dense
        derived_case("phi3", "qlora-nf4-bf16", precision="bf16", lora=LoRA(rank=8),
              quant=Quant(method="nf4")),
        derived_case("gemma2", "qlora-nf4-bf16", precision="bf16", lora=LoRA(rank=8),
              quant=Quant(method="nf4")),
        derived_case("olmo2", "qlora-int8-fp32", lora=LoRA(rank=16, modules=("q", "v")),
              quant=Quant(method="int8")),
        derived_case("mixtral", "qlora-nf4-attn-bf16", precision="bf16",
              lora=LoRA(rank=8, modules=("q", "k", "v", "o")), quant=Quant(method="nf4")),
        # mixtures of experts: latent attention's linears (q_a/q_b or q_proj, kv_a/kv_b),
        # dense layers' and shared experts' MLP adapted; routed experts (3-D parameters) not
        derived_case("deepseek_v3", "lora-r8-bf16", precision="bf16", lora=LoRA(rank=8)),
        derived_case("deepseek_v2", "qlora-nf4-bf16", precision="bf16", lora=LoRA(rank=8),
              quant=Quant(method="nf4")),
        derived_case("qwen2_moe", "lora-r8-amp", precision="amp-bf16", lora=LoRA(rank=8)),
        derived_case("qwen3_moe", "lora-r4-fp32", lora=LoRA(rank=4)),
        hf_case("hf-qlora-nf4-bf16-llama3", LLAMA3, precision="bf16", lora=LoRA(rank=8),
                quant=Quant(method="nf4")),
        # NF4 on every nn.Linear, the LM head too (Lightning's bitsandbytes plugin): the head's
        # weight dequantized in forward and again in backward; a tied head (gemma2) gets its
        # own quantized copy
        derived_case("phi3", "qlora-nf4-head-bf16", precision="bf16", lora=LoRA(rank=8),
              quant=Quant(method="nf4", keep_16bit=("embed", "norm"))),
        derived_case("gemma2", "qlora-nf4-head-tied-bf16", precision="bf16", lora=LoRA(rank=8),
              quant=Quant(method="nf4", keep_16bit=("embed", "norm"))),
        hf_case("hf-qlora-nf4-head-amp-llama3", LLAMA3, precision="amp-bf16", lora=LoRA(rank=8),
                quant=Quant(method="nf4", keep_16bit=("embed", "norm"))),
        # bitsandbytes' Adam (calc.derive.bnb: its states, an in-place step); verify steps its
        # emulation, whose chunked update holds temporaries the CUDA kernel does not
        derived_case("phi3", "qlora-paged-adam32bit-bf16", precision="bf16", lora=LoRA(rank=8),
              quant=Quant(method="nf4"), optimizer="adam32bit", paged_optimizer=True),
        derived_case("gemma2", "adam8bit-bf16", precision="bf16", optimizer="adam8bit"),
        hf_case("hf-lora-dropout-amp-bf16-llama3", LLAMA3, precision="amp-bf16",
                lora=LoRA(rank=16, alpha=32, dropout=0.05)),
        hf_case("hf-lora-r8-fp32-llama", LLAMA, lora=LoRA(rank=8)),
        hf_case("hf-lora-r8-amp-bf16-llama3", LLAMA3, precision="amp-bf16", lora=LoRA(rank=8)),
        hf_case("hf-lora-r8-bf16-qwen2", QWEN2, precision="bf16", lora=LoRA(rank=8)),
    ]  # fmt: skip


NATIVE_TP_PCT = 8.0
"""Tolerance of the transformers tensor-parallel cases (`_note`)."""


def _tolerance(parallel: Parallelism) -> float:
    if parallel.tp > 1:
        return NATIVE_TP_PCT
    return GLOO_ASYNC_PCT if parallel.fsdp else TOLERANCE_PCT["hf"]


def _note(parallel: Parallelism) -> str:
    if parallel.tp > 1:
        return (
            "transformers' own tensor parallelism (DistributedConfig) recorded over a fake "
            "process group. 8 % for gloo, which keeps a collective's buffer longer in some "
            "runs (2026-12-05: olmo2 exact, then -7.21 % with rank 1 holding 98,304 B more in "
            "step 2; 2026-12-04 over 4 runs: phi3 once -6.24 %). The fp32 cases' +131,072 B "
            "in the forward until 2026-12-05 was the recording's: the fake rule of "
            "wait_tensor made a new tensor where the kernels return their input "
            "(calc.derive.book); exact since"
        )
    if parallel.fsdp:
        return (
            f"FSDP{parallel.fsdp_version} on a derived architecture: the rank recorded wrapped "
            "by torch's own FSDP over a fake process group. " + GLOO_ASYNC_NOTE
        )
    if parallel.zero == 1:
        return (
            "ZeRO-1 (ZeroRedundancyOptimizer) on a derived architecture: each rank's step "
            "recorded with its local optimizer over its own parameters, plus DDP's buckets"
        )
    return "DDP on a derived architecture: the recorded step plus DDP's buckets"


def _engine(parallel: Parallelism) -> str:
    if parallel.tp > 1:
        return "hf-native"  # transformers' own DistributedConfig
    if parallel.fsdp:
        return "fsdp1" if parallel.fsdp_version == 1 else "fsdp2"
    return "zero1" if parallel.zero == 1 else "ddp"


COMPILED_FSDP2_NOTE = (
    "each decoder layer compiled, FSDP2 per layer and root (torchtitan's shape), measured by "
    "the profiler's allocation events with the collectives over a fake group "
    "(verify.dist.profiled): no gloo timing, hence 1 %"
)


def derived_dist_cases() -> list[DistCase]:
    """DDP on derived types, torchrun gloo on 2 ranks (`verify.dist.engines.ddp`): the
    recorded single-process step plus DDP's buckets (`calc.derive.data_parallel`)."""

    def dist(
        name: str, model_type: str, parallel: Parallelism, vocab: int, tolerance: float = 0.0,
        note: str = "", **job: Any,
    ) -> DistCase:  # fmt: skip
        fields = {"micro_batch": 2, "seq_len": 32, "precision": "fp32", "optimizer": "adamw",
                  "implementation": "hf", **job}  # fmt: skip
        return DistCase(
            name=f"dist-derived-{model_type}-{name}",
            card=model_type,
            job=Training(**fields),
            parallel=parallel,
            engine=_engine(parallel),
            tolerance_pct=tolerance or _tolerance(parallel),
            tags=("derived",),
            note=note or _note(parallel),
            config=json.dumps({**CONFIGS[model_type], "vocab_size": vocab}, sort_keys=True),
        )

    return [
        dist("ddp-2", "phi3", Parallelism(dp=2), 512),
        # 1 MiB buckets over 2 MiB of embedding and head gradients: several buckets, rebuilt in
        # the order the recorded backward made the gradients
        dist(
            "ddp-buckets-amp-2",
            "phi3",
            Parallelism(dp=2, ddp_bucket_mib=1),
            VOCAB,
            precision="amp-bf16",
        ),
        dist("ddp-2", "olmo2", Parallelism(dp=2), 512, precision="bf16"),
        # ZeroRedundancyOptimizer: each rank steps and keeps the states of its parameters
        # (every layer recorded: the partition differs from layer to layer)
        dist("zero1-2", "phi3", Parallelism(dp=2, zero=1, zero_partition="by-parameter"), VOCAB),
        dist(
            "zero1-hold-bf16-2",
            "mixtral",
            Parallelism(dp=2, zero=1, zero_partition="by-parameter"),
            VOCAB,
            precision="bf16",
            loop="hold-output",
        ),
        dist(
            "zero1-lora-2",
            "gemma2",
            Parallelism(dp=2, zero=1, zero_partition="by-parameter"),
            VOCAB,
            lora=LoRA(rank=8),
            attention="eager",
        ),
        # fp16 autocast with torch's GradScaler (unscale_, found_inf, update) on a DDP rank
        dist("ddp-amp-fp16-2", "starcoder2", Parallelism(dp=2), VOCAB, precision="amp-fp16"),
        dist("ddp-bf16-master-2", "olmo2", Parallelism(dp=2), VOCAB, precision="bf16-master"),
        dist(
            "fsdp2-bf16-master-2",
            "phi3",
            Parallelism(dp=2, fsdp=True),
            VOCAB,
            precision="bf16-master",
        ),
        # torchtitan's shape: each layer compiled, FSDP2 per layer and root
        dist(
            "fsdp2-compile-2",
            "olmo2",
            Parallelism(dp=2, fsdp=True),
            VOCAB,
            1.0,
            COMPILED_FSDP2_NOTE,
            compile="regional",
        ),
        dist(
            "fsdp2-mp-compile-2",
            "gemma2",
            Parallelism(dp=2, fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32"),
            VOCAB,
            1.0,
            COMPILED_FSDP2_NOTE,
            compile="regional",
            attention="eager",
        ),
        # the loops, losses, accumulation and adapters under DDP: the buckets are constant, the
        # rest is the recorded single-process step of that loop
        dist("ddp-hold-2", "phi3", Parallelism(dp=2), 512, loop="hold-output"),
        dist(
            "ddp-dellogits-accum-2",
            "olmo2",
            Parallelism(dp=2),
            512,
            precision="bf16",
            loop="del-logits",
            grad_accum=2,
        ),
        dist(
            "ddp-sum-nooptim-2",
            "mixtral",
            Parallelism(dp=2),
            512,
            precision="bf16",
            loss="sum",
            optimizer=None,
        ),
        dist(
            "ddp-lora-before-backward-2",
            "gemma2",
            Parallelism(dp=2),
            512,
            attention="eager",
            lora=LoRA(rank=8),
            zero_grad="before_backward",
        ),
        # FSDP2 (calc.derive.sharding): fully_shard per layer and root, with and without
        # the mixed-precision policy of FSDP2 recipes; MoE experts are 3-D parameters,
        # sharded on the expert dimension; Gemma-2's alternating layers recorded whole
        dist("fsdp2-2", "phi3", Parallelism(dp=2, fsdp=True), VOCAB),
        dist("fsdp2-mp-2", "gemma2", Parallelism(dp=2, fsdp=True, **MP), 512, attention="eager"),
        # gloo's late release holds at most one layer's reduce-scatter input: here the
        # experts make it 221,952 B, 10.2 % of the peak (measured: exact on both ranks, then
        # one rank +131,072 B in steps 2 and 3 of the next run)
        dist(
            "fsdp2-bf16-2",
            "mixtral",
            Parallelism(dp=2, fsdp=True),
            512,
            tolerance=11.0,
            precision="bf16",
        ),
        dist(
            "fsdp2-mp-dellogits-2",
            "olmo2",
            Parallelism(dp=2, fsdp=True, reshard_after_forward=False, **MP),
            VOCAB,
            loop="del-logits",
        ),
        dist(
            "fsdp2-lora-2",
            "qwen3_moe",
            Parallelism(dp=2, fsdp=True),
            512,
            lora=LoRA(rank=8, modules=("q", "k", "v", "o")),
        ),
        # torchtitan's recipe: FSDP2 with its mixed-precision policy and op-level selective
        # checkpointing inside each unit (fused qkv and gate_up: the 1st and 3rd of 4 mm kept)
        dist(
            "fsdp2-mp-op-sac-2",
            "phi3",
            Parallelism(dp=2, fsdp=True, **MP),
            VOCAB,
            recompute="op",
            seq_len=64,
        ),
        dist(
            "fsdp2-mp-output-fp32-2",
            "phi3",
            Parallelism(dp=2, fsdp=True, fsdp_output_dtype="fp32", **MP),
            VOCAB,
        ),
        # transformers' own tensor parallelism (DistributedConfig(tp_size=2)): the model's
        # tp plan; with expert_parallel its ep plan (experts spread, all_reduce dispatch)
        dist("tp-2", "phi3", Parallelism(tp=2), 512, optimizer_impl="for-loop"),
        dist(
            "tp-bf16-2",
            "olmo2",
            Parallelism(tp=2),
            512,
            precision="bf16",
            optimizer_impl="for-loop",
        ),
        dist("tp-2", "mixtral", Parallelism(tp=2), 512, optimizer_impl="for-loop"),
        dist(
            "tp-ep-2",
            "mixtral",
            Parallelism(tp=2, expert_parallel=True),
            512,
            optimizer_impl="for-loop",
        ),
        dist(
            "tp-ep-amp-2",
            "qwen3_moe",
            Parallelism(tp=2, expert_parallel=True),
            512,
            precision="amp-bf16",
            optimizer_impl="for-loop",
        ),
        # a hand-modelled type with implementation="hf": the hand graph's tensor parallelism
        # is Megatron-style (implementation="reference"), transformers' own plan is recorded
        replace(
            dist(
                "tp-amp-2",
                "olmo2",
                Parallelism(tp=2),
                512,
                precision="amp-bf16",
                optimizer_impl="for-loop",
            ),
            name="dist-derived-llama-hf-tp-amp-2",
            card="llama",
            config=json.dumps(
                {**CONFIGS["olmo2"], "model_type": "llama", "pad_token_id": 0}, sort_keys=True
            ),
        ),
        # FSDP1 (FullyShardedDataParallel, flat parameters): the same recording with torch's
        # FSDP1 wrapper (calc.derive.sharding.wrap_fsdp1)
        dist("fsdp1-2", "phi3", Parallelism(dp=2, fsdp=True, fsdp_version=1), VOCAB),
        dist(
            "fsdp1-mp-2",
            "olmo2",
            Parallelism(dp=2, fsdp=True, fsdp_version=1, **MP),
            VOCAB,
        ),
        dist(
            "fsdp1-shard-grad-op-bf16-2",
            "mixtral",
            Parallelism(dp=2, fsdp=True, fsdp_version=1, reshard_after_forward=False),
            512,
            precision="bf16",
        ),
        # LoRA: frozen and trained parameters share each flat parameter (use_orig_params); the
        # flat gradient covers the frozen base too
        dist(
            "fsdp1-lora-2",
            "gemma2",
            Parallelism(dp=2, fsdp=True, fsdp_version=1, fsdp_use_orig_params=True),
            512,
            attention="eager",
            lora=LoRA(rank=8),
        ),
    ]
