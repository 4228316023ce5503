"""Hugging Face ``generate`` cases (`verify.run.step.generate`): greedy, the default
``DynamicCache`` or a static cache, several families, dtypes and batch/prompt/new-token
counts."""

from __future__ import annotations

from calc.config.compression import Quant
from calc.config.jobs import Sampling
from verify.cases.case import GPT2, LLAMA, LLAMA3, MISTRAL, QWEN2, QWEN3, Case, infer

__all__ = ["generate_cases"]


def generate_cases() -> list[Case]:
    """The ``gen-*`` cases."""
    hf = {"impl": "hf"}
    return [
        infer("gen-llama-fp32", LLAMA, batch=2, prompt=8, new_tokens=3, precision="fp32", **hf),
        infer("gen-llama-bf16-long", LLAMA, batch=1, prompt=16, new_tokens=9, precision="bf16",
              **hf),
        infer("gen-llama3-bf16", LLAMA3, batch=3, prompt=12, new_tokens=5, precision="bf16", **hf),
        infer("gen-qwen2-fp32-one", QWEN2, batch=2, prompt=24, new_tokens=1, precision="fp32",
              **hf),
        infer("gen-qwen2-bf16", QWEN2, batch=4, prompt=6, new_tokens=6, precision="bf16", **hf),
        infer("gen-qwen3-fp32", QWEN3, batch=1, prompt=32, new_tokens=4, precision="fp32", **hf),
        infer("gen-mistral-bf16", MISTRAL, batch=2, prompt=16, new_tokens=2, precision="bf16",
              **hf),
        infer("gen-mistral-fp32-long", MISTRAL, batch=2, prompt=4, new_tokens=12,
              precision="fp32", **hf),
        # short prompts, many new tokens: the peak is in the last decode step
        infer("gen-llama-fp32-decode", LLAMA, batch=4, prompt=2, new_tokens=40,
              precision="fp32", **hf),
        infer("gen-qwen2-bf16-decode", QWEN2, batch=8, prompt=3, new_tokens=64,
              precision="bf16", **hf),
        infer("gen-mistral-bf16-decode", MISTRAL, batch=6, prompt=3, new_tokens=50,
              precision="bf16", **hf),
        infer("gen-qwen3-fp32-decode", QWEN3, batch=5, prompt=4, new_tokens=64,
              precision="fp32", **hf),
        infer("gen-gpt2-fp32", GPT2, batch=2, prompt=8, new_tokens=3, precision="fp32", **hf),
        infer("gen-gpt2-bf16-decode", GPT2, batch=6, prompt=2, new_tokens=40, precision="bf16",
              **hf),
        infer("gen-gpt2-fp32-one-row", GPT2, batch=1, prompt=24, new_tokens=6, precision="fp32",
              **hf),
        infer("gen-quant-nf4-llama3-bf16", LLAMA3, batch=2, prompt=10, new_tokens=6,
              precision="bf16", quant=Quant(method="nf4"), **hf),
        infer("gen-llama-fp32-prompt-one", LLAMA, batch=3, prompt=1, new_tokens=5,
              precision="fp32", **hf),
        infer("gen-gpt2-bf16-prompt-one", GPT2, batch=2, prompt=1, new_tokens=7,
              precision="bf16", **hf),
        # cache_implementation="static": the cache of prompt + new tokens made at the prefill
        infer("gen-static-llama-fp32", LLAMA, batch=2, prompt=8, new_tokens=3, precision="fp32",
              cache="static", **hf),
        infer("gen-static-llama3-bf16-decode", LLAMA3, batch=6, prompt=2, new_tokens=40,
              precision="bf16", cache="static", **hf),
        infer("gen-static-qwen3-fp32-one-row", QWEN3, batch=1, prompt=12, new_tokens=7,
              precision="fp32", cache="static", **hf),
        infer("gen-static-mistral-bf16", MISTRAL, batch=3, prompt=16, new_tokens=5,
              precision="bf16", cache="static", **hf),
        infer("gen-static-gpt2-bf16", GPT2, batch=4, prompt=6, new_tokens=9, precision="bf16",
              cache="static", **hf),
        # do_sample=True: the hand graphs refuse it, the replay recorded from transformers'
        # generate answers (calc.estimate's derived fallback); each processor's [b, V] tensors
        infer("gen-sample-llama-fp32-decode", LLAMA, batch=4, prompt=2, new_tokens=40,
              precision="fp32", sampling=Sampling(), **hf),
        infer("gen-sample-qwen2-bf16-top-p", QWEN2, batch=3, prompt=8, new_tokens=12,
              precision="bf16", sampling=Sampling(temperature=0.7, top_k=20, top_p=0.8,
                                                  repetition_penalty=1.05), **hf),
        infer("gen-sample-gpt2-fp32-top-p", GPT2, batch=2, prompt=6, new_tokens=8,
              precision="fp32", sampling=Sampling(top_k=0, top_p=0.95), **hf),
        infer("gen-sample-mistral-bf16-static", MISTRAL, batch=2, prompt=4, new_tokens=10,
              precision="bf16", cache="static", sampling=Sampling(temperature=0.6), **hf),
        # beam search: batch x beams rows, the cache reordered (a new copy per layer) each
        # step; the hand graphs refuse it, the derived replay answers
        infer("gen-beam-llama-fp32", LLAMA, batch=2, prompt=8, new_tokens=6, precision="fp32",
              num_beams=4, **hf),
        infer("gen-beam-qwen2-bf16-static", QWEN2, batch=1, prompt=12, new_tokens=5,
              precision="bf16", cache="static", num_beams=3, **hf),
        infer("gen-beam-gpt2-fp32-decode", GPT2, batch=3, prompt=2, new_tokens=40,
              precision="fp32", num_beams=4, **hf),
        infer("gen-beam-left-qwen3-fp32", QWEN3, batch=3, prompt=10, new_tokens=5,
              precision="fp32", num_beams=2, padding="left", **hf),
        infer("gen-beam-sample-mistral-bf16", MISTRAL, batch=2, prompt=6, new_tokens=8,
              precision="bf16", num_beams=3, sampling=Sampling(top_k=20), **hf),
        # several sequences per prompt: sampling decodes batch x r rows from the prefill on;
        # beam search returns its best r of batch x beams rows
        infer("gen-sample-seqs-llama-fp32", LLAMA, batch=2, prompt=8, new_tokens=6,
              precision="fp32", sampling=Sampling(), num_return_sequences=3, **hf),
        infer("gen-sample-seqs-gpt2-fp32-long", GPT2, batch=2, prompt=2, new_tokens=30,
              precision="fp32", sampling=Sampling(top_p=0.9), num_return_sequences=4, **hf),
        infer("gen-beam-best2-qwen2-bf16", QWEN2, batch=2, prompt=6, new_tokens=6,
              precision="bf16", num_beams=4, num_return_sequences=2, **hf),
        # return_dict_in_generate with output_scores / output_logits: one fp32 [rows, V] per
        # step kept until generate returns (the derived replay); a 4,096-token vocabulary so
        # that they decide the decode's peak
        infer("gen-scores-llama-fp32-decode", LLAMA, batch=4, prompt=2, new_tokens=24,
              precision="fp32", output_scores=True, scale={"vocab": 4096}, **hf),
        infer("gen-scores-logits-qwen2-bf16", QWEN2, batch=3, prompt=6, new_tokens=30,
              precision="bf16", output_scores=True, output_logits=True,
              scale={"vocab": 4096}, **hf),
        infer("gen-scores-logits-sample-mistral-bf16", MISTRAL, batch=2, prompt=4,
              new_tokens=16, precision="bf16", sampling=Sampling(temperature=0.7, top_k=20),
              output_scores=True, output_logits=True, scale={"vocab": 4096}, **hf),
        infer("gen-logits-beam-gpt2-fp32", GPT2, batch=2, prompt=4, new_tokens=8,
              precision="fp32", num_beams=3, output_logits=True, **hf),
    ]  # fmt: skip
