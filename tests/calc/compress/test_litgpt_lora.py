"""LitGPT's LoRA fine-tuning (`calc.compress.litgpt_lora`) by hand: the adapters' shapes and
order, what the fused qkv's adapter keeps for the backward, the head's chunks in fp32, QLoRA's
NF4 linears, StableEmbedding and paged states, what it refuses. The whole step is checked
against the CPU tracker by the ``lit-lora-*`` and ``lit-qlora-*`` verify cases (litgpt
0.5.12's code copied in verify/models/litgpt_lora.py and compared with the library, through
Fabric's wrapper, in tests/verify/models/test_litgpt_lora.py)."""

from __future__ import annotations

import pytest
import sympy as sp

import calc
from calc.compress import litgpt_lora
from calc.estimate.core import values_for
from calc.models import litgpt, litgpt_arch
from calc.replay import ops
from calc.replay.kinds import StorageKind
from calc.replay.tape import Tape
from calc.step.training import replay_training, shape_for
from tests.calc.models.test_litgpt import TINYLLAMA
from tests.calc.models.test_litgpt_arch import FALCON_7B, GEMMA_2B, GEMMA_7B, PHI2, STABLELM_3B
from tests.specs import tiny_llama

NF4 = calc.Quant(method="nf4", double_quant=False, keep_16bit=("embed", "norm"))
"""``--quantize bnb.nf4``: every Linear, the head too."""
PAGED = {"optimizer": "adam32bit", "paged_optimizer": True}
"""bitsandbytes' ``PagedAdamW``, which ``finetune/lora.py`` takes under ``--quantize``."""
# tiny_llama: hidden 16, 2 heads of 8, ffn 24, vocab 50; one key/value head here
MODEL = tiny_llama(n_kv_heads=1)
JOB = {"micro_batch": 2, "seq_len": 8, "precision": "bf16", "implementation": "litgpt",
       "loop": "hold-output", "loss": "chunked-ce"}  # fmt: skip


def _job(**kw: object) -> calc.Training:
    lora = kw.pop("lora", calc.LoRA(rank=4, modules=("q", "v")))
    return calc.Training(**{**JOB, "lora": lora, **kw})  # type: ignore[arg-type]


def _value(x: object, job: calc.Training) -> int:
    return int(sp.sympify(x).xreplace(values_for(MODEL, job)))


def _adapted(job: calc.Training, device: str = "cpu"):
    sh = shape_for(MODEL, job, device, 2)
    tape = Tape()
    w = litgpt.Weights(tape, sh)
    assert job.lora is not None
    params, shapes = litgpt_lora.adapt(tape, sh, w, job.lora, job.micro_batch == 1, job.quant)
    return tape, sh, w, params, shapes


def test_adapters_in_litgpt_parameter_order_and_shapes() -> None:
    # LoRAQKVLinear: lora_A (r * sum(enable_lora), in) = (4 * 2, 16), lora_B
    # (sum(qkv_shapes), r) = (2 * 8 for q + 1 * 8 for v, 4); LoRALinear on attn.proj (16 x 16)
    # and the MLP (fc_1, fc_2: 24 x 16; proj: 16 x 24): A (r, in), B (out, r); per block, in
    # registration order
    job = _job(lora=calc.LoRA(rank=4, modules=("q", "v", "o", "gate", "up", "down")))
    _, _, _, params, shapes = _adapted(job)
    names = [p.name for p in params]
    per_block = ["qkv.lora_A", "qkv.lora_B", "o.lora_A", "o.lora_B", "gate.lora_A",
                 "gate.lora_B", "up.lora_A", "up.lora_B", "down.lora_A", "down.lora_B"]  # fmt: skip
    assert names == per_block * 2
    got = [tuple(_value(n, job) for n in shape) for shape in shapes[:10]]
    assert got == [(8, 16), (24, 4), (4, 16), (16, 4), (4, 16), (24, 4), (4, 16), (24, 4),
                   (4, 24), (16, 4)]  # fmt: skip


def test_the_base_is_frozen() -> None:
    tape, _, w, params, _ = _adapted(_job())
    assert not any(p.leaf for p in w.parameters())
    assert {id(p.storage) for p in params} == set(tape.leaves)


@pytest.mark.parametrize(("device", "index_bytes"), [("cpu", 0), ("cuda", 2 * 512)])
def test_the_padded_qkv_index_is_a_cuda_buffer(device: str, index_bytes: int) -> None:
    # q and v adapted (not k): zero_pad's lora_ind, 24 int64 (192 B -> one block) per block,
    # made by torch.tensor in the first forward: on the GPU, not seen by the CPU tracker
    tape, *_ = _adapted(_job(), device)
    buffers = [st for st in tape.live.values() if st.kind == StorageKind.BUFFER]
    assert sum(_value(st.size, _job()) for st in buffers) == index_bytes


def test_zero_pad_keeps_the_conv1d_output_for_the_backward() -> None:
    # IndexCopyBackward0 saves the source (derivatives.yaml reads source.dim()): after the
    # forward of one adapted qkv on x [2 x 8, 16] bf16, what stays is the frozen output's sum
    # ([16, 32]: 1,024 B), A's input (x itself), A's output after_A ([16, 8]: 256 B -> 512)
    # kept by conv1d, and the conv1d output [2, 24, 8] (768 B -> 1,024) kept by index_copy_
    job = _job()
    tape, sh, w, _, _ = _adapted(job)
    x = tape.existing(sh.b * sh.s * sh.h, 2, "x", StorageKind.ACT, leaf=True)
    base = sum(_value(st.size, job) for st in tape.live.values())
    out = ops.linear(tape, x, w.layers[0]["qkv"], None, sh.b * sh.s, 32, "qkv")
    live = sum(_value(st.size, job) for st in tape.live.values()) - base
    assert live == 1024 + 512 + 1024
    assert _value(out.numel, job) == 16 * 32


def test_all_three_adapted_need_no_padding() -> None:
    # q, k and v: zero_pad returns the update itself; the conv1d output is a temporary of
    # the scaling's product, so only the sum and after_A stay
    job = _job(lora=calc.LoRA(rank=4, modules=("q", "k", "v")))
    tape, sh, w, _, _ = _adapted(job)
    x = tape.existing(sh.b * sh.s * sh.h, 2, "x", StorageKind.ACT, leaf=True)
    base = sum(_value(st.size, job) for st in tape.live.values())
    ops.linear(tape, x, w.layers[0]["qkv"], None, sh.b * sh.s, 32, "qkv")
    assert sum(_value(st.size, job) for st in tape.live.values()) - base == 1024 + 512


def test_the_loop_holds_the_chunks_in_fp32() -> None:
    # 2 x 8 tokens: one head chunk [2, 8, 50], cast to fp32 by Fabric's wrapper (3,200 B ->
    # 3,584), its last position sliced off (a view)
    job = _job()
    tape, sh, w, _, _ = _adapted(job)
    cos, sin = litgpt.buffers(tape, sh, 64, converted=False)
    ids = tape.existing(sh.b * sh.s, 8, "input_ids", "input")
    held: list = []
    regime = litgpt.Regime.of(2, 8, 64, head_chunks=True)
    litgpt_lora.loss_step(tape, sh, w, cos, sin, ids, held, regime)
    chunk, loss = held
    assert chunk.itemsize == 4 and _value(chunk.storage.size, job) == 3584
    assert _value(chunk.numel, job) == 2 * 7 * 50  # the slice [..., :-1, :]
    assert loss.itemsize == 4


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"quant": calc.Quant(method="int8"), **PAGED}, NotImplementedError, "bnb.nf4"),
        ({"quant": calc.Quant(method="nf4"), **PAGED}, ValueError, "lm_head included"),
        ({"quant": NF4}, ValueError, "PagedAdamW"),
        ({"quant": NF4, "optimizer": "adam8bit", "paged_optimizer": True}, ValueError, "adam32bit"),
        ({"lora": calc.LoRA(rank=4, modules=("q", "gate"))}, ValueError, "all or none"),
        ({"lora": calc.LoRA(rank=4, adapter_dtype="fp32")}, NotImplementedError, "adapter_dtype"),
        ({"optimizer": "adam8bit"}, NotImplementedError, "PagedAdamW"),
    ],
)
def test_refuses_what_it_does_not_model(change: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        calc.estimate(tiny_llama(max_positions=256), _job(**change), device="cpu")


def test_a_longer_sequence_needs_more_and_shares_the_structure_beyond_two_chunks() -> None:
    # 3 and 5 head chunks walk the same pieces (two or more whole chunks before the last)
    model = tiny_llama(max_positions=1024)
    small = calc.estimate(model, _job(seq_len=300), device="cpu")
    large = calc.estimate(model, _job(seq_len=600), device="cpu")
    assert large.peak_bytes > small.peak_bytes


@pytest.mark.parametrize(
    ("card", "micro_batch", "published_gb"),
    [("llama-3.1-8b", 1, 19.73), ("llama-2-7b", 2, 19.77), ("mistral-7b-v0.1", 2, 20.66)],
)
def test_litgpts_published_lora_peaks(card: str, micro_batch: int, published_gb: float) -> None:
    # LitGPT's config hub (Lightning-AI/litgpt, config_hub/finetune/README.md, "Peak memory",
    # torch.cuda.max_memory_allocated() in GB on one A10G): llama-3.1-8b/lora.yaml,
    # llama-2-7b/lora.yaml and mistral-7b/lora.yaml, bf16-true, max_seq_length 512, lora_r 32,
    # lora_alpha 16, lora_dropout 0.05, lora_query and lora_value, the micro-batch of each row
    # and global_batch_size 8 (the rest accumulated)
    job = _job(micro_batch=micro_batch, seq_len=512, grad_accum=8 // micro_batch,
               lora=calc.LoRA(rank=32, alpha=16, modules=("q", "v"), dropout=0.05))  # fmt: skip
    est = calc.estimate(calc.load_card(card), job)
    assert est.peak_bytes / 1e9 == pytest.approx(published_gb, rel=0.01)


def test_qlora_stores_every_linear_in_nf4_and_adds_a_stable_embedding() -> None:
    # bitsandbytes' Params4bit, blocks of 64, no double quantization: packed values (2 a
    # byte), one fp32 absmax per block and a 16-entry fp32 code per linear. Per block: qkv
    # (2 + 2 * 1) * 8 x 16 = 512 weights, proj 16 x 16 = 256, fc_1, fc_2 and proj 24 x 16 =
    # 384 each; the head 50 x 16 = 800
    job = _job(quant=NF4, **PAGED)
    tape, _, w, params, _ = _adapted(job)
    numels = {"qkv": 512, "o": 256, "gate": 384, "up": 384, "down": 384}
    for lw in w.layers:
        for key, n in numels.items():
            values = lw[key]
            assert values.itemsize == 1 and _value(values.numel, job) == n // 2
            assert id(values.storage) in tape.quantized
    head = tape.quantized[id(w.head.storage)]
    assert [(_value(t.numel, job), t.itemsize) for t in head.stored] == [
        (400, 1),
        (16, 4),
        (800 // 64, 4),
    ]
    # StableEmbedding: a 50 x 16 table and a LayerNorm of 16, bf16, trainable leaves the
    # optimizer does not hold (finetune/lora.py builds them after it)
    assert w.stable is not None
    assert [(_value(t.numel, job), t.itemsize, t.leaf) for t in w.stable] == [
        (800, 2, True), (16, 2, True), (16, 2, True)]  # fmt: skip
    assert all(id(t.storage) in tape.unstepped for t in w.stable)
    assert not any(t is s for t in params for s in w.stable)


def test_qlora_stable_embedding_gradient_outlives_zero_grad() -> None:
    # optimizer.zero_grad() sets the adapters' gradients to None; the StableEmbedding's
    # (outside the optimizer) stay and sum over the steps: after two steps its table's
    # gradient is alive, one 50 x 16 bf16 tensor (1,600 bytes: four 512-byte blocks)
    job = _job(quant=NF4, **PAGED)
    events = replay_training(MODEL, job, "cpu", 2)
    last = events[-1]
    grads = {key[1]: count for key, count in last.live if key[0] == StorageKind.GRAD}
    assert grads.get("grad:wte.stable") == 1
    assert not any(name.startswith("grad:") and "lora" in name for name in grads)
    size = next(key[3] for key, _ in last.live if key[1] == "grad:wte.stable")
    assert _value(size, job) == 2048


def test_qlora_pages_the_states_of_litgpts_fused_adapters() -> None:
    # Llama-2-7B, r 32 on q and v: per block LoRAQKVLinear's lora_A [2 x 32, 4096] and lora_B
    # [4096 + 4096, 32], 262,144 elements each, at least PagedAdamW's 100,000: both fp32
    # states of all 64 adapters in managed memory, 32 x 2 x 262,144 x 2 x 4 bytes
    model = calc.load_card("llama-2-7b")
    lora = calc.LoRA(rank=32, alpha=16, modules=("q", "v"), dropout=0.05)
    est = calc.estimate(model, _job(micro_batch=2, seq_len=512, lora=lora, quant=NF4, **PAGED))
    assert est.paged_state_bytes == 32 * 2 * 262_144 * 2 * 4


def test_lora_head_adapters_come_first_in_parameter_order() -> None:
    # lora_head: GPT registers lm_head before the blocks and LoRALinear its lora_A [r, h] and
    # lora_B [V, r] before its linear, so they lead parameters(): (4, 16) and (50, 4)
    job = _job(lora=calc.LoRA(rank=4, modules=("q", "lm_head")))
    _, _, w, params, shapes = _adapted(job)
    assert [p.name for p in params[:3]] == ["lm_head.lora_A", "lm_head.lora_B", "qkv.lora_A"]
    assert [tuple(_value(n, job) for n in s) for s in shapes[:2]] == [(4, 16), (50, 4)]
    assert w.head_lora is not None and w.head_lora[2] == 4


def test_an_adapter_on_the_head_is_litgpts_alone() -> None:
    lora = calc.LoRA(rank=4, modules=("q", "lm_head"))
    job = calc.Training(micro_batch=2, seq_len=8, implementation="hf", lora=lora)
    with pytest.raises(NotImplementedError, match="lora_head"):
        calc.estimate(MODEL, job, device="cpu")


def test_litgpts_published_lora_head_peak() -> None:
    # LitGPT's config hub (config_hub/finetune/README.md, one A10G): tiny-llama/lora.yaml,
    # bf16-true, 8 x 512 tokens (global batch 8), r 32, alpha 16, dropout 0.05, every
    # linear and the head adapted (lora_head): 13.50 GB
    model = calc.ModelSpec.from_hf_config(TINYLLAMA, name="tiny-llama")
    modules = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
    lora = calc.LoRA(rank=32, alpha=16, modules=modules, dropout=0.05)
    est = calc.estimate(model, _job(micro_batch=8, seq_len=512, lora=lora))
    assert est.peak_bytes / 1e9 == pytest.approx(13.50, rel=0.01)


ALL_AND_HEAD = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


@pytest.mark.parametrize(
    ("config", "micro_batch", "lora", "published_gb"),
    [
        (PHI2, 4, calc.LoRA(rank=8, alpha=16, dropout=0.05, modules=ALL_AND_HEAD), 13.98),
        (STABLELM_3B, 1, calc.LoRA(rank=32, alpha=16, dropout=0.05, modules=("q", "v")), 8.58),
        (FALCON_7B, 1, calc.LoRA(rank=32, alpha=16, dropout=0.05, modules=("q", "v")), 16.69),
    ],
    ids=["phi-2", "stablelm-base-alpha-3b", "falcon-7b"],
)
def test_litgpts_published_parallel_residual_lora_peaks(
    config: dict, micro_batch: int, lora: calc.LoRA, published_gb: float
) -> None:
    # LitGPT's config hub (config_hub/finetune/README.md, one A10G, bf16-true, 512 tokens,
    # global batch 8): phi-2/lora.yaml (4 sequences, r 8, every linear and the head: 13.98 GB),
    # stablelm-base-alpha-3b/lora.yaml and falcon-7b/lora.yaml (one sequence, r 32 on q and
    # v: 8.58 and 16.69 GB)
    model = calc.ModelSpec.from_hf_config(config)
    job = _job(micro_batch=micro_batch, seq_len=512, grad_accum=8 // micro_batch, lora=lora)
    assert calc.estimate(model, job).peak_bytes / 1e9 == pytest.approx(published_gb, rel=0.01)


def test_qlora_keeps_the_biases_in_16_bits() -> None:
    # bitsandbytes' Linear4bit quantizes the weight and keeps the bias in the compute dtype:
    # phi-2's qkv weight packed two to a byte, its bias bf16 and frozen
    model = litgpt_arch.as_built(calc.ModelSpec.from_hf_config(PHI2))
    job = _job(micro_batch=1, seq_len=64, quant=NF4, **PAGED)
    sh = shape_for(model, job, "cpu", 1)
    tape = Tape()
    w = litgpt.Weights(tape, sh, litgpt_arch.arch_of(model))
    assert job.lora is not None
    litgpt_lora.adapt(tape, sh, w, job.lora, False, job.quant)
    qkv, bias = w.layers[0]["qkv"], w.layers[0]["qkv_b"]
    assert qkv is not None and bias is not None
    assert qkv.itemsize == 1 and id(qkv.storage) in tape.quantized
    assert bias.itemsize == 2 and id(bias.storage) not in tape.quantized and not bias.leaf


@pytest.mark.parametrize(
    ("config", "micro_batch", "rank", "qlora", "published_gb", "rel"),
    [
        (GEMMA_2B, 2, 8, False, 12.62, 0.01),
        (GEMMA_7B, 1, 16, True, 17.18, 0.01),
        (GEMMA_2B, 2, 16, True, 11.58, 0.05),
    ],
    ids=["gemma-2b-lora", "gemma-7b-qlora", "gemma-2b-qlora"],
)
def test_litgpts_published_gemma_peaks(
    config: dict, micro_batch: int, rank: int, qlora: bool, published_gb: float, rel: float
) -> None:
    # LitGPT's config hub (one A10G, bf16-true, 512 tokens, global batch 6): gemma-2b/lora.yaml
    # (2 sequences, r 8: 12.62 GB), gemma-7b/qlora.yaml (one, r 16: 17.18 GB) and
    # gemma-2b/qlora.yaml (2, r 16: 11.58 GB; calc 3.4 % below); alpha 16, dropout 0.1, every
    # linear and the head
    lora = calc.LoRA(rank=rank, alpha=16, dropout=0.1, modules=ALL_AND_HEAD)
    more = {"quant": NF4, **PAGED} if qlora else {}
    job = _job(micro_batch=micro_batch, seq_len=512, grad_accum=6 // micro_batch, lora=lora,
               **more)  # fmt: skip
    peak = calc.estimate(calc.ModelSpec.from_hf_config(config), job).peak_bytes
    assert peak / 1e9 == pytest.approx(published_gb, rel=rel)


def test_gemma_7b_lora_does_not_fit_an_a10g() -> None:
    # the config hub's gemma-7b/lora.yaml is published as out of memory on one A10G (24 GB):
    # calc needs more than the card has
    lora = calc.LoRA(rank=8, alpha=16, dropout=0.1, modules=ALL_AND_HEAD)
    job = _job(micro_batch=1, seq_len=512, grad_accum=6, lora=lora)
    assert calc.estimate(calc.ModelSpec.from_hf_config(GEMMA_7B), job).peak_bytes > 24e9


def test_gemma_7b_lora_on_an_a100() -> None:
    # the README of litgpt #1205 (2024-03-27): gemma-7b/lora.yaml as it was then (r 16, alpha
    # 16, dropout 0.1, every linear and the head, one sequence, global batch 6) on one A100:
    # 25.30 GB
    lora = calc.LoRA(rank=16, alpha=16, dropout=0.1, modules=ALL_AND_HEAD)
    job = _job(micro_batch=1, seq_len=512, grad_accum=6, lora=lora)
    peak = calc.estimate(calc.ModelSpec.from_hf_config(GEMMA_7B), job).peak_bytes
    assert peak / 1e9 == pytest.approx(25.30, rel=0.01)


def test_partial_qkv_adapters_where_heads_outgrow_n_embd_fail_in_litgpt() -> None:
    # LoRAQKVLinear.lora_ind counts the padded columns from n_embd (litgpt/lora.py 265-282):
    # Gemma-7B's 16 x 256 query columns against n_embd 3072 make index_copy_ fail
    job = _job(micro_batch=1, seq_len=64, lora=calc.LoRA(rank=8, modules=("q", "v")))
    with pytest.raises(ValueError, match="lora_ind"):
        calc.estimate(calc.ModelSpec.from_hf_config(GEMMA_7B), job)


LLAMA32_1B = {
    "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}  # fmt: skip
"""meta-llama/Llama-3.2-1B in Llama's config keys with the values of LitGPT's
``Llama-3.2-1B`` entry (litgpt/config.py as of litgpt #1750: 16 layers, n_embd 2048, 32 heads,
8 query groups, intermediate 8192, padded vocab 128256, block size 8192); fine-tuned untied."""
LLAMA32_3B = {**LLAMA32_1B, "hidden_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 24}  # fmt: skip
"""Llama-3.2-3B as LitGPT's entry: 28 layers, n_embd 3072, 24 heads of 128."""


@pytest.mark.parametrize(
    ("config", "published_gb"), [(LLAMA32_1B, 4.49), (LLAMA32_3B, 9.67)], ids=["1b", "3b"]
)
def test_litgpts_published_llama32_lora_peaks(config: dict, published_gb: float) -> None:
    # config_hub/finetune/README.md as of litgpt #1750 (2024-09-27), one A10G:
    # llama-3.2-1b/lora.yaml and llama-3.2-3b/lora.yaml, bf16-true, one sequence of 512 tokens
    # (global batch 8), r 32, alpha 16, dropout 0.05, q and v
    model = calc.ModelSpec.from_hf_config(config)
    lora = calc.LoRA(rank=32, alpha=16, modules=("q", "v"), dropout=0.05)
    est = calc.estimate(model, _job(micro_batch=1, seq_len=512, grad_accum=8, lora=lora))
    assert est.peak_bytes / 1e9 == pytest.approx(published_gb, rel=0.01)
