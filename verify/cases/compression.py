"""Verification cases for weight quantization, KV-cache quantization, LoRA and QLoRA.

Plain data like `verify.cases.single` (`verify.cases.case.train`/``infer`` build them); every case runs the
``reference`` model with verify's own quantized linears and adapters (`verify.models.compress`), at
the reference tolerance (1 %). Group sizes are chosen to divide the scaled widths (hidden 64;
ffn 176 for llama-2, 224 for llama-3/mistral, 344 for qwen2, 320 for qwen3).
"""

from __future__ import annotations

from calc.config.compression import LoRA, Quant
from verify.cases.case import LLAMA, LLAMA3, MISTRAL, QWEN2, QWEN3, Case, Q
from verify.cases.case import infer as _infer
from verify.cases.case import train as _train


def _quant_inference() -> list[Case]:
    t = ("quant",)
    return [
        _infer("quant-int8-row-infer-llama", LLAMA, batch=2, context=64, precision="bf16",
               quant=Quant(method="int8"), tags=t,
               note="per-row symmetric int8, fp32 scales (bitsandbytes' SCB layout)"),
        _infer("quant-int8-g32-zp-infer-llama3", LLAMA3, batch=2, context=64, precision="fp32",
               quant=Quant(method="int8", group_size=32, zero_point=True, scale_dtype="bf16"),
               tags=t),
        _infer("quant-int4-g128-infer-llama3-h256", LLAMA3, batch=1, context=64,
               precision="bf16", quant=Quant(method="int4"), scale={"hidden": 256}, tags=t,
               note="GPTQ/AWQ-style default: groups of 128, fp16 scale and zero point"),
        _infer("quant-int4-sym-g8-infer-qwen2", QWEN2, batch=2, context=64, precision="fp16",
               quant=Quant(method="int4", group_size=8, zero_point=False), tags=t),
        _infer("quant-nf4-infer-qwen3", QWEN3, batch=2, context=64, precision="bf16",
               quant=Quant(method="nf4"), tags=t),
        _infer("quant-nf4-nodq-infer-mistral", MISTRAL, batch=2, context=64, precision="fp32",
               quant=Quant(method="nf4", double_quant=False), tags=t),
        _infer("quant-fp8-tensor-infer-llama", LLAMA, batch=2, context=64, precision="bf16",
               quant=Quant(method="fp8"), tags=t),
        _infer("quant-fp8-row-infer-qwen2", QWEN2, batch=2, context=64, precision="fp16",
               quant=Quant(method="fp8", fp8_scaling="row"), tags=t),
        _infer("hf-quant-nf4-infer-llama3", LLAMA3, impl="hf", batch=2, context=64,
               precision="bf16", quant=Quant(method="nf4"), tags=t),
        _infer("hf-quant-int4-g16-infer-qwen3-prompt", QWEN3, impl="hf", batch=1, context=128,
               prompt=32, precision="bf16", quant=Quant(method="int4", group_size=16), tags=t),
    ]  # fmt: skip


def _kv_quant_inference() -> list[Case]:
    t = ("kv_quant",)
    return [
        _infer("kv-int8-infer-llama", LLAMA, batch=2, context=64, precision="bf16",
               kv_quant="int8", tags=(*Q, *t),
               note="int8 K/V with a bf16 absmax scale per token and head"),
        _infer("kv-fp8-infer-mistral", MISTRAL, batch=2, context=64, precision="bf16",
               kv_quant="fp8", tags=t),
        _infer("kv-int8-prompt-infer-qwen3-fp32", QWEN3, batch=1, context=128, prompt=32,
               precision="fp32", kv_quant="int8", tags=t),
        _infer("kv-fp8-int4-weights-infer-llama3", LLAMA3, batch=4, context=128,
               precision="bf16", kv_quant="fp8", quant=Quant(method="int4", group_size=32),
               tags=t),
    ]  # fmt: skip


def _lora_training() -> list[Case]:
    t = ("lora",)
    return [
        _train("lora-r8-fp32-llama", LLAMA, lora=LoRA(rank=8), tags=t,
               note="adapters on all seven linears; frozen base keeps no linear inputs"),
        _train("lora-r4-qv-bf16-llama3", LLAMA3, precision="bf16",
               lora=LoRA(rank=4, modules=("q", "v")), tags=t),
        _train("lora-r16-alpha32-recompute-mistral", MISTRAL, recompute="full",
               lora=LoRA(rank=16, alpha=32), tags=t),
        _train("lora-r8-sgd-momentum-qwen2", QWEN2, optimizer="sgd-momentum",
               lora=LoRA(rank=8, modules=("gate", "up", "down")), tags=t),
        _train("lora-r8-bf16-master-qwen3", QWEN3, precision="bf16-master", lora=LoRA(rank=8),
               tags=t),
        _train("lora-r8-fp32-adapters-bf16-llama3", LLAMA3, precision="bf16",
               lora=LoRA(rank=8, adapter_dtype="fp32"), tags=t,
               note="peft's default autocast_adapter_dtype: fp32 adapters over a bf16 base; x is "
               "cast to fp32 for lora_A (kept for its gradient), the fp32 sum cast back"),
        _train("lora-r8-amp-bf16-llama", LLAMA, precision="amp-bf16", lora=LoRA(rank=8),
               tags=t, note="autocast re-casts frozen fp32 weights at every call (no cache: "
               "not leaves needing grad); mm saves the bf16 copy for the input's gradient"),
        _train("hf-lora-r8-fp32-llama", LLAMA, impl="hf", lora=LoRA(rank=8), tags=t),
        _train("hf-lora-r8-amp-bf16-llama3", LLAMA3, impl="hf", precision="amp-bf16",
               lora=LoRA(rank=8), tags=t,
               note="the defaults of calc.Training (hf, amp-bf16) with LoRA"),
        _train("hf-lora-qv-amp-bf16-mistral", MISTRAL, impl="hf", precision="amp-bf16",
               lora=LoRA(rank=8, modules=("q", "v")), tags=t,
               note="frozen k/o/MLP linears under autocast: their casts are not cached"),
        _train("hf-lora-r8-bf16-qwen2", QWEN2, impl="hf", precision="bf16", lora=LoRA(rank=8),
               tags=t),
        _train("hf-qlora-nf4-bf16-llama3", LLAMA3, impl="hf", precision="bf16",
               lora=LoRA(rank=8), quant=Quant(method="nf4"), tags=("qlora",)),
        _train("hf-qlora-int8-recompute-mistral", MISTRAL, impl="hf", precision="bf16",
               recompute="full", lora=LoRA(rank=8), quant=Quant(method="int8"),
               tags=("qlora",)),
        # peft's lora_dropout: each adapted linear keeps its dropped input for A's gradient and
        # the mask (on CPU in the input's dtype, `calc.replay.ops.dropout`)
        _train("lora-dropout-fp32-llama", LLAMA, lora=LoRA(rank=8, dropout=0.1), tags=t,
               note="lora_dropout=0.1 on all seven linears: a dropped copy of each input and "
               "its mask saved per adapter (the first layer's q/k/v too: their input needs no "
               "gradient, so their masks die at once)"),
        _train("hf-lora-dropout-amp-bf16-llama3", LLAMA3, impl="hf", precision="amp-bf16",
               lora=LoRA(rank=16, alpha=32, dropout=0.05), tags=t,
               note="the usual peft recipe: r16, alpha 32, lora_dropout 0.05, under autocast"),
        _train("hf-qlora-nf4-dropout-bf16-qwen2", QWEN2, impl="hf", precision="bf16",
               lora=LoRA(rank=8, dropout=0.1), quant=Quant(method="nf4"), tags=("qlora",),
               note="QLoRA with lora_dropout 0.1"),
        _train("lora-dropout-recompute-mistral", MISTRAL, recompute="full",
               lora=LoRA(rank=8, modules=("q", "v"), dropout=0.1), tags=t,
               note="dropout inside checkpointed layers: the masks are recomputed"),
    ]  # fmt: skip


def _qlora_training() -> list[Case]:
    t = ("qlora",)
    return [
        _train("qlora-nf4-bf16-llama", LLAMA, precision="bf16", lora=LoRA(rank=8),
               quant=Quant(method="nf4"), tags=(*Q, *t),
               note="QLoRA: NF4 base with double quantization, bf16 adapters"),
        _train("qlora-nf4-nodq-fp32-qwen3", QWEN3, lora=LoRA(rank=8),
               quant=Quant(method="nf4", double_quant=False), tags=t),
        _train("qlora-int4-g32-bf16-llama3", LLAMA3, precision="bf16", lora=LoRA(rank=8),
               quant=Quant(method="int4", group_size=32), tags=t),
        _train("qlora-int8-bf16-mistral", MISTRAL, precision="bf16", lora=LoRA(rank=8),
               quant=Quant(method="int8"), tags=t),
        _train("qlora-fp8-row-bf16-qwen2", QWEN2, precision="bf16", lora=LoRA(rank=4),
               quant=Quant(method="fp8", fp8_scaling="row"), tags=t),
        _train("qlora-nf4-recompute-llama3", LLAMA3, precision="bf16", recompute="full",
               lora=LoRA(rank=8), quant=Quant(method="nf4"), tags=t),
        _train("qlora-nf4-fp32-adapters-qwen2", QWEN2, precision="bf16",
               lora=LoRA(rank=16, adapter_dtype="fp32"), quant=Quant(method="nf4"),
               tags=t, note="QLoRA as peft + bitsandbytes set it up: NF4 base, fp32 adapters"),
        _train("qlora-nf4-long-seq-llama3", LLAMA3, precision="bf16", micro_batch=1,
               seq_len=512, scale={"vocab": 320}, lora=LoRA(rank=8),
               quant=Quant(method="nf4"), tags=t,
               note="activations and dequantization transients, not logits, decide the peak"),
        _train("lora-long-seq-recompute-qwen3", QWEN3, precision="bf16", micro_batch=1,
               seq_len=512, recompute="full", scale={"vocab": 320}, lora=LoRA(rank=8), tags=t),
        _train("qlora-nf4-attn-only-mistral", MISTRAL, precision="bf16",
               lora=LoRA(rank=8, modules=("q", "k", "v", "o")), quant=Quant(method="nf4"),
               tags=t),
    ]  # fmt: skip


def compression_cases() -> list[Case]:
    """Every quantization / LoRA / QLoRA case, in report order."""
    return [*_quant_inference(), *_kv_quant_inference(), *_lora_training(), *_qlora_training()]
