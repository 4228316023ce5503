"""LitGPT's Llama (`calc.models.litgpt`): its parameter order, RoPE tables, RoPE against fp32
tables, the loss's chunk regime and what it refuses, by hand. The whole step is checked against
the CPU tracker by the ``lit-*`` verify cases (litgpt 0.5.12's model code and fine-tuning loop,
copied in verify/models/litgpt_llama.py and compared with the library in
tests/verify/models/test_litgpt_llama.py)."""

from __future__ import annotations

import pytest
import sympy as sp

import calc
from calc.estimate.core import values_for
from calc.models import litgpt, litgpt_arch
from calc.replay.kinds import StorageKind
from calc.replay.tape import Tape
from calc.step.training import shape_for
from tests.specs import tiny_llama

JOB = {"micro_batch": 2, "seq_len": 8, "precision": "bf16", "implementation": "litgpt",
       "loop": "hold-output", "loss": "chunked-ce"}  # fmt: skip


def _estimate(model: calc.ModelSpec | None = None, parallel: calc.Parallelism | None = None,
              **kw: object) -> calc.Estimate:  # fmt: skip
    job = calc.Training(**{**JOB, **kw})  # type: ignore[arg-type]
    return calc.estimate(model or tiny_llama(), job, parallel, device="cpu")


def _live(tape: Tape) -> list[int]:
    return [sum(key[3] * count for key, count in e.live) for e in tape.events]


def test_parameters_in_litgpt_registration_order() -> None:
    # GPT.__init__ registers lm_head first, then transformer.wte, the blocks (norm_1,
    # attn.qkv, attn.proj, norm_2, mlp.fc_1, fc_2, proj) and ln_f; qkv is one
    # (n_head + 2 n_query_groups) x head_size by n_embd matrix: (2 + 2 x 2) x 8 = 48 rows
    job = calc.Training(**JOB)  # type: ignore[arg-type]
    sh = shape_for(tiny_llama(n_layers=1), job, "cpu", 1)
    tape = Tape()
    w = litgpt.Weights(tape, sh)
    names = [p.name for p in w.parameters()]
    assert names == ["lm_head", "embed", "norm_1", "attn.qkv", "attn.proj", "norm_2", "fc_1",
                     "fc_2", "mlp.proj", "ln_f"]  # fmt: skip
    values = values_for(tiny_llama(n_layers=1), job)
    qkv = dict(zip(names, w.shapes(sh), strict=True))["attn.qkv"]
    assert tuple(int(sp.sympify(n).xreplace(values)) for n in qkv) == (48, 16)


@pytest.mark.parametrize(("seq_len", "precision", "buffer_bytes"),
                         [(8, "bf16", 2 * 512), (64, "bf16", 2 * 1024), (64, "fp32", 2 * 2048)])  # fmt: skip
def test_rope_tables(seq_len: int, precision: str, buffer_bytes: int) -> None:
    # The max_seq_length setter rebuilds cos and sin in fp32 at the training length when it
    # differs from block_size (64): [8, 8] x 4 B = 256 B -> 512 each. At the block size the
    # tables stay as Fabric converted them: [64, 8] in bf16 (1,024 B) or fp32 (2,048 B).
    est = _estimate(seq_len=seq_len, precision=precision)
    assert est.breakdown["buffers"] == buffer_bytes


def test_rope_against_fp32_tables_holds_three_fp32_products() -> None:
    # apply_rope on a bf16 q of 1,024 elements (2,048 B) with fp32 tables: cat((-x2, x1))
    # (2,048 B, its neg freed), x * cos and rotated * sin promoted to fp32 (4,096 B each) and
    # their sum (4,096 B) live together: 14,336 B above the base, before the cast back.
    tape = Tape()
    x = tape.existing(1024, 2, "q", StorageKind.ACT, leaf=True)
    cos = tape.existing(64, 4, "cos", StorageKind.BUFFER)
    sin = tape.existing(64, 4, "sin", StorageKind.BUFFER)
    base = sum(st.size for st in tape.live.values())
    litgpt.rope(tape, x, cos, sin, "q.rope")
    assert max(_live(tape)) - base == 2048 + 3 * 4096


@pytest.mark.parametrize(("precision", "held_bytes"), [("bf16", 3584), ("fp32", 3584)])
def test_the_loop_holds_fp32_logits_from_fabrics_wrapper(precision: str, held_bytes: int) -> None:
    # finetune/full.py calls the model through Fabric's wrapper: bf16-true's convert_output
    # casts the [2, 8, 50] logits to float32 (3,200 B -> 3,584 in 512-B blocks) and the bf16
    # ones (1,600 B) are released; 32-true hands them back as they are. Either way the loop
    # holds fp32 logits through backward.
    job = calc.Training(**{**JOB, "precision": precision})  # type: ignore[arg-type]
    sh = shape_for(tiny_llama(), job, "cpu", 1)
    tape = Tape()
    w = litgpt.Weights(tape, sh)
    cos, sin = litgpt.buffers(tape, sh, 64, converted=False)
    ids = tape.existing(sh.b * sh.s, 8, "input_ids", "input")
    held: list = []
    regime = litgpt.Regime.of(2, 8, max_positions=64)
    litgpt.loss_step(tape, sh, w, cos, sin, ids, held, regime)
    logits = held[0]
    assert logits.itemsize == 4
    assert (
        int(sp.sympify(logits.storage.size).xreplace(values_for(tiny_llama(), job))) == held_bytes
    )


@pytest.mark.parametrize(
    ("micro_batch", "seq_len", "key"),
    [
        (2, 32, (False, 0, True, False)),  # 62 rows: a last chunk only
        (1, 129, (True, 1, False, False)),  # 128 rows: one whole chunk
        (1, 200, (True, 1, True, False)),  # 199 rows: one whole, 71 left
        (2, 64, (False, 0, True, True)),  # 126 rows; at the block size (64)
        (2, 256, (False, 2, True, False)),  # 510 rows: three whole (two or more), 126 left
    ],
)
def test_loss_chunk_regime(micro_batch: int, seq_len: int, key: tuple) -> None:
    # chunked_cross_entropy on logits[..., :-1, :]: b (s - 1) rows in chunks of 128
    regime = litgpt.Regime.of(micro_batch, seq_len, max_positions=64)
    assert regime.key()[:9] == (*key, False, False, False, False, False)


@pytest.mark.parametrize(
    ("micro_batch", "seq_len", "key"),
    [
        (2, 32, (False, 0, True, False, True, False)),  # one head chunk (the last)
        (1, 256, (True, 1, True, False, True, False)),  # 128 + 128 tokens: one before it
        (2, 300, (False, 2, True, False, True, False)),  # 128 + 128 + 44: two or more
        (2, 258, (False, 2, True, False, True, True)),  # 128 + 128 + 2: one token after the shift
        (2, 257, (False, 2, False, False, True, False)),  # 128 + 128 + 1: empty after it
    ],
)
def test_head_chunk_regime(micro_batch: int, seq_len: int, key: tuple) -> None:
    # finetune/lora.py: the head on 128-token slices of the sequence, one loss chunk each;
    # the micro-batch does not change the number of chunks
    regime = litgpt.Regime.of(micro_batch, seq_len, 512, head_chunks=True)
    assert regime.key()[:9] == (*key, False, False, False)


def test_an_adapter_on_the_head_unrolls_every_chunk() -> None:
    # lora_head: each chunk runs the adapter's ops, so the regime counts the chunks before the
    # last exactly: 5 x 128 + 1 tokens -> five, where the joined walk says "two or more"
    unrolled = litgpt.Regime.of(2, 641, 1024, head_chunks=True, unrolled=True)
    assert unrolled.whole == 5 and unrolled.unrolled
    assert litgpt.Regime.of(2, 641, 1024, head_chunks=True).whole == 2


def test_more_whole_chunks_share_one_structure_and_scale() -> None:
    # 2 x 255 = 510 rows (3 whole chunks) and 2 x 383 = 766 (5): one structure. The rows' log
    # probabilities and their gradients grow with the rows: the larger job needs more.
    model = tiny_llama(max_positions=512)
    small, large = _estimate(model, seq_len=256), _estimate(model, seq_len=384)
    assert large.peak_bytes > small.peak_bytes


@pytest.mark.parametrize(
    ("change", "parallel", "words"),
    [
        ({"precision": "amp-bf16"}, None, "bf16-true"),
        ({"recompute": "selective"}, None, "checkpoints every block"),
        ({"loop": "drop-output"}, None, "loop='hold-output'"),
        ({"loss": "cross-entropy"}, None, "loss='chunked-ce'"),
        ({"optimizer": "adam32bit", "paged_optimizer": True}, None, "only with --quantize"),
        ({}, calc.Parallelism(dp=2), "one device"),
    ],
)
def test_refuses_what_is_not_modelled(
    change: dict, parallel: calc.Parallelism | None, words: str
) -> None:
    with pytest.raises(NotImplementedError, match=words):
        _estimate(parallel=parallel, **change)


def test_a_one_token_sequence_is_invalid() -> None:
    # the shifted loss needs a next token: logits[..., :-1, :] against targets[..., 1:]
    with pytest.raises(ValueError, match=r"seq_len=1 .* at least 2"):
        _estimate(seq_len=1)


def test_refuses_biases_litgpt_has_no_flag_for() -> None:
    # bias covers qkv, proj and the MLP; attn_bias the qkv alone: a proj bias without the
    # MLP's, or without the qkv's, has no litgpt configuration
    with pytest.raises(NotImplementedError, match="bias flag"):
        _estimate(tiny_llama(o_bias=True))
    with pytest.raises(NotImplementedError, match="bias flag"):
        _estimate(tiny_llama(o_bias=True, mlp_bias=True))
    # q/k norms only as Qwen3's norm_qk (a llama has none in litgpt)
    with pytest.raises(NotImplementedError, match="model_type='llama', qk_norm=True"):
        _estimate(tiny_llama(qk_norm=True))
    # a tied checkpoint is fine-tuned untied (tests/calc/models/test_litgpt_arch.py)
    assert _estimate(tiny_llama(tied_embeddings=True)).peak_bytes == _estimate().peak_bytes


def test_heads_merge_as_a_view_on_cuda_and_a_copy_on_the_cpu() -> None:
    # The CPU flash kernel lays its output out as its query (cat's contiguous copy): the
    # reshape copies [b, s, h]; CUDA's kernels return [b, s, heads, d]: a view.
    job = calc.Training(**JOB)  # type: ignore[arg-type]
    for device, copied in (("cuda", False), ("cpu", True)):
        sh = shape_for(tiny_llama(n_layers=1), job, device, 1)
        tape = Tape()
        w = litgpt.Weights(tape, sh)
        x = tape.existing(sh.b * sh.s * sh.h, 2, "x", StorageKind.ACT, leaf=True)
        cos = tape.existing(sh.s * sh.d, 4, "cos", StorageKind.BUFFER)
        sin = tape.existing(sh.s * sh.d, 4, "sin", StorageKind.BUFFER)
        litgpt.attention(tape, sh, x, w.layers[0], cos, sin)
        assert ("+attn.merge" in {e.label for e in tape.events}) is copied


def _masks(device: str, seq_len: int) -> tuple[list[str], list[tuple[str, int]]]:
    job = calc.Training(**{**JOB, "seq_len": seq_len})  # type: ignore[arg-type]
    model = tiny_llama(n_layers=1, sliding_window=4)
    sh = shape_for(model, job, device, 1)
    tape = Tape()
    w = litgpt.Weights(tape, sh)
    x = tape.existing(sh.b * sh.s * sh.h, 2, "x", StorageKind.ACT, leaf=True)
    cos = tape.existing(sh.s * sh.d, 4, "cos", StorageKind.BUFFER)
    sin = tape.existing(sh.s * sh.d, 4, "sin", StorageKind.BUFFER)
    litgpt.attention(tape, sh, x, w.layers[0], cos, sin, litgpt.Regime.of_job(job, model))
    labels = [e.label for e in tape.events if "mask" in e.label]
    values = values_for(model, job)
    kept = [(key[1], int(sp.sympify(key[3]).xreplace(values)))
            for key, _ in tape.events[-1].live if "mask" in key[1]]  # fmt: skip
    return labels, kept


def test_a_sliding_window_builds_a_mask_in_every_block() -> None:
    # litgpt/model.py lines 481-503: ones(T, T) in q's dtype, its triu (the ones freed), a bool
    # temporary for masked_fill_, then full((T, T), -inf), which replaces the causal mask; the
    # CPU's flash kernel saves it: 8 x 8 bf16 = 128 bytes, one 512-byte block
    labels, kept = _masks("cpu", 8)
    assert labels == ["+attn.mask.ones", "+attn.mask.causal", "-attn.mask.ones",
                      "+attn.mask.bool", "-attn.mask.bool", "+attn.mask", "-attn.mask.causal"]  # fmt: skip
    assert kept == [("attn.mask", 512)]


@pytest.mark.parametrize(
    ("seq_len", "kept"), [(8, ("attn.mask.padded", 1024)), (16, ("attn.mask", 512))]
)
def test_cuda_pads_the_expanded_mask_to_a_multiple_of_16(seq_len: int, kept: tuple) -> None:
    # a mask rules flash out: memory-efficient attention's preprocess_mask expands it to
    # [b, nh, T, T] and pads T = 8 to 16 (attention.cpp pad_bias): 2 x 2 x 8 x 16 bf16 = 1,024
    # bytes saved, the unpadded mask freed as the method returns; T = 16 needs no padding
    assert _masks("cuda", seq_len)[1] == [kept]


def test_the_sliding_window_and_its_padding_are_part_of_the_regime() -> None:
    assert litgpt.Regime.of(2, 200, 4096, sliding=True).key()[7:9] == (True, True)  # 200 % 16
    assert litgpt.Regime.of(2, 512, 4096, sliding=True).key()[7:9] == (True, False)
    assert litgpt.Regime.of(2, 200, 4096).key()[7:9] == (False, False)


PHI3_MINI = {
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"],
    "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000,
    "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.2",
    "use_cache": True, "attention_bias": False, "vocab_size": 32064,
}  # fmt: skip
"""microsoft/Phi-3-mini-4k-instruct's config.json (transformers 4.40.2; as copied in NVIDIA
TensorRT-LLM's tests/unittest/_torch/modeling/test_modeling_phi3.py); LitGPT's
``Phi-3-mini-4k-instruct``."""


def test_phi3_is_built_as_litgpts_llama() -> None:
    # litgpt's config.py: Phi-3-mini-4k-instruct is LLaMAMLP, RMSNorm, no bias, rotary 1.0,
    # sliding_window_size 2048; the sizes are the config's
    model = litgpt_arch.as_built(calc.ModelSpec.from_hf_config(PHI3_MINI))
    assert (model.model_type, model.derived) == ("llama", False)
    assert (model.hidden, model.n_layers, model.n_heads, model.n_kv_heads, model.head_dim,
            model.ffn, model.vocab) == (3072, 32, 32, 32, 96, 8192, 32064)  # fmt: skip
    assert model.sliding_window is not None and not model.tied_embeddings
    partial = calc.ModelSpec.from_hf_config({**PHI3_MINI, "partial_rotary_factor": 0.75})
    with pytest.raises(NotImplementedError, match=r"partial_rotary_factor=0\.75"):
        litgpt_arch.as_built(partial)


def test_litgpts_published_phi3_lora_peak() -> None:
    # LitGPT's config hub (config_hub/finetune/README.md, one A10G): phi-3/lora.yaml,
    # Phi-3-mini-4k-instruct, bf16-true, 4 x 512 tokens (global batch 8: two accumulated),
    # r 8, alpha 16, dropout 0.05, every linear and the head adapted: 19.75 GB
    model = calc.ModelSpec.from_hf_config(PHI3_MINI)
    modules = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
    lora = calc.LoRA(rank=8, alpha=16, modules=modules, dropout=0.05)
    job = calc.Training(**{**JOB, "micro_batch": 4, "seq_len": 512, "grad_accum": 2, "lora": lora})  # type: ignore[arg-type]
    assert calc.estimate(model, job).peak_bytes / 1e9 == pytest.approx(19.75, rel=0.01)


def test_a_derived_model_refuses_another_librarys_model_code() -> None:
    model = calc.ModelSpec.from_hf_config(PHI3_MINI)
    job = calc.Training(micro_batch=1, seq_len=8, implementation="torchtune")
    with pytest.raises(NotImplementedError, match="implementation='torchtune'"):
        calc.estimate(model, job, device="cpu")


TINYLLAMA = {
    "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 5632,
    "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
"""TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T's config.json (LitGPT's ``tiny-llama``)."""


def test_litgpts_published_full_fine_tuning_peak() -> None:
    # LitGPT's config hub (Lightning-AI/litgpt, config_hub/finetune/README.md, "Peak memory",
    # torch.cuda.max_memory_allocated() on one A10G): tiny-llama/full.yaml, bf16-true,
    # max_seq_length 512, micro_batch_size 4, global_batch_size 32 (8 accumulated
    # micro-batches: the gradients live through the next ones' backward), AdamW: 14.10 GB
    model = calc.ModelSpec.from_hf_config(TINYLLAMA, name="tiny-llama")
    job = calc.Training(**{**JOB, "micro_batch": 4, "seq_len": 512, "grad_accum": 8})  # type: ignore[arg-type]
    assert calc.estimate(model, job).peak_bytes / 1e9 == pytest.approx(14.10, rel=0.03)


def test_qwen3_adds_a_head_norm_on_q_and_on_k_after_proj() -> None:
    # litgpt's Qwen3 configurations: norm_qk (norm_qk_type "default"), an RMSNorm of
    # head_size registered after attn.proj for q and for k
    job = calc.Training(**JOB)  # type: ignore[arg-type]
    sh = shape_for(tiny_llama(model_type="qwen3", qk_norm=True), job, "cpu", 1)
    w = litgpt.Weights(Tape(), sh)
    names = [p.name for p in w.parameters()]
    assert names[2:6] == ["norm_1", "attn.qkv", "attn.proj", "attn.norm_q"]
    assert names[6] == "attn.norm_k"
    values = values_for(tiny_llama(model_type="qwen3", qk_norm=True), job)
    assert sp.sympify(w.layers[0]["k_norm"].numel).xreplace(values) == 8  # head_dim


def test_qwen3_head_norms_save_what_litgpts_rmsnorm_saves() -> None:
    # The same tiny model with and without norm_qk (qwen3 and llama: no biases either), bf16,
    # one sequence of 8 tokens, 2 heads of 8 for q and for k, 2 layers. Each head norm saves
    # for the backward x.float() (16 rows x 8, fp32: 512 B), rsqrt's [16] (fp32: 512), x_normed
    # (512) and weight.float() ([8] fp32: 512): 2,048 B, twice per layer (q, k) = 8,192 B;
    # its weights, [8] bf16 each, 512 B x 4 = 2,048. Step 2 adds their AdamW states (x 2).
    job = {**JOB, "micro_batch": 1}
    llama = _estimate(**job)
    qwen3 = _estimate(tiny_llama(model_type="qwen3", qk_norm=True), **job)
    delta = {phase: qwen3.phases[phase] - llama.phases[phase] for phase in llama.phases}
    assert delta["step1/forward"] == 8192 + 2048
    assert delta["step2/forward"] == 8192 + 2048 + 2 * 2048
