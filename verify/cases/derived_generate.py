"""HF ``generate`` on architectures with no hand-written graph: calc records transformers'
real ``generate`` (`calc.derive.generate`) and checks it against the CPU tracker
(`verify.run.step.generate`: greedy, no attention mask or a left-padded batch's, the default
``DynamicCache`` or ``cache_implementation="static"``).

The tiny configs are `verify.cases.derived.CONFIGS`'. Gemma-2's window is 16 tokens: a prompt
of 12 with 8 new tokens crosses it (its sliding layers stop growing at the window), a prompt of
24 starts beyond it. A llama and a qwen2 case run ``implementation="derived"`` on a hand-
modelled type: the derived replay must equal the hand graph (`calc.models.hf_generate`) and the
measurement.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from calc.config.compression import Quant
from calc.config.jobs import Inference, Sampling
from verify.cases.case import LLAMA, QWEN2, Case, infer
from verify.cases.derived import _case as derived_case

__all__ = ["derived_generate_cases"]


def _case(model_type: str, label: str, job: Inference, **config: Any) -> Case:
    """`verify.cases.derived`'s case of ``job`` on the tiny ``model_type`` (``config``: keys
    changed in its config), named ``dgen-``."""
    made = derived_case(model_type, label, job, **config)
    return replace(made, name=f"dgen-{model_type}-{label}", tags=(*made.tags, "generate"))


def _gen(
    model_type: str, batch: int, prompt: int, new: int, precision: str, **kw: Any
) -> Inference:
    attention = "eager" if model_type.startswith(("gemma", "deepseek")) else "sdpa"
    return Inference(
        batch=batch, prompt=prompt, new_tokens=new, precision=precision,
        attention=attention, implementation="hf", **kw,
    )  # fmt: skip


def derived_generate_cases() -> list[Case]:
    """The ``dgen-*`` cases."""
    return [
        # Gemma-2: window 16; the generation crosses it, starts beyond it, stays inside it
        _case("gemma2", "cross-fp32", _gen("gemma2", 2, 12, 8, "fp32")),
        _case("gemma2", "beyond-bf16", _gen("gemma2", 1, 24, 5, "bf16")),
        _case("gemma2", "inside-bf16", _gen("gemma2", 2, 6, 4, "bf16")),
        _case("gemma2", "static-fp32", _gen("gemma2", 2, 12, 6, "fp32", cache="static")),
        # Gemma-3: two sliding layers and a full one
        _case("gemma3_text", "cross-bf16", _gen("gemma3_text", 2, 10, 9, "bf16")),
        _case("gemma3_text", "fp32", _gen("gemma3_text", 1, 20, 3, "fp32")),
        # Phi-3 (fused qkv and gate_up)
        _case("phi3", "fp32", _gen("phi3", 2, 16, 5, "fp32")),
        _case("phi3", "bf16-one-row", _gen("phi3", 1, 24, 8, "bf16")),
        _case("phi3", "static-bf16", _gen("phi3", 2, 8, 6, "bf16", cache="static")),
        # dense types: norms after the blocks, multipliers, LayerNorm with biases, parallel blocks
        _case("olmo2", "fp32", _gen("olmo2", 2, 12, 4, "fp32")),
        _case("granite", "bf16", _gen("granite", 2, 10, 6, "bf16")),
        _case("starcoder2", "fp32", _gen("starcoder2", 1, 16, 5, "fp32")),
        _case("cohere", "bf16-static", _gen("cohere", 2, 8, 4, "bf16", cache="static")),
        # mixtures of experts (grouped_mm: sizes independent of the routing)
        _case("mixtral", "bf16", _gen("mixtral", 2, 12, 5, "bf16")),
        _case("qwen3_moe", "fp32", _gen("qwen3_moe", 1, 16, 4, "fp32")),
        _case("qwen2_moe", "bf16", _gen("qwen2_moe", 2, 8, 3, "bf16")),
        _case("deepseek_v2", "bf16", _gen("deepseek_v2", 2, 10, 4, "bf16")),
        # short prompts, many new tokens: the peak is in the last decode step
        _case("gemma2", "decode-bf16", _gen("gemma2", 6, 3, 40, "bf16")),
        _case("phi3", "decode-fp32", _gen("phi3", 5, 3, 40, "fp32")),
        _case("gemma3_text", "decode-static-fp32",
              _gen("gemma3_text", 4, 2, 32, "fp32", cache="static")),
        _case("qwen2_moe", "decode-fp32", _gen("qwen2_moe", 6, 2, 36, "fp32")),
        # long generations, recorded at shorter ones and cut (prompt and context sampled)
        _case("olmo2", "long-fp32", _gen("olmo2", 2, 40, 30, "fp32")),
        _case("gemma2", "long-beyond-bf16", _gen("gemma2", 2, 24, 30, "bf16")),
        _case("deepseek_v2", "long-bf16", _gen("deepseek_v2", 3, 4, 28, "bf16", cache="static")),
        # do_sample=True with its logits processors (top-p sorts the whole vocabulary; the
        # repetition penalty gathers the sequence so far: a cut recording lifts it in c)
        _case("gemma2", "sample-bf16", _gen("gemma2", 3, 6, 12, "bf16",
                                            sampling=Sampling(top_p=0.9))),
        _case("phi3", "sample-long-fp32", _gen("phi3", 2, 10, 30, "fp32",
              sampling=Sampling(temperature=0.8, repetition_penalty=1.1))),
        _case("qwen3_moe", "sample-bf16", _gen("qwen3_moe", 2, 8, 6, "bf16",
                                               sampling=Sampling(top_k=10))),
        _case("gemma2", "sample-seqs-cross-fp32", _gen("gemma2", 2, 12, 8, "fp32",
              sampling=Sampling(), num_return_sequences=3)),
        _case("qwen2_moe", "sample-seqs-long-bf16", _gen("qwen2_moe", 2, 4, 28, "bf16",
              sampling=Sampling(top_k=10), num_return_sequences=2)),
        # each step's scores (and raw logits) kept until generate returns: recorded whole
        _case("gemma2", "scores-logits-sample-cross-bf16", _gen("gemma2", 2, 12, 8, "bf16",
              sampling=Sampling(top_k=10), output_scores=True, output_logits=True)),
        _case("qwen3_moe", "scores-decode-fp32", _gen("qwen3_moe", 4, 2, 30, "fp32",
                                                      output_scores=True)),
        # beam search over a sliding-window cache, experts, latent attention
        _case("gemma2", "beam-cross-fp32", _gen("gemma2", 2, 12, 8, "fp32", num_beams=3)),
        _case("mixtral", "beam-bf16", _gen("mixtral", 1, 10, 6, "bf16", num_beams=4)),
        _case("deepseek_v2", "beam-long-bf16", _gen("deepseek_v2", 2, 6, 28, "bf16",
                                                    num_beams=2)),
        _case("phi3", "beam-decode-fp32", _gen("phi3", 4, 2, 36, "fp32", num_beams=4)),
        _case("gemma2", "beam-static-left-bf16", _gen("gemma2", 2, 10, 6, "bf16", num_beams=2,
                                                      cache="static", padding="left")),
        # weight-only quantized linears (calc.derive.quantized): dequantized per matmul
        _case("phi3", "quant-nf4-bf16", _gen("phi3", 2, 12, 5, "bf16",
                                             quant=Quant(method="nf4"))),
        _case("gemma2", "quant-int8-fp32", _gen("gemma2", 2, 10, 4, "fp32",
                                                quant=Quant(method="int8"))),
        # a one-token prompt (no mask at the prefill)
        _case("olmo2", "prompt-one-bf16", _gen("olmo2", 3, 1, 6, "bf16")),
        # hand-modelled types replayed as derived: equal to the hand graph and the measurement
        infer("dgen-llama-derived-decode-fp32", LLAMA, impl="derived",
              tags=("derived", "generate"), batch=4, prompt=2, new_tokens=40, precision="fp32"),
        # eager attention, which the hand graph leaves out: answered by the derived replay
        infer("dgen-llama-eager-fallback-fp32", LLAMA, impl="hf", tags=("derived", "generate"),
              batch=2, prompt=8, new_tokens=4, precision="fp32", attention="eager"),
        infer("dgen-llama-derived-fp32", LLAMA, impl="derived", tags=("derived", "generate"),
              batch=2, prompt=8, new_tokens=5, precision="fp32"),
        infer("dgen-qwen2-derived-static-bf16", QWEN2, impl="derived",
              tags=("derived", "generate"), batch=1, prompt=12, new_tokens=6, precision="bf16",
              cache="static"),
        # left-padded prompts, their attention mask passed (the hand graphs leave it out):
        # the mask grows each step and each forward builds a 4-D one
        infer("dgen-llama-padded-fp32", LLAMA, impl="hf", tags=("derived", "generate"),
              batch=3, prompt=12, new_tokens=5, precision="fp32", padding="left"),
        infer("dgen-qwen2-padded-static-bf16", QWEN2, impl="hf", tags=("derived", "generate"),
              batch=2, prompt=10, new_tokens=4, precision="bf16", cache="static",
              padding="left"),
        infer("dgen-llama-padded-prefill-bf16", LLAMA, impl="hf", tags=("derived", "generate"),
              batch=2, prompt=12, context=20, precision="bf16", padding="left"),
        _case("gemma2", "padded-cross-bf16", _gen("gemma2", 2, 12, 8, "bf16", padding="left")),
        _case("phi3", "padded-long-fp32", _gen("phi3", 2, 10, 30, "fp32", padding="left")),
        _case("mixtral", "padded-bf16", _gen("mixtral", 3, 8, 4, "bf16", padding="left")),
        _case("deepseek_v2", "padded-fp32", _gen("deepseek_v2", 2, 8, 4, "fp32",
                                                 padding="left")),
        # a config.json with "use_cache": false (OLMo-2-Instruct's): generate asked for a cache,
        # as a checkpoint's generation_config.json does; padded, static, cut at 28 new tokens
        _case("olmo2", "config-no-cache-padded-static-fp32",
              _gen("olmo2", 2, 30, 28, "fp32", cache="static", padding="left"), use_cache=False),
    ]  # fmt: skip
