"""The single-process verification cases (`verify.cases.case.Case`), in report order.

A case that misses its tolerance is a bug in calc or in the harness, and its note says which.
The ``quick`` tag marks the subset CI runs (under 3 minutes on 2 CPU cores).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from calc.config.compression import LoRA, Quant
from calc.config.distill import Distill
from calc.config.pruning import Pruning
from verify.cases.case import GPT2, LLAMA, LLAMA3, MISTRAL, QWEN2, QWEN3, Case, Q
from verify.cases.case import infer as _infer
from verify.cases.case import train as _train
from verify.cases.compiled import compiled_cases
from verify.cases.compression import compression_cases
from verify.cases.derived import derived_cases
from verify.cases.derived_generate import derived_generate_cases
from verify.cases.derived_train import derived_lora_cases, derived_training_cases
from verify.cases.full_size import full_size_cases
from verify.cases.generate import generate_cases
from verify.cases.recipes import recipe_cases
from verify.cases.scale import scaled_spec
from verify.cases.wide import wide_cases


def _precision_cases() -> list[Case]:
    out = []
    for prec in ("fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-master"):
        tags = (*Q, "precision") if prec in ("fp32", "bf16", "amp-bf16") else ("precision",)
        out.append(_train(f"prec-{prec}-llama", LLAMA, precision=prec, tags=tags))
    for prec in ("fp32", "amp-bf16", "bf16"):
        out.append(_train(f"prec-{prec}-mistral", MISTRAL, precision=prec, tags=("precision",)))
    out.append(_train("prec-amp-fp16-qwen2", QWEN2, precision="amp-fp16", tags=("precision",)))
    out.append(
        _train("prec-bf16-master-qwen3", QWEN3, precision="bf16-master", tags=("precision",))
    )
    return out


def _optimizer_cases() -> list[Case]:
    out = []
    for opt in ("sgd", "sgd-momentum", "adam", "adamw"):
        for impl in ("foreach", "fused", "for-loop"):
            quick = opt in ("sgd", "adamw") and impl != "for-loop"
            tags = (*Q, "optimizer") if quick else ("optimizer",)
            out.append(
                _train(f"opt-{opt}-{impl}", MISTRAL, optimizer=opt, optimizer_impl=impl, tags=tags)
            )
    out.append(
        _train(
            "opt-adam8bit",
            MISTRAL,
            optimizer="adam8bit",
            tags=("optimizer",),
            note="CPU runs verify.models.optimizers' BlockwiseAdam8bit, whose chunked update holds up to "
            "EMULATION_SCRATCH_BYTES of temporaries bitsandbytes' CUDA kernel does not "
            "(-0.68 % here): harness-side, bounded",
        )
    )
    # bitsandbytes' 32-bit Adam and the paged optimizers. Hidden 256, ffn 768, vocab 1024: the
    # embedding, head and MLP weights (262,144 and 196,608 elements) are at least 100,000
    # elements, so their states are paged; the attention weights (65,536) and norms are not.
    big = {"layers": 2, "hidden": 256, "ffn": 768, "vocab": 1024}
    paged_note = (
        "paged: the states of params of 100,000 elements or more made out of the tracker's "
        "sight, as bitsandbytes makes them in CUDA managed memory; "
    )
    out += [
        _train("opt-adam32bit", MISTRAL, optimizer="adam32bit", scale=big, tags=("optimizer",),
               note="bitsandbytes Adam32bit: fp32 states, updated in place"),
        _train("opt-adam32bit-paged-in-bwd", MISTRAL, optimizer="adam32bit",
               paged_optimizer=True, optimizer_in_backward=True, scale=big, tags=("optimizer",),
               note="one Adam32bit per parameter, stepped in the backward (torchtune's "
               "optimizer_in_bwd), paged"),
        _train("opt-adam8bit-paged", MISTRAL, optimizer="adam8bit", paged_optimizer=True,
               scale=big, tags=("optimizer",), note=paged_note + "absmax stays PyTorch's"),
        _train("opt-adam32bit-paged-bf16", MISTRAL, optimizer="adam32bit", precision="bf16",
               paged_optimizer=True, scale=big, tags=("optimizer",),
               note=paged_note + "fp32 states of bf16 params"),
        _train("hf-qlora-adam32bit-paged-llama3", LLAMA3, impl="hf", optimizer="adam32bit",
               paged_optimizer=True, precision="bf16", lora=LoRA(rank=160),
               quant=Quant(method="nf4"), scale=big, tags=("optimizer", "qlora"),
               note="the QLoRA paper's optimizer (paged_adamw_32bit) on NF4 + LoRA: the MLP "
               "adapters (768 x 160 = 122,880 elements) are paged, the attention ones "
               "(256 x 160 = 40,960 and smaller) are not"),
    ]  # fmt: skip
    for impl in ("foreach", "for-loop"):
        out.append(
            _train(
                f"opt-adafactor-{impl}",
                MISTRAL,
                optimizer="adafactor",
                optimizer_impl=impl,
                tags=("optimizer",),
                note="factored row/column second moments for 2-D params, full for 1-D ones",
            )
        )
    out.append(_train("opt-lion", MISTRAL, optimizer="lion", tags=("optimizer",)))
    out.append(
        _train(
            "opt-adam-coupled-wd",
            MISTRAL,
            optimizer="adam",
            weight_decay=0.1,
            tags=("optimizer",),
            note="coupled weight decay allocates a gradient-sized temporary",
        )
    )
    out.append(
        _train("opt-adamw-wd-bf16", LLAMA3, optimizer="adamw", weight_decay=0.1, precision="bf16")
    )
    return out


def _recompute_cases() -> list[Case]:
    out = []
    for arch in (LLAMA, GPT2):
        for mode in ("none", "full", "selective"):
            quick = arch == LLAMA and mode != "none"
            tags = (*Q, "recompute") if quick else ("recompute",)
            out.append(
                _train(f"recompute-{mode}-{arch}", arch, recompute=mode, dropout=0.0, tags=tags)
            )
    out.append(
        _train("recompute-full-amp-bf16-qwen2", QWEN2, recompute="full", precision="amp-bf16")
    )
    return out


def _attention_cases() -> list[Case]:
    out = []
    for attn in ("sdpa", "eager", "flash", "efficient", "math"):
        tags = (*Q, "attention") if attn in ("eager", "math") else ("attention",)
        out.append(_train(f"attn-{attn}-llama3", LLAMA3, attention=attn, tags=tags))
    out.append(_train("attn-eager-qwen3", QWEN3, attention="eager", tags=("attention",)))
    out.append(_train("attn-math-bf16-mistral", MISTRAL, attention="math", precision="bf16"))
    out.append(_train("attn-sdpa-qwen3-qknorm", QWEN3, tags=(*Q, "attention")))
    return out


def _dropout_cases() -> list[Case]:
    return [
        _train("dropout-card-gpt2-math", GPT2, attention="math", tags=(*Q, "dropout"),
               note="gpt2's own dropout (0.1 at attention, residual and embedding)"),
        _train("dropout-off-gpt2", GPT2, dropout=0.0, tags=(*Q, "dropout")),
        _train("dropout-on-gpt2-eager", GPT2, dropout=0.1, attention="eager", tags=("dropout",)),
        _train("dropout-on-llama-sdpa", LLAMA, dropout=0.1, tags=("dropout",),
               note="CUDA flash takes dropout; CPU flash does not, so this runs math on CPU"),
        _train("dropout-on-llama-eager", LLAMA, dropout=0.1, attention="eager", tags=("dropout",)),
    ]  # fmt: skip


def _accum_cases() -> list[Case]:
    out = []
    for n in (1, 2, 4):
        tags = (*Q, "grad_accum") if n == 2 else ("grad_accum",)
        out.append(_train(f"accum-{n}-qwen2", QWEN2, grad_accum=n, tags=tags))
    for opt in ("adamw", "sgd"):
        tags = (*Q, "zero_grad") if opt == "adamw" else ("zero_grad",)
        out.append(
            _train(f"zerograd-before-{opt}", LLAMA, optimizer=opt, zero_grad="before_backward",
                   tags=tags)
        )  # fmt: skip
    out.append(_train("zerograd-before-accum2", MISTRAL, zero_grad="before_backward", grad_accum=2))
    return out


def _size_cases() -> list[Case]:
    logits = {"vocab": 4096}
    return [
        _train("size-b1-s16-llama", LLAMA, micro_batch=1, seq_len=16, tags=("size",)),
        _train("size-b4-s64-llama", LLAMA, micro_batch=4, seq_len=64, tags=("size",)),
        _train("size-b8-s8-gpt2", GPT2, micro_batch=8, seq_len=8, dropout=0.0, tags=("size",)),
        _train("act-long-seq-llama3", LLAMA3, micro_batch=1, seq_len=512, tags=("size", "act"),
               scale={"vocab": 320}, note="activations dominate: long sequence, small vocab"),
        _train("act-long-seq-eager-mistral", MISTRAL, micro_batch=1, seq_len=256,
               attention="eager", scale={"vocab": 320}, tags=("size", "act")),
        _train("act-deep-3layers-qwen3", QWEN3, micro_batch=2, seq_len=128,
               scale={"layers": 3}, tags=("size", "act")),
        _train("logits-qwen2-tied", QWEN2, micro_batch=4, seq_len=64, scale=logits,
               tags=(*Q, "size", "logits"), note="logits dominate: vocab 4096, hidden 112"),
        _train("logits-llama3-untied", LLAMA3, micro_batch=4, seq_len=64, scale=logits,
               tags=("size", "logits")),
        _train("logits-gpt2-bf16", GPT2, micro_batch=2, seq_len=64, precision="bf16",
               dropout=0.0, scale=logits, tags=("size", "logits")),
        _train("logits-qwen2-untied", QWEN2, micro_batch=2, seq_len=64,
               scale={"vocab": 4096, "tied_embeddings": False}, tags=("size", "logits")),
        _train("wide-llama-h128", LLAMA, scale={"hidden": 128}, tags=("size",)),
    ]  # fmt: skip


def _hf_cases() -> list[Case]:
    hf = {"impl": "hf"}
    return [
        _train("hf-gpt2-fp32", GPT2, dropout=0.0, tags=(*Q, "hf"), **hf),
        _train("hf-gpt2-eager", GPT2, dropout=0.0, attention="eager", tags=("hf",), **hf),
        _train("hf-llama-fp32", LLAMA, tags=(*Q, "hf"), **hf),
        _train("hf-llama3-amp-bf16", LLAMA3, precision="amp-bf16", tags=("hf",), **hf),
        _train("hf-mistral-bf16", MISTRAL, precision="bf16", tags=("hf",), **hf),
        _train("hf-qwen2-tied", QWEN2, tags=("hf",), **hf),
        _train("hf-qwen3-eager", QWEN3, attention="eager", tags=("hf",), **hf),
        _train("hf-qwen3-logits", QWEN3, micro_batch=4, seq_len=64, scale={"vocab": 4096},
               tags=("hf", "logits"), **hf),
        _train("hf-llama-sgd-for-loop", LLAMA, optimizer="sgd", optimizer_impl="for-loop",
               tags=("hf",), **hf),
        _train("hf-llama3-recompute-full", LLAMA3, recompute="full", tags=("hf", "quick"), **hf),
        _train("hf-mistral-recompute-amp", MISTRAL, recompute="full", precision="amp-bf16",
               tags=("hf",), **hf),
        _train("hf-qwen3-recompute-bf16", QWEN3, recompute="full", precision="bf16",
               tags=("hf",), **hf),
        _train("hf-llama3-recompute-long", LLAMA3, recompute="full", micro_batch=4,
               seq_len=128, tags=("hf",), **hf),
        _train("hf-qwen2-amp-long", QWEN2, precision="amp-bf16", micro_batch=4, seq_len=128,
               tags=("hf",), **hf),
        _train("hf-qwen2-amp-accum2", QWEN2, precision="amp-bf16", grad_accum=2, tags=("hf",),
               **hf),
        # eager attention under autocast: the hand graph refuses it, calc.estimate answers with
        # the replay derived from transformers' code (calc.estimate.fallback)
        _train("hf-qwen2-eager-amp-bf16", QWEN2, attention="eager", precision="amp-bf16",
               micro_batch=4, seq_len=128, tags=("hf", "fallback"), **hf),
        _train("hf-llama3-eager-amp-fp16", LLAMA3, attention="eager", precision="amp-fp16",
               micro_batch=4, seq_len=128, tags=("hf", "fallback"), **hf),
        _train("derived-qwen2-amp-fp16", QWEN2, precision="amp-fp16", impl="derived",
               tags=("derived",), note="the GradScaler's unscale, found_inf and update recorded"),
        # some layers checkpointed (transformers' every_n_layers): recorded from its code
        _train("hf-llama3-recompute-every2", LLAMA3, recompute="full", recompute_every=2,
               micro_batch=4, seq_len=128, scale={"layers": 14}, tags=("hf", "fallback"),
               **hf),
        _train("hf-gpt2-recompute-every2", GPT2, recompute="full", recompute_every=2,
               dropout=0.0, micro_batch=4, seq_len=128, scale={"layers": 4},
               tags=("hf", "fallback"), **hf),
        _train("hf-qwen2-recompute-every3-amp", QWEN2, recompute="full", recompute_every=3,
               precision="amp-bf16", micro_batch=2, seq_len=128, scale={"layers": 7},
               tags=("hf", "fallback"), **hf),
        # transformers' activation_checkpointing_enable(offload=True): each checkpoint's inputs
        # on the host (save_on_cpu), recorded from its code
        _train("hf-llama3-offload-bf16", LLAMA3, recompute="full", offload_activations=True,
               precision="bf16", micro_batch=2, seq_len=128, scale={"layers": 4},
               tags=("hf", "fallback"), **hf),
        _train("hf-qwen2-offload-every2-amp-no-optimizer", QWEN2, recompute="full",
               recompute_every=2, offload_activations=True, precision="amp-bf16", micro_batch=2,
               seq_len=64, optimizer=None, scale={"layers": 6}, tags=("hf", "fallback"), **hf),
        # torchtitan's op-level selective checkpointing (selective_ac_option="op") on
        # transformers' layers: SDPA's and every other mm's outputs kept, the rest recomputed
        _train("hf-llama3-op-sac-bf16", LLAMA3, recompute="op", precision="bf16", micro_batch=2,
               seq_len=128, scale={"layers": 4}, tags=("hf", "fallback"), **hf),
        _train("hf-qwen2-op-sac-amp-hold-no-optimizer", QWEN2, recompute="op",
               precision="amp-bf16", loop="hold-output", optimizer=None, micro_batch=2,
               seq_len=256, scale={"layers": 3},
               tags=("hf", "fallback"), **hf),
        _train("derived-llama-bf16-master", LLAMA, precision="bf16-master", impl="derived",
               tags=("derived",), note="fp32 masters and states recorded over bf16 weights"),
        _train("derived-llama3-recompute-long", LLAMA3, recompute="full", micro_batch=4,
               seq_len=128, impl="derived", tags=("derived",),
               note="calc.derive's replay recorded from transformers' code (no hand graph)"),
        _infer("derived-infer-mistral-bf16", MISTRAL, impl="derived", batch=2, context=64,
               precision="bf16", tags=("derived",)),
    ]  # fmt: skip


def _loop_cases() -> list[Case]:
    """The loop around the model and the loss (``loop``, ``loss``, ``optimizer=None``):
    vocab 4096 so that the logits the loop holds, or does not, weigh."""
    v = {"scale": {"vocab": 4096}, "micro_batch": 2, "seq_len": 64}
    hf, g2 = {"impl": "hf"}, {"dropout": 0.0}
    return [
        _train("loop-hold-llama-fp32", LLAMA, loop="hold-output", tags=(*Q, "loop"), **v),
        _train("loop-hold-hf-qwen2-bf16", QWEN2, loop="hold-output", precision="bf16",
               tags=("loop",), **v, **hf),
        _train("loop-hold-hf-gpt2-fp32", GPT2, loop="hold-output", tags=("loop",), **v, **hf,
               **g2),
        _train("loop-hold-hf-llama-amp", LLAMA, loop="hold-output", precision="amp-bf16",
               tags=("loop",), **v, **hf),
        _train("loop-hold-hf-mistral-sliding-bf16", MISTRAL, loop="hold-output",
               precision="bf16", tags=("loop",), **v, **hf,
               note="mistral's DynamicSlidingWindowLayer: its 0-d window tensor is made by "
               "torch.tensor (no device copy on the CPU): the held cache holds k and v only"),
        _train("hf-math-gqa-fp32-hold-llama3", LLAMA3, loop="hold-output", tags=("loop",),
               **v, **hf, note="fp32 with grouped k/v: CUDA takes the math SDPA kernel "
               "(enable_gqa excludes the efficient one), which the hf hand graph replays"),
        _train("loop-del-logits-hf-qwen2-bf16", QWEN2, loop="del-logits", precision="bf16",
               tags=("loop",), **v, **hf),
        _train("loop-del-logits-gpt2-fp32", GPT2, loop="del-logits", tags=("loop",), **v, **g2),
        _train("loop-noopt-llama-fp32", LLAMA, optimizer=None, tags=("loop",), **v),
        _train("loop-noopt-hf-qwen2-bf16", QWEN2, optimizer=None, precision="bf16",
               tags=("loop",), **v, **hf),
        _train("loop-noopt-hold-hf-gpt2", GPT2, optimizer=None, loop="hold-output",
               tags=("loop",), **v, **hf, **g2),
        _train("loop-noopt-lora-llama-bf16", LLAMA, optimizer=None, precision="bf16",
               lora=LoRA(rank=8), tags=("loop",), **v),
        _train("loop-noopt-qlora-hf-qwen2", QWEN2, optimizer=None, precision="bf16",
               lora=LoRA(rank=8), quant=Quant(method="nf4"), tags=("loop",), **v, **hf),
        _train("opt-in-bwd-adamw-llama-fp32", LLAMA, optimizer_in_backward=True,
               tags=("loop",), **v),
        _train("opt-in-bwd-adamw-hf-qwen2-bf16", QWEN2, optimizer_in_backward=True,
               precision="bf16", tags=("loop",), **v, **hf),
        _train("opt-in-bwd-sgdm-gpt2-fp32", GPT2, optimizer_in_backward=True,
               optimizer="sgd-momentum", tags=("loop",), **v, **g2),
        _train("opt-in-bwd-lora-llama-bf16", LLAMA, optimizer_in_backward=True,
               precision="bf16", lora=LoRA(rank=8), tags=("loop",), **v),
        _train("loss-sum-llama-bf16", LLAMA, loss="sum", precision="bf16", tags=("loss",), **v),
        _train("loss-sum-hold-hf-qwen2-fp32", QWEN2, loss="sum", loop="hold-output",
               tags=("loss",), **v, **hf),
        _train("loss-chunked-llama-bf16", LLAMA, loss="chunked-ce", precision="bf16",
               tags=("loss",), **v),
        _train("loss-chunked-hf-qwen2-amp", QWEN2, loss="chunked-ce", precision="amp-bf16",
               tags=("loss",), **v, **hf),
        _train("loss-chunked-hf-gpt2-fp32", GPT2, loss="chunked-ce", loss_chunks=4,
               tags=("loss",), **v, **hf, **g2),
        _train("loss-chunked-hold-hf-llama-bf16", LLAMA, loss="chunked-ce", loop="hold-output",
               precision="bf16", tags=("loss",), **v, **hf),
    ]  # fmt: skip


def _inference_cases() -> list[Case]:
    return [
        _infer("infer-llama-bf16", LLAMA, batch=2, context=64, precision="bf16", tags=Q),
        _infer("infer-llama3-fp32-prompt", LLAMA3, batch=2, context=128, prompt=32,
               precision="fp32"),
        _infer("infer-qwen2-fp16", QWEN2, batch=4, context=64, precision="fp16"),
        _infer("infer-gpt2-fp32", GPT2, batch=2, context=64, precision="fp32"),
        _infer("infer-hf-mistral-bf16", MISTRAL, impl="hf", batch=2, context=64,
               precision="bf16", tags=Q),
        _infer("infer-hf-qwen3-fp32-prompt", QWEN3, impl="hf", batch=1, context=128, prompt=16,
               precision="fp32"),
        _infer("infer-hf-gpt2-fp32-prompt", GPT2, impl="hf", batch=2, context=64, prompt=24,
               precision="fp32"),
        _infer("infer-hf-gpt2-bf16", GPT2, impl="hf", batch=3, context=48, precision="bf16"),
        _infer("infer-hf-gpt2-eager", GPT2, impl="hf", batch=2, context=64, precision="fp32",
               attention="eager"),
    ]  # fmt: skip


def _pruning_cases() -> list[Case]:
    l1, p = Pruning(), ("pruning",)
    structured = [
        (
            "prune-heads-gqa-llama3",
            LLAMA3,
            {"layers": 2, "kv_heads": 2},
            {"n_heads": 4, "n_kv_heads": 1},
            "8 query / 2 KV heads pruned to 4 / 1",
        ),
        (
            "prune-ffn-layers-qwen2",
            QWEN2,
            {"layers": 4},
            {"ffn": 96, "n_layers": 2},
            "FFN 608 -> 96 channels and 4 -> 2 layers",
        ),
        (
            "prune-heads-mha-llama",
            LLAMA,
            {"layers": 2},
            {"n_heads": 2, "ffn": 64},
            "multi-head attention stays multi-head: KV heads follow the query heads",
        ),
    ]
    out = [
        _train("prune-l1-llama", LLAMA, pruning=l1, tags=(*Q, *p),
               note="weight_orig + weight_mask + the pre-hook's product: memory goes up"),
        _train("prune-removed-llama", LLAMA, pruning=Pruning(removed=True), tags=p,
               note="after prune.remove: dense with zeros, the same bytes as unpruned"),
        _train("prune-l1-gpt2", GPT2, pruning=l1, dropout=0.0, tags=p),
        _train("prune-l1-qwen2-for-loop", QWEN2, pruning=l1, optimizer_impl="for-loop",
               tags=p, note="weight_orig follows the q/k/v bias in parameters()"),
        _train("prune-l1-amp-bf16-llama3", LLAMA3, pruning=l1, precision="amp-bf16", tags=p,
               note="the product is not a leaf: autocast casts it at every call"),
        _train("prune-24-bf16-mistral", MISTRAL, pruning=Pruning(kind="2:4"),
               precision="bf16", tags=p,
               note="2:4 mask through prune.custom_from_mask: the hook keeps the mask too; "
               "CPU cannot run to_sparse_semi_structured, so this is the masked training step"),
        _train("prune-qv-sgd-llama", LLAMA, pruning=Pruning(modules=("q", "v"), amount=0.3),
               optimizer="sgd", tags=p),
        _train("prune-accum2-before-qwen2", QWEN2, pruning=l1, grad_accum=2,
               zero_grad="before_backward", tags=p),
        _train("prune-bf16-master-qwen3", QWEN3, pruning=l1, precision="bf16-master", tags=p),
        _train("prune-recompute-full-llama", LLAMA, pruning=l1, recompute="full",
               micro_batch=4, seq_len=128, tags=(*p, "recompute"),
               note="the recomputation re-runs the pre-hook: a new product per layer"),
        _train("prune-recompute-selective-llama", LLAMA, pruning=l1, recompute="selective",
               micro_batch=4, seq_len=128, tags=(*p, "recompute")),
        _train("prune-hf-recompute-llama3", LLAMA3, impl="hf", pruning=l1, recompute="full",
               micro_batch=4, seq_len=128, tags=(*p, "hf", "recompute")),
        _train("prune-hf-llama", LLAMA, impl="hf", pruning=l1, tags=(*p, "hf")),
        _train("prune-hf-gpt2", GPT2, impl="hf", pruning=l1, dropout=0.0, tags=(*p, "hf"),
               note="HF GPT-2's Conv1D weights pruned the same way"),
    ]  # fmt: skip
    for name, card, scale, keep, note in structured:
        case = _train(name, card, scale=scale, tags=(*p, "structured"), note=note)
        out.append(replace(case, structured=tuple(sorted(keep.items()))))
    return out


def _distill_cases() -> list[Case]:
    def teacher(card: str, **kw: Any) -> Any:
        kw.setdefault("layers", 3)
        return scaled_spec(card, **kw)

    k = ("distill",)
    big_vocab = {"vocab": 4096}
    return [
        _train("distill-fp32-teacher-llama", LLAMA, tags=(*Q, *k),
               distill=Distill(teacher=teacher("llama-2-13b", hidden=96),
                               teacher_precision="fp32"),
               note="teacher 3 layers, hidden 96 (student 2, 64); logits held for the KL"),
        _train("distill-bf16-teacher-4layers-llama", LLAMA, tags=k,
               distill=Distill(teacher=teacher("llama-2-13b", layers=4, hidden=96)),
               note="bf16 teacher over an fp32 student: the KL's product promotes to fp32"),
        _train("distill-T2-hard-llama3", LLAMA3, tags=k,
               distill=Distill(teacher=teacher("qwen2.5-7b"), temperature=2.0, hard_weight=0.5),
               note="T != 1: both logits divided; hard cross entropy added"),
        _train("distill-bf16-student-fp32-teacher-qwen2", QWEN2, precision="bf16", tags=k,
               distill=Distill(teacher=teacher("qwen2.5-7b"), teacher_precision="fp32")),
        _train("distill-gpt2-xl-teacher-T4", GPT2, dropout=0.0, tags=k,
               distill=Distill(teacher=teacher("gpt2-xl"), temperature=4.0)),
        _train("distill-fp16-teacher-bf16-mistral", MISTRAL, precision="bf16", tags=k,
               distill=Distill(teacher=teacher(LLAMA3), teacher_precision="fp16"),
               note="fp16 teacher with a bf16 student: mixed 16-bit dtypes promote to fp32"),
        _train("distill-recompute-accum2-llama", LLAMA, recompute="full", grad_accum=2,
               tags=k, distill=Distill(teacher=teacher("llama-2-13b"), hard_weight=1.0)),
        _train("distill-eager-gqa-qwen3", QWEN3, attention="eager", tags=k,
               distill=Distill(teacher=teacher(QWEN3, kv_heads=2))),
        _train("distill-padded-vocab-qwen2", QWEN2, tags=k,
               distill=Distill(teacher=teacher("qwen2.5-7b", vocab=640)),
               note="teacher vocab 640 over the student's 512 (Qwen2.5-7B vs 0.5B pad "
               "differently): the teacher's logits are sliced, a view"),
        _train("distill-nf4-teacher-llama", LLAMA, precision="bf16", tags=(*k, "quant"),
               distill=Distill(teacher=teacher("llama-2-13b", hidden=128),
                               teacher_quant=Quant(method="nf4")),
               note="4-bit NF4 teacher (double-quantized absmax), bf16 compute"),
        _train("distill-int8-teacher-4layers-llama3", LLAMA3, tags=(*k, "quant"),
               distill=Distill(teacher=teacher(LLAMA3, layers=4, hidden=128),
                               teacher_quant=Quant(method="int8"))),
        _train("distill-int4-fp16-teacher-qwen2", QWEN2, precision="bf16", tags=(*k, "quant"),
               distill=Distill(teacher=teacher("qwen2.5-7b"), teacher_precision="fp16",
                               teacher_quant=Quant(method="int4", group_size=16))),
        _train("distill-and-prune-llama", LLAMA, pruning=Pruning(), tags=(*k, "pruning"),
               distill=Distill(teacher=teacher("llama-2-13b", hidden=96)),
               note="a pruned student (torch.nn.utils.prune) distilled from a dense teacher"),
        _train("distill-amp-bf16-llama", LLAMA, precision="amp-bf16", tags=k,
               distill=Distill(teacher=teacher("llama-2-13b", hidden=96),
                               teacher_precision="fp32"),
               note="the teacher runs under the student's autocast; kl_div casts to fp32"),
        _train("distill-amp-bf16-T2-hard-llama3", LLAMA3, precision="amp-bf16", tags=k,
               distill=Distill(teacher=teacher("qwen2.5-7b"), temperature=2.0,
                               hard_weight=0.5)),
        _train("distill-amp-bf16-gpt2-math", GPT2, precision="amp-bf16", dropout=0.0,
               attention="math", tags=k, distill=Distill(teacher=teacher("gpt2-xl"))),
        _train("distill-amp-bf16-recompute-llama", LLAMA, precision="amp-bf16",
               recompute="full", tags=k,
               distill=Distill(teacher=teacher("llama-2-13b", layers=4), hard_weight=1.0)),
        _train("distill-amp-bf16-logits-llama", LLAMA, precision="amp-bf16", micro_batch=4,
               seq_len=64, scale=big_vocab, tags=(*k, "logits"),
               distill=Distill(teacher=teacher("llama-2-13b", **big_vocab))),
        _train("distill-logits-dominate-llama", LLAMA, micro_batch=4, seq_len=64,
               scale=big_vocab, tags=(*k, "logits"),
               distill=Distill(teacher=teacher("llama-2-13b", **big_vocab),
                               teacher_precision="fp32"),
               note="vocab 4096: teacher logits, probabilities and the KL temporaries dominate"),
    ]  # fmt: skip


def _all() -> tuple[Case, ...]:
    cases = [
        *_precision_cases(),
        *_optimizer_cases(),
        *_recompute_cases(),
        *_attention_cases(),
        *_dropout_cases(),
        *_accum_cases(),
        *_size_cases(),
        *_hf_cases(),
        *_loop_cases(),
        *_inference_cases(),
        *generate_cases(),  # HF generate's decode loop
        *compression_cases(),  # quantization, LoRA, QLoRA
        *_pruning_cases(),
        *_distill_cases(),
        *derived_cases(),  # architectures without a hand-written graph
        *full_size_cases(),  # real cards, unscaled
        *wide_cases(),  # derived cards at full width, two layers
        *compiled_cases(),  # torch.compile of the model
        *derived_training_cases(),  # their loops, losses and optimizer variants
        *derived_lora_cases(),
        *derived_generate_cases(),  # their generate
        *recipe_cases(),  # the implementations users run (torchtune)
    ]
    names = [c.name for c in cases]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"duplicate case names: {sorted(dupes)}")
    return tuple(cases)


CASES: tuple[Case, ...] = _all()
"""Every case, in report order."""


def select(
    cases: tuple[Case, ...] = CASES,
    *,
    impl: str = "all",
    substring: str | None = None,
    quick: bool = False,
) -> list[Case]:
    """Cases of ``impl`` (``reference``, ``hf`` or ``all``) whose name contains ``substring``
    (comma-separated alternatives), restricted to the ``quick`` tag when asked."""
    out = []
    subs = [s for s in (substring or "").split(",") if s]
    for c in cases:
        if impl != "all" and c.impl != impl:
            continue
        if quick and "quick" not in c.tags:
            continue
        if subs and not any(s in c.name for s in subs):
            continue
        out.append(c)
    return out
