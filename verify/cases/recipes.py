"""Cases of the implementations users run (`calc.Training`'s ``implementation``): torchtune's
Llama (``tt-*``, a faithful copy of its model code, `verify.models.torchtune_llama`) in fp32 and
pure bf16, with its recipe's losses, layer recomputation and optimizer in backward; torchtitan's
Llama 3 (``ttn-*``, `verify.models.torchtitan_llama`) in fp32 with its trainer's loss step (its
bf16 runs are FSDP2's policy: verify/cases/distributed.py); on the CPU tracker."""

from __future__ import annotations

import json
from typing import Any

from calc.config.compression import DECODER_LORA_MODULES, LoRA, Quant
from verify.cases.case import (
    LLAMA,
    LLAMA3,
    MISTRAL,
    QWEN2,
    TOLERANCE_PCT,
    Case,
    Q,
    pairs,
    training_job,
)
from verify.cases.case import train as _train

QWEN3_8B = "qwen3-8b"
"""Qwen3-8B: its heads span ``n_embd`` (32 x 128 = 4,096), as litgpt's LoRA on part of the
fused qkv needs (``lora_ind``, `calc.compress.litgpt_lora.check`)."""

PHI4 = "phi-4"
"""Phi3ForCausalLM, a derived type litgpt builds as its Llama (`calc.models.litgpt_arch.as_built`)."""

TT = {"impl": "torchtune", "loop": "del-logits"}
BF16 = {"precision": "bf16"}
CHUNKED = {"loss": "chunked-ce"}
GQA2 = {"scale": {"kv_heads": 2}}
"""Two kv heads: grouped k/v expanded by copies (one kv head is expanded by views)."""

PAGED8 = {"optimizer": "adam8bit", "paged_optimizer": True}
SCRATCH = (
    "CPU runs verify.models.optimizers' BlockwiseAdam8bit, whose chunked update holds up to "
    "EMULATION_SCRATCH_BYTES of temporaries bitsandbytes' CUDA kernel does not (-0.52 % here, "
    "at the optimizer step)"
)
TT_LORA = LoRA(rank=8, modules=("q", "v", "o", "gate", "down", "up"))
"""torchtune's Llama-3.1-8B LoRA configs: ``lora_attn_modules: [q_proj, v_proj, output_proj]``,
``apply_lora_to_mlp: True``, ``lora_rank: 8``."""
OFFLOAD = {"offload_activations": True, "recompute": "full", "seq_len": 128}
"""torchtune's activation offloading with the layer checkpointing it requires."""
WIDE = {"hidden": 256, "ffn": 768, "vocab": 1024}
"""Weights of 100,000 elements or more: a paged optimizer pages their states."""

NF4 = Quant(method="nf4")
NF4_SCALE = {"kv_heads": 2, "head_dim": 32}
"""Every decoder weight a multiple of 16,384 elements, as torchao's ``to_nf4`` needs (blocks of
64, scaler blocks of 256): hidden 256, k/v 64 x 256, ffn 896."""

TORCHTUNE: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("tt-fp32-llama", LLAMA, {}),
    ("tt-bf16-llama3", LLAMA3, BF16),
    ("tt-bf16-chunked-llama3", LLAMA3, {**BF16, **CHUNKED}),
    ("tt-bf16-chunked-b1-mistral", MISTRAL, {**BF16, **CHUNKED, "micro_batch": 1,
                                             "loss_chunks": 4}),
    ("tt-bf16-gqa2-llama3", LLAMA3, {**BF16, **GQA2}),
    ("tt-fp32-gqa2-chunked-llama3", LLAMA3, {**CHUNKED, **GQA2, "loss_chunks": 2,
                                             "micro_batch": 3}),
    ("tt-bf16-opt-in-bwd-recompute-chunked-llama3", LLAMA3, {**BF16, **CHUNKED,
                                                              "optimizer_in_backward": True,
                                                              "recompute": "full"}),
    ("tt-fp32-recompute-llama3", LLAMA3, {"recompute": "full"}),
    # the single-device full fine-tune configs (llama3_1/8B_full_single_device.yaml):
    # bitsandbytes PagedAdamW8bit, one per parameter stepped in the backward, recomputation,
    # the chunked loss; wide enough (hidden 256, ffn 768, vocab 1024) for the embedding, head
    # and MLP weights to reach the 100,000-element paging threshold
    ("tt-bf16-paged-adam8bit-opt-in-bwd-recompute-chunked-llama3", LLAMA3,
     {**BF16, **CHUNKED, **PAGED8, "optimizer_in_backward": True, "recompute": "full",
      "scale": WIDE}),
    ("tt-bf16-adam8bit-chunked-llama3", LLAMA3, {**BF16, **CHUNKED, "optimizer": "adam8bit",
                                                 "scale": WIDE, "note": SCRATCH}),
    ("tt-bf16-recompute-chunked-qwen2", QWEN2, {**BF16, **CHUNKED, "recompute": "full"}),
    # the LoRA recipes (llama3_1/8B_lora_single_device.yaml: q, v, output_proj and the MLP,
    # rank 8, layer checkpointing, the chunked loss), torchtune's LoRALinear
    ("tt-bf16-lora-recompute-chunked-llama3", LLAMA3, {**BF16, **CHUNKED, "recompute": "full",
                                                       "lora": TT_LORA}),
    ("tt-fp32-lora-gqa2-llama3", LLAMA3, {**GQA2, "lora": LoRA(rank=4)}),
    ("tt-bf16-lora-chunked-b1-qwen2", QWEN2, {**BF16, **CHUNKED, "micro_batch": 1,
                                              "lora": TT_LORA}),
    # activation offloading (enable_activation_offloading, with the checkpointing the recipes
    # require): 256 tokens per micro-batch, so that every per-token tensor offloaded is 1 KiB
    # or more; fp32 brings back layer inputs the recomputation saves again (RMSNorm's
    # x.float() is x), bf16 ones it does not
    ("tt-bf16-offload-llama3", LLAMA3, {**BF16, **OFFLOAD}),
    ("tt-fp32-offload-chunked-llama3", LLAMA3, {**OFFLOAD, **CHUNKED}),
    ("tt-bf16-offload-chunked-accum2-gqa2-qwen2", QWEN2, {**BF16, **OFFLOAD, **CHUNKED, **GQA2,
                                                         "grad_accum": 2}),
    ("tt-bf16-offload-lora-chunked-b1-llama3", LLAMA3, {**BF16, **OFFLOAD, **CHUNKED,
                                                        "micro_batch": 1, "seq_len": 256,
                                                        "lora": TT_LORA}),
    ("tt-bf16-offload-opt-in-bwd-chunked-wide-mistral", MISTRAL,
     {**BF16, **OFFLOAD, **CHUNKED, "optimizer_in_backward": True, "scale": WIDE}),
    # the QLoRA recipes (llama3_1/8B_qlora_single_device.yaml: the LoRA config with
    # quantize_base): torchao's NF4Tensor on every decoder linear, dequantized in forward and
    # again in backward by linear_nf4
    ("tt-bf16-qlora-recompute-chunked-llama3", LLAMA3, {**BF16, **CHUNKED, "recompute": "full",
                                                        "lora": TT_LORA, "quant": NF4,
                                                        "scale": NF4_SCALE, "tags": Q}),
    ("tt-bf16-qlora-all-chunked-b1-mistral", MISTRAL, {**BF16, **CHUNKED, "micro_batch": 1,
                                                       "lora": LoRA(rank=16), "quant": NF4,
                                                       "scale": {**NF4_SCALE, "vocab": 4096}}),
    ("tt-fp32-qlora-llama3", LLAMA3, {"lora": TT_LORA, "quant": NF4, "scale": NF4_SCALE}),
    ("tt-bf16-qlora-offload-chunked-llama3", LLAMA3, {**BF16, **OFFLOAD, **CHUNKED,
                                                      "micro_batch": 1, "seq_len": 256,
                                                      "lora": TT_LORA, "quant": NF4,
                                                      "scale": NF4_SCALE}),
)  # fmt: skip
"""torchtune: name, card, the job's fields (``tags``: extra tags)."""


TITAN = {"impl": "torchtitan", "loop": "del-logits"}
WIDE = {"hidden": 256, "vocab": 64}
TORCHTITAN: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("ttn-fp32-llama3", LLAMA3, {}),
    ("ttn-fp32-gqa2-llama3", LLAMA3, GQA2),
    ("ttn-fp32-recompute-llama3", LLAMA3, {"recompute": "full"}),
    ("ttn-fp32-mha-recompute-llama", LLAMA, {"recompute": "full", "micro_batch": 1}),
    ("ttn-fp32-accum2-gqa2-mistral", MISTRAL, {**GQA2, "grad_accum": 2, "seq_len": 48}),
    # one GPU: maybe_enable_amp's autocast over the fp32 model, the forward and the loss
    ("ttn-amp-bf16-llama3", LLAMA3, {"precision": "amp-bf16"}),
    (
        "ttn-amp-bf16-gqa2-recompute-llama3",
        LLAMA3,
        {"precision": "amp-bf16", "recompute": "full", **GQA2},
    ),
    ("ttn-amp-bf16-accum2-mha-llama", LLAMA, {"precision": "amp-bf16", "grad_accum": 2}),
    # op-level selective checkpointing (selective_ac_option="op"): SDPA's and every other mm's
    # outputs kept; the recomputation runs the whole block (early_stop=False), its kept outputs
    # taken from the policy's storage
    ("ttn-fp32-op-sac-llama3", LLAMA3, {"recompute": "op"}),
    ("ttn-fp32-op-sac-mha-llama", LLAMA, {"recompute": "op", "micro_batch": 1}),
    (
        "ttn-fp32-op-sac-accum2-gqa2-mistral",
        MISTRAL,
        {**GQA2, "recompute": "op", "grad_accum": 2, "seq_len": 48},
    ),
    # layer-frequency checkpointing (selective_ac_option="n"): blocks n-1, 2n-1, ... only
    (
        "ttn-fp32-recompute-every2-llama3",
        LLAMA3,
        {"recompute": "full", "recompute_every": 2, "scale": {"layers": 4}},
    ),
    (
        "ttn-fp32-recompute-every3-gqa2-mistral",
        MISTRAL,
        {"recompute": "full", "recompute_every": 3, "scale": {**GQA2["scale"], "layers": 5}},
    ),
    (
        "ttn-amp-bf16-recompute-every2-llama",
        LLAMA,
        {
            "precision": "amp-bf16",
            "recompute": "full",
            "recompute_every": 2,
            "scale": {"layers": 3},
        },
    ),
    # wide blocks, a small vocabulary: the blocks, not the logits, weigh in the backward
    ("ttn-fp32-recompute-wide-llama3", LLAMA3, {"recompute": "full", "scale": WIDE}),
    ("ttn-fp32-op-sac-wide-llama3", LLAMA3, {"recompute": "op", "scale": WIDE}),
)
"""torchtitan: name, card, the job's fields."""


LIT = {"impl": "litgpt", "loop": "hold-output", "loss": "chunked-ce"}
LITGPT: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("lit-bf16-llama3", LLAMA3, {"precision": "bf16"}),
    ("lit-fp32-mha-llama", LLAMA, {"precision": "fp32"}),
    ("lit-bf16-accum2-gqa2-mistral", MISTRAL, {**GQA2, "precision": "bf16", "grad_accum": 2}),
    # several 128-row chunks of the loss: 2 x 255 = 510 rows, 3 whole chunks and 126 rows; the
    # tables left in bf16 at the block size (256)
    ("lit-bf16-chunks-llama3", LLAMA3, {"precision": "bf16", "seq_len": 256}),
    # one sequence (views, no copies): one whole chunk and none left (128 rows), one whole
    # chunk and 71 rows
    (
        "lit-bf16-one-128rows-llama3",
        LLAMA3,
        {"precision": "bf16", "micro_batch": 1, "seq_len": 129},
    ),
    (
        "lit-fp32-one-199rows-gqa2-mistral",
        MISTRAL,
        {**GQA2, "precision": "fp32", "micro_batch": 1, "seq_len": 200},
    ),
    # a real vocabulary (Mistral's 32,000): the logits, held through backward, dominate
    (
        "lit-bf16-vocab32k-mistral",
        MISTRAL,
        {"precision": "bf16", "seq_len": 192, "scale": {"vocab": 32000}},
    ),
    # a tied checkpoint (Llama-3.2-1B's kind): fine-tuning builds a head of its own
    ("lit-bf16-tied-llama3", LLAMA3, {"precision": "bf16", "scale": {"tied_embeddings": True}}),
    # Qwen2.5 (attn_bias: the qkv's bias alone; tied, so untied here), two kv heads
    ("lit-bf16-qwen2", QWEN2, {**GQA2, "precision": "bf16", "seq_len": 130}),
    ("lit-fp32-accum2-qwen2", QWEN2, {"precision": "fp32", "grad_accum": 2}),
    # every block checkpointed (Lightning's activation_checkpointing_policy={Block}, as its
    # FSDPStrategy applies it; here on one device)
    ("lit-bf16-recompute-llama3", LLAMA3, {"precision": "bf16", "recompute": "full"}),
    # Qwen3 (norm_qk: an RMSNorm of head_size on each head of q and k; untied)
    ("lit-bf16-qwen3", QWEN3_8B, {**GQA2, "precision": "bf16", "seq_len": 130}),
    ("lit-fp32-accum2-qwen3", QWEN3_8B, {"precision": "fp32", "grad_accum": 2}),
    # Phi3ForCausalLM (a derived type) built as litgpt's Llama: Phi-4 as it is (no window);
    # with Phi-3-mini's sliding window, shorter than the sequence, its masks in every block
    ("lit-fp32-phi4", PHI4, {"precision": "fp32"}),
    (
        "lit-bf16-window-accum2-phi4",
        PHI4,
        {"precision": "bf16", "seq_len": 100, "grad_accum": 2, "scale": {"sliding_window": 64}},
    ),
)
"""LitGPT's ``finetune/full.py`` (bf16-true or 32-true): name, card, the job's fields."""


def _lit(precision: str, seq_len: int, lora: LoRA, **more: Any) -> dict[str, Any]:
    """A LitGPT LoRA job's fields: the precision, the tokens, the adapters, the rest as given."""
    return {"precision": precision, "seq_len": seq_len, "lora": lora, **more}


FAMILY_ALL_HEAD_R4 = LoRA(rank=4, alpha=8, modules=(*DECODER_LORA_MODULES, "lm_head"))
"""Every linear and the head, r 4, no dropout."""
LIT_LORA = LoRA(rank=8, alpha=16, modules=("q", "v"), dropout=0.05)
"""``finetune/lora.py``'s defaults: ``lora_r=8``, ``lora_alpha=16``, ``lora_dropout=0.05``,
``lora_query`` and ``lora_value``."""
LITGPT_LORA: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("lit-lora-bf16-llama3", LLAMA3, {"precision": "bf16", "lora": LIT_LORA}),
    # every adapter litgpt has below the head; two head chunks (128 tokens and 127 after the
    # shift), the tables left in bf16 at the block size
    (
        "lit-lora-bf16-all-chunks-llama3",
        LLAMA3,
        {
            "precision": "bf16",
            "seq_len": 256,
            "lora": LoRA(rank=4, modules=("q", "k", "v", "o", "gate", "up", "down")),
        },
    ),
    # multi-head attention: the grouped conv1d; q, k and v all adapted: no zero_pad
    (
        "lit-lora-fp32-mha-qkv-llama",
        LLAMA,
        {"precision": "fp32", "seq_len": 200, "lora": LoRA(rank=8, modules=("q", "k", "v"))},
    ),
    # one sequence (views), the projection adapted, three head chunks
    (
        "lit-lora-bf16-one-gqa2-mistral",
        MISTRAL,
        {
            **GQA2,
            "precision": "bf16",
            "micro_batch": 1,
            "seq_len": 300,
            "scale": {"max_positions": 512},
            "lora": LoRA(rank=8, modules=("q", "v", "o")),
        },
    ),
    # five head chunks (four whole ones: three of them walked together), dropout
    (
        "lit-lora-bf16-five-chunks-llama",
        LLAMA,
        {"precision": "bf16", "seq_len": 600, "scale": {"max_positions": 1024}, "lora": LIT_LORA},
    ),
    # a last chunk of two tokens (one after the shift); k alone at rank 1: one conv1d part,
    # and an adapter output one wide, whose transposed gradient reshapes as a view
    (
        "lit-lora-fp32-last2-k-rank1-gqa2-mistral",
        MISTRAL,
        {
            **GQA2,
            "precision": "fp32",
            "seq_len": 258,
            "scale": {"max_positions": 512},
            "lora": LoRA(rank=1, modules=("k",)),
        },
    ),
    # 257 tokens: two whole head chunks and one of a single token, which the shift leaves
    # empty (no loss chunk, no gradient: split_backward's zeros), two sequences
    (
        "lit-lora-bf16-last1-llama3",
        LLAMA3,
        {
            "precision": "bf16",
            "seq_len": 257,
            "scale": {"max_positions": 512},
            "lora": LoRA(rank=4, modules=("q", "v")),
        },
    ),
    # Llama 3's 128,256-token vocabulary, one sequence of 512 tokens, r 32 on q and v: the
    # config hub's llama-3.1-8b/lora.yaml at a small width, where the fp32 chunks dominate
    (
        "lit-lora-bf16-one-vocab128k-llama3",
        LLAMA3,
        {
            "precision": "bf16",
            "micro_batch": 1,
            "seq_len": 512,
            "scale": {"vocab": 128256, "max_positions": 1024},
            "lora": LoRA(rank=32, alpha=16, modules=("q", "v"), dropout=0.05),
        },
    ),
    # lora_head: LoRALinear on every head chunk (three here), dropout on its input
    (
        "lit-lora-bf16-head-llama3",
        LLAMA3,
        _lit(
            "bf16",
            300,
            LoRA(rank=8, alpha=16, modules=("q", "v", "lm_head"), dropout=0.05),
            scale={"max_positions": 512},
        ),
    ),
    # lora_head without dropout: two sequences, so each slice is copied as it folds for A;
    # a last chunk the shift empties
    (
        "lit-lora-fp32-head-nodrop-gqa2-mistral",
        MISTRAL,
        _lit(
            "fp32",
            257,
            LoRA(rank=4, modules=("v", "lm_head")),
            scale={"kv_heads": 2, "max_positions": 512},
        ),
    ),
    # lora_head without dropout on one sequence (the slices fold as views), and on one
    # chunk of two sequences (the whole of ln_f's output: a view)
    (
        "lit-lora-bf16-head-one-llama",
        LLAMA,
        _lit("bf16", 200, LoRA(rank=4, modules=("q", "lm_head")), micro_batch=1),
    ),
    (
        "lit-lora-bf16-head-short-llama3",
        LLAMA3,
        _lit("bf16", 100, LoRA(rank=4, modules=("q", "lm_head"))),
    ),
    # a real vocabulary (Mistral's 32,000), two micro-batches
    (
        "lit-lora-bf16-accum2-vocab32k-mistral",
        MISTRAL,
        {
            "precision": "bf16",
            "seq_len": 192,
            "grad_accum": 2,
            "scale": {"vocab": 32000},
            "lora": LIT_LORA,
        },
    ),
)
"""LitGPT's ``finetune/lora.py`` (the head in 128-token chunks): name, card, the job's fields."""

LIT_NF4 = Quant(method="nf4", double_quant=False, keep_16bit=("embed", "norm"))
"""``--quantize bnb.nf4``: every ``nn.Linear`` (the head too) in NF4, blocks of 64, no double
quantization (``bnb.nf4-dq`` has it)."""
LIT_QLORA = {"quant": LIT_NF4, "optimizer": "adam32bit", "paged_optimizer": True}
"""``finetune/lora.py --quantize``: the NF4 base and bitsandbytes' ``PagedAdamW`` (32-bit)."""
LITGPT_QLORA: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("lit-qlora-bf16-llama3", LLAMA3, {"precision": "bf16", "lora": LIT_LORA, **LIT_QLORA}),
    # 32-true, double quantization (bnb.nf4-dq), every adapter, a last chunk the shift empties
    (
        "lit-qlora-fp32-nf4dq-all-mistral",
        MISTRAL,
        _lit(
            "fp32",
            257,
            LoRA(rank=4, modules=DECODER_LORA_MODULES),
            **{**LIT_QLORA, "quant": Quant(method="nf4", keep_16bit=("embed", "norm"))},
            scale={"kv_heads": 2, "max_positions": 512},
        ),
    ),
    # two micro-batches: StableEmbedding's gradients sum over them and over the steps
    (
        "lit-qlora-bf16-accum2-vocab32k-mistral",
        MISTRAL,
        _lit("bf16", 192, LIT_LORA, **LIT_QLORA, grad_accum=2, scale={"vocab": 32000}),
    ),
    # five head chunks (three walked together, each dequantizing the head); hidden 512 and
    # rank 128: the qkv adapters reach 100,000 elements, so PagedAdamW pages their states
    (
        "lit-qlora-bf16-five-chunks-paged-llama",
        LLAMA,
        _lit(
            "bf16",
            600,
            LoRA(rank=128, alpha=16, modules=("q", "v"), dropout=0.05),
            **LIT_QLORA,
            scale={"max_positions": 1024, "hidden": 512, "ffn": 1024},
        ),
    ),
    # the config hub's tiny-llama/qlora.yaml at a small width: every linear and the head
    # adapted, r 32, dropout; the head NF4 under its adapter
    (
        "lit-qlora-bf16-all-head-llama",
        LLAMA,
        _lit(
            "bf16",
            256,
            LoRA(rank=32, alpha=16, dropout=0.05, modules=(*DECODER_LORA_MODULES, "lm_head")),
            **LIT_QLORA,
        ),
    ),
)
"""LitGPT's QLoRA (``finetune/lora.py --quantize bnb.nf4``): name, card, the job's fields."""
LITGPT_PHI: tuple[tuple[str, str, dict[str, Any]], ...] = (
    # Qwen2.5's qkv bias under LoRA (kept, frozen) and QLoRA (16-bit beside the NF4 weight)
    ("lit-lora-bf16-all-qwen2", QWEN2, _lit("bf16", 200, FAMILY_ALL_HEAD_R4)),
    ("lit-qlora-bf16-qwen2", QWEN2, _lit("bf16", 130, LIT_LORA, **LIT_QLORA)),
    # Qwen3's frozen head norms under LoRA (every linear and the head) and QLoRA (16-bit)
    ("lit-lora-bf16-all-qwen3", QWEN3_8B, _lit("bf16", 200, FAMILY_ALL_HEAD_R4)),
    ("lit-qlora-bf16-qwen3", QWEN3_8B, _lit("bf16", 130, LIT_LORA, **LIT_QLORA)),
    # the config hub's phi-3/lora.yaml at a small width: every linear and the head, r 8,
    # dropout, Phi-3-mini's sliding window in every block, two sequences
    (
        "lit-lora-bf16-all-head-window-phi4",
        PHI4,
        _lit(
            "bf16",
            200,
            LoRA(rank=8, alpha=16, dropout=0.05, modules=(*DECODER_LORA_MODULES, "lm_head")),
            scale={"sliding_window": 128},
        ),
    ),
    (
        "lit-qlora-bf16-window-phi4",
        PHI4,
        _lit("bf16", 130, LIT_LORA, **LIT_QLORA, scale={"sliding_window": 64}),
    ),
)
"""Phi-3 and Phi-4 under LitGPT's LoRA and QLoRA: name, card, the job's fields."""


PHI2_SMALL: dict[str, Any] = {
    "model_type": "phi", "architectures": ["PhiForCausalLM"], "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 256,
    "partial_rotary_factor": 0.4, "hidden_act": "gelu_new", "layer_norm_eps": 1e-5,
    "qk_layernorm": False, "tie_word_embeddings": False,
}  # fmt: skip
"""microsoft/phi-2's config.json at a small width: heads of 16, RoPE on ``int(0.4 * 16)`` = 6
columns of each (phi-2: 32 of 80)."""
NEOX_SMALL: dict[str, Any] = {
    "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256,
    "vocab_size": 512, "max_position_embeddings": 256, "rotary_pct": 0.25,
    "hidden_act": "gelu", "use_parallel_residual": True, "tie_word_embeddings": False,
}  # fmt: skip
"""stabilityai/stablelm-base-alpha-3b's config.json at a small width (RoPE on a quarter)."""
FALCON_SMALL: dict[str, Any] = {
    "model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512,
    "max_position_embeddings": 256, "multi_query": True, "new_decoder_architecture": False,
    "parallel_attn": True, "bias": False, "alibi": False, "tie_word_embeddings": False,
}  # fmt: skip
"""tiiuae/falcon-7b's config.json at a small width: one key/value head, no biases."""
GEMMA_SMALL: dict[str, Any] = {
    "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
    "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 256,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
}  # fmt: skip
"""google/gemma-2b's config.json at a small width: one key/value head, heads wider than
hidden / heads (as Gemma-7B's 16 x 256 against 3,072)."""


def _lit_family(name: str, config: dict[str, Any], **job: Any) -> Case:
    """A LitGPT case of a derived family (`calc.models.litgpt_arch.as_built`): ``config`` run
    as litgpt builds it, 2 sequences, the job's fields as given."""
    fields = {"micro_batch": 2, "seq_len": 64, **LIT, **job}
    impl = fields.pop("impl")
    return Case(
        name=name, card=config["model_type"], job=training_job(impl, **fields), impl=impl,
        tolerance_pct=TOLERANCE_PCT[impl], tags=("training", "implementation"),
        config=json.dumps(config, sort_keys=True), scale=pairs(None),
    )  # fmt: skip


FAMILY_ALL_HEAD = LoRA(rank=8, alpha=16, dropout=0.05, modules=(*DECODER_LORA_MODULES, "lm_head"))
"""Every linear and the head, r 8 (the config hub's phi-2 and gemma-2b LoRA recipes)."""
FAMILY_QV = LoRA(rank=8, alpha=16, dropout=0.05, modules=("q", "v"))
"""q and v (the config hub's falcon-7b and stablelm-base-alpha-3b recipes, at r 8 here)."""
LITGPT_FAMILIES: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    # phi-2: norm_1 shared, biases on the head too, RoPE on 40 % of a head; GPT-NeoX: its
    # own norm_2, RoPE on a quarter
    ("lit-bf16-phi2", PHI2_SMALL, {"precision": "bf16"}),
    ("lit-fp32-accum2-phi2", PHI2_SMALL, {"precision": "fp32", "seq_len": 100, "grad_accum": 2}),
    ("lit-bf16-chunks-neox", NEOX_SMALL, {"precision": "bf16", "seq_len": 200}),
    ("lit-fp32-one-neox", NEOX_SMALL, {"precision": "fp32", "micro_batch": 1}),
    ("lit-lora-bf16-all-head-phi2", PHI2_SMALL, _lit("bf16", 200, FAMILY_ALL_HEAD)),
    (
        "lit-lora-fp32-mlp-neox",
        NEOX_SMALL,
        _lit("fp32", 130, LoRA(rank=4, modules=("q", "v", "gate", "up", "down"))),
    ),
    # QLoRA on biased linears (bitsandbytes' Linear4bit keeps the bias in 16 bits)
    ("lit-qlora-bf16-all-head-phi2", PHI2_SMALL, _lit("bf16", 150, FAMILY_ALL_HEAD, **LIT_QLORA)),
    (
        "lit-qlora-bf16-one-neox",
        NEOX_SMALL,
        _lit("bf16", 200, FAMILY_QV, micro_batch=1, **LIT_QLORA),
    ),
    # Falcon-7B's layout: multi-query attention expanded to every head, norm_1 shared
    ("lit-bf16-accum2-falcon", FALCON_SMALL, {"precision": "bf16", "grad_accum": 2}),
    ("lit-lora-bf16-falcon", FALCON_SMALL, _lit("bf16", 200, FAMILY_QV)),
    (
        "lit-qlora-bf16-all-falcon",
        FALCON_SMALL,
        _lit(
            "bf16",
            130,
            LoRA(rank=8, alpha=16, dropout=0.05, modules=DECODER_LORA_MODULES),
            **LIT_QLORA,
        ),
    ),
    # Gemma: GemmaMLP, the embeddings scaled, RMSNorm's unit offset, an untied head
    ("lit-bf16-gemma", GEMMA_SMALL, {"precision": "bf16", "seq_len": 100}),
    ("lit-fp32-accum2-gemma", GEMMA_SMALL, {"precision": "fp32", "grad_accum": 2}),
    ("lit-lora-bf16-all-head-gemma", GEMMA_SMALL, _lit("bf16", 200, FAMILY_ALL_HEAD)),
    (
        "lit-qlora-bf16-gemma",
        GEMMA_SMALL,
        _lit(
            "bf16", 130, LoRA(rank=8, alpha=16, dropout=0.05, modules=("q", "k", "v")), **LIT_QLORA
        ),
    ),
)
"""LitGPT's other families (`calc.models.litgpt_arch`) at a small width: name, config.json,
the job's fields (2 sequences of 64 tokens unless given)."""


def litgpt_family_cases() -> list[Case]:
    """The `LITGPT_FAMILIES` cases."""
    return [_lit_family(name, config, **fields) for name, config, fields in LITGPT_FAMILIES]


def recipe_cases() -> list[Case]:
    """The `TORCHTUNE` and `TORCHTITAN` cases, tagged ``implementation``."""
    out = []
    for name, card, fields in TORCHTUNE:
        kw = dict(fields)
        tags = (*kw.pop("tags", ()), "implementation")
        out.append(_train(name, card, tags=tags, **TT, **kw))
    for name, card, fields in TORCHTITAN:
        out.append(_train(name, card, tags=("implementation",), **TITAN, **fields))
    for name, card, fields in (*LITGPT, *LITGPT_LORA, *LITGPT_QLORA, *LITGPT_PHI):
        out.append(_train(name, card, tags=("implementation",), **LIT, **fields))
    return [*out, *litgpt_family_cases()]
