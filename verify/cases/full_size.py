"""Full-size cases: real cards, unscaled (``Case.full_size``).

Scaled-down models with a 512-token vocabulary hide the regime real models live in: at full
size Qwen2.5-0.5B's 151,936-token logits (and their fp32 log-softmax and gradient) are the
largest tensors of the step and decide the backward peak, and whether the loop keeps the output
object through backward moves the peak by the whole logits tensor. These cases run the real
Qwen2.5-0.5B and GPT-2 (transformers' code) on this CPU, a minute and a few GB each; tagged
``full``, never ``quick``.
"""

from __future__ import annotations

from calc.config.compression import LoRA, Quant
from calc.config.jobs import Sampling
from verify.cases.case import GPT2, QWEN2, Case, infer, train

__all__ = ["full_size_cases"]

GEMMA3 = "gemma-3-1b-it"


def full_size_cases() -> list[Case]:
    """The ``full-*`` cases."""
    kw = {"impl": "hf", "full_size": True, "tags": ("full",)}
    return [
        train("full-qwen2.5-0.5b-sgd-fp32", QWEN2, micro_batch=1, seq_len=256, optimizer="sgd",
              note="HF Trainer's loop (the output dropped before backward)", **kw),
        train("full-qwen2.5-0.5b-sgd-fp32-hold-output", QWEN2, micro_batch=1, seq_len=256,
              optimizer="sgd", loop="hold-output",
              note="out = model(...); out.loss.backward(): the logits live through backward",
              **kw),
        train("full-qwen2.5-0.5b-adamw-bf16", QWEN2, micro_batch=2, seq_len=128,
              precision="bf16", **kw),
        train("full-gpt2-adamw-fp32-dropout", GPT2, micro_batch=4, seq_len=256,
              note="GPT-2's own dropout (0.1 on embeddings, attention and residuals)", **kw),
        train("full-gemma-3-1b-sgd-bf16", GEMMA3, micro_batch=1, seq_len=256, optimizer="sgd",
              precision="bf16", note="derived from transformers' code (no hand-written graph): "
              "a 262,144-token vocabulary, sliding and full layers", **kw),
        # Long enough that attention decides the step (chosen for the GPU run, issue 14: on CUDA
        # SDPA with dropout stays linear in the sequence, eager keeps S x S probabilities)
        train("full-gpt2-sdpa-dropout-fp32-4x512", GPT2, micro_batch=4, seq_len=512, **kw),
        train("full-gpt2-sdpa-dropout-fp32-4x1024", GPT2, micro_batch=4, seq_len=1024, **kw),
        train("full-gpt2-eager-dropout-fp32-4x1024", GPT2, micro_batch=4, seq_len=1024,
              attention="eager", **kw),
        train("full-qwen2.5-0.5b-adamw-bf16-2x1024", QWEN2, micro_batch=2, seq_len=1024,
              precision="bf16", **kw),
        train("full-qwen2.5-0.5b-amp-bf16-2x512", QWEN2, micro_batch=2, seq_len=512,
              precision="amp-bf16", **kw),
        # NF4 on every nn.Linear, the tied LM head too (Lightning's bitsandbytes plugin): the
        # head's own quantized copy of the 151,936 x 896 embedding, dequantized to bf16 in the
        # forward and again in the backward
        train("full-qwen2.5-0.5b-qlora-nf4-head-bf16", QWEN2, micro_batch=1, seq_len=256,
              precision="bf16", lora=LoRA(rank=8),
              quant=Quant(method="nf4", keep_16bit=("embed", "norm")), **kw),
        infer("full-qwen2.5-0.5b-generate-bf16", QWEN2, batch=1, prompt=128, new_tokens=8,
              precision="bf16", **kw),
        infer("full-gpt2-generate-fp32", GPT2, batch=2, prompt=64, new_tokens=16,
              precision="fp32", **kw),
        # prompts of different lengths, left-padded, their attention mask passed (a batched
        # generate as a tokenizer's output feeds it): recorded from transformers' generate
        infer("full-qwen2.5-0.5b-generate-padded-bf16", QWEN2, batch=4, prompt=256,
              new_tokens=8, precision="bf16", padding="left", **kw),
        infer("full-gpt2-generate-padded-fp32", GPT2, batch=3, prompt=96, new_tokens=6,
              precision="fp32", padding="left", **kw),
        # beam search at a real vocabulary: each step's fp32 scores are batch x beams x vocab
        infer("full-qwen2.5-0.5b-generate-beams-bf16", QWEN2, batch=1, prompt=128,
              new_tokens=6, precision="bf16", num_beams=4, **kw),
        infer("full-gpt2-generate-beams-fp32", GPT2, batch=2, prompt=64, new_tokens=12,
              precision="fp32", num_beams=3, **kw),
        # several sampled sequences per prompt (best-of-n): batch x n rows from the prefill on
        infer("full-qwen2.5-0.5b-generate-sample-seqs-bf16", QWEN2, batch=2, prompt=96,
              new_tokens=8, precision="bf16", sampling=Sampling(top_p=0.95),
              num_return_sequences=4, **kw),
    ]  # fmt: skip
