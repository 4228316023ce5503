"""`calc.serve`: the budget's arithmetic (vLLM's ``determine_available_memory``), ranks and the
catalog's totals, on tiny models whose terms are checked against each other by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from calc.serving import profile as prof
from tests.specs import tiny_llama, tiny_llama64

GIB = 2**30
TOTAL = 2 * GIB


def test_budget_terms_add_up_as_vllm_subtracts_them() -> None:
    model = tiny_llama()
    serving = calc.Serving(vllm_version="0.10.1", max_model_len=64)
    est = calc.serve(model, serving, total_bytes=TOTAL)
    # available = total * util - weights - non_torch - activation (graphs outside before 0.21)
    budget = int(TOTAL * 0.9)
    assert est.budget_bytes == budget
    assert est.kv_cache_bytes == (
        budget - est.weights_bytes - est.non_torch_bytes - est.activation_peak_bytes
    )
    # tiny llama: 1024-byte pages (see test_weights_kv), 2 layers
    assert est.gpu_blocks == est.kv_cache_bytes // 1024 // 2
    assert est.kv_cache_tokens == est.gpu_blocks * 16
    assert est.max_concurrency == pytest.approx(est.gpu_blocks / 4)  # cdiv(64, 16) blocks


def test_activation_peak_is_the_larger_of_forward_and_sampler() -> None:
    model = tiny_llama()
    serving = calc.Serving(vllm_version="0.10.1", max_model_len=64)
    est = calc.serve(model, serving, total_bytes=TOTAL)
    tokens, rows = est.max_num_batched_tokens, min(est.max_num_seqs, est.max_num_batched_tokens)
    # 2 GiB < 70 GiB: vllm serve's 2048 tokens over 256 rows
    assert (tokens, rows) == (2048, 256)
    forward = prof.forward_activation_bytes(model, serving, tokens)
    # the sampler: [2048, 16] + [256, 16] bf16 hidden states, [256, 64] bf16 logits (vocab 50
    # padded to 64) and 9 fp32 [256, 50] units
    sampler = (2048 * 16 + 256 * 16) * 2 + 256 * 64 * 2 + 9 * 256 * 50 * 4
    assert prof.sampler_bytes(model, serving, "v1", tokens, rows) == sampler
    assert est.activation_peak_bytes == max(forward, sampler)


def test_graphs_enter_the_budget_from_0_21() -> None:
    model = tiny_llama()
    old = calc.serve(
        model, calc.Serving(vllm_version="0.20.0", max_model_len=64), total_bytes=TOTAL
    )
    new = calc.serve(
        model, calc.Serving(vllm_version="0.21.0", max_model_len=64), total_bytes=TOTAL
    )
    assert new.cuda_graph_bytes == old.cuda_graph_bytes == 2 * prof.GRAPH_BYTES_PER_LAYER
    assert new.kv_cache_bytes == old.kv_cache_bytes - new.cuda_graph_bytes


def test_fp8_cache_holds_twice_the_tokens_of_the_same_budget() -> None:
    model = tiny_llama()
    base = calc.serve(model, calc.Serving(max_model_len=64), total_bytes=TOTAL)
    fp8 = calc.serve(model, calc.Serving(max_model_len=64, kv_cache_dtype="fp8"), total_bytes=TOTAL)
    assert fp8.kv_cache_bytes == base.kv_cache_bytes
    assert fp8.gpu_blocks == base.kv_cache_bytes // 512 // 2


def test_tensor_parallel_never_lowers_tokens_per_gpu() -> None:
    model = tiny_llama64()
    tokens = [
        calc.serve(model, calc.Serving(tensor_parallel=tp, max_model_len=64), total_bytes=TOTAL)
        for tp in (1, 2, 4)
    ]
    assert [e.weights_bytes for e in tokens] == sorted(
        (e.weights_bytes for e in tokens), reverse=True
    )
    assert [e.kv_cache_tokens for e in tokens] == sorted(e.kv_cache_tokens for e in tokens)


def test_pipeline_stages_take_the_fewest_blocks() -> None:
    model = tiny_llama(n_layers=5)
    est = calc.serve(model, calc.Serving(pipeline_parallel=2, max_model_len=64), total_bytes=TOTAL)
    assert est.layers_per_rank in (2, 3)
    one = calc.serve(model, calc.Serving(max_model_len=64), total_bytes=TOTAL)
    assert est.gpu_blocks > one.gpu_blocks


def test_gpu_from_the_catalog_and_its_refusals() -> None:
    model = tiny_llama()
    est = calc.serve(model, calc.Serving(max_model_len=64), gpu="h100-80gb")
    assert est.total_bytes == calc.data.gpus.get_gpu("h100-80gb").cuda_total_bytes
    # the H200's CUDA total is measured now (verify/measurements/); the MI300X has none
    h200 = calc.serve(model, calc.Serving(max_model_len=64), gpu="h200-141gb")
    assert h200.total_bytes == 150_109_880_320  # torch.cuda.mem_get_info() on the H200 run
    with pytest.raises(ValueError, match="no published cudaMemGetInfo total"):
        calc.serve(model, calc.Serving(max_model_len=64), gpu="mi300x-192gb")
    with pytest.raises(ValueError, match="exactly one of total_bytes= and gpu="):
        calc.serve(model, calc.Serving(max_model_len=64))
    with pytest.raises(ValueError, match="max_model_len=128 exceeds"):
        calc.serve(model, calc.Serving(max_model_len=128), total_bytes=TOTAL)


def test_a_budget_too_small_gives_no_blocks() -> None:
    est = calc.serve(tiny_llama(), calc.Serving(max_model_len=64), total_bytes=1 << 20)
    assert est.kv_cache_bytes < 0 and est.gpu_blocks == 0 and not est.fits


def test_mla_block_size_forced_to_64_on_hopper() -> None:
    # vLLM 0.10.1 forces FlashMLA's block of 64 for DeepSeek-V3 on an H200 (capability 9.0):
    # one MLA page is 64 tokens x (kv_lora_rank 512 + rope 64) x 2 bytes = 73 728 bytes
    model = calc.load_card("deepseek-v3")
    serving = calc.Serving(vllm_version="0.10.1", max_model_len=8192, tensor_parallel=8)
    est = calc.serve(model, serving, gpu="h200-141gb")
    assert est.block_size == 64 and est.page_bytes == 64 * (512 + 64) * 2
    assert est.kv_cache_tokens == est.gpu_blocks * 64
    assert est.max_concurrency == est.gpu_blocks / (8192 // 64)
    assert any("FlashMLA" in n for n in est.notes)
    # a user's --block-size 16 is replaced too (0.8-0.10: block_size != 64), and said so
    user = calc.serve(model, replace(serving, block_size=16), gpu="h200-141gb")
    assert user.block_size == 64 and user.kv_cache_tokens == est.kv_cache_tokens
    assert any("instead of block_size=16" in n for n in user.notes)
