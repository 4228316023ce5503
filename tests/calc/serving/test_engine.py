"""Engine choice and defaults per vLLM version (`calc.serving.engine`), expected values read
from vLLM's ``vllm/engine/arg_utils.py`` (``get_batch_defaults``) and ``vllm/config.py``."""

from __future__ import annotations

import pytest

import calc
from calc.serving import engine as eng

GIB = 2**30
H100 = ("NVIDIA H100 80GB HBM3", 79 * GIB)
A100 = ("NVIDIA A100-SXM4-80GB", 79 * GIB)
L4 = ("NVIDIA L4", 22 * GIB)


def resolve(gpu: tuple[str, int], cc: float | None = None, **fields: object) -> eng.EngineSettings:
    serving = calc.Serving(**fields)  # type: ignore[arg-type]
    return eng.resolve(serving, 131072, gpu[1], gpu[0], cc)


@pytest.mark.parametrize(
    ("gpu", "entrypoint", "batched", "seqs"),
    [
        (H100, "serve", 8192, 1024),  # >= 70 GiB and not an A100
        (H100, "llm", 16384, 1024),
        (A100, "serve", 2048, 256),  # the A100 is excluded by name (PR #17885)
        (A100, "llm", 8192, 256),
        (L4, "serve", 2048, 256),
    ],
)
def test_v1_batch_defaults(gpu: tuple[str, int], entrypoint: str, batched: int, seqs: int) -> None:
    cfg = resolve(gpu, vllm_version="0.10.1", entrypoint=entrypoint)
    assert (cfg.engine, cfg.max_num_batched_tokens, cfg.max_num_seqs) == ("v1", batched, seqs)


def test_max_num_seqs_is_capped_by_the_token_budget() -> None:
    cfg = resolve(H100, vllm_version="0.10.1", max_num_batched_tokens=512)
    assert cfg.max_num_seqs == 512  # min(1024, 512)


def test_v0_before_0_8_and_on_old_gpus_until_0_10() -> None:
    cfg = resolve(L4, vllm_version="0.7.3", max_model_len=20000)
    # V0 without chunked prefill: max(max_model_len, 2048) tokens, 256 sequences
    assert (cfg.engine, cfg.max_num_batched_tokens, cfg.max_num_seqs) == ("v0", 20000, 256)
    # vllm serve with max_model_len > 32768 turns chunked prefill on (2048 tokens)
    assert resolve(L4, vllm_version="0.7.3").max_num_batched_tokens == 2048
    assert resolve(L4, 7.5, vllm_version="0.9.2").engine == "v0"  # Turing falls back
    assert resolve(L4, 7.5, vllm_version="0.10.2").engine == "v1"
    assert resolve(L4, 8.9, vllm_version="0.9.2").engine == "v1"


def test_cuda_graphs_enter_the_budget_from_0_21() -> None:
    assert not resolve(H100, vllm_version="0.20.1").cudagraphs_in_budget
    assert resolve(H100, vllm_version="0.21.0").cudagraphs_in_budget
    eager = resolve(H100, vllm_version="0.21.0", enforce_eager=True)
    assert eager.cudagraph_capture_size == 0 and not eager.cudagraphs_in_budget
    # from 0.11 the largest capture size is min(2 * max_num_seqs, 512)
    assert resolve(H100, vllm_version="0.12.0", max_num_seqs=64).cudagraph_capture_size == 128


def mla_block(version: str, cc: float | None, block_size: int | None = None) -> tuple[int, bool]:
    serving = calc.Serving(vllm_version=version, block_size=block_size)
    size, note = eng.block_size(serving, mla=True, compute_capability=cc)
    return size, note is not None


@pytest.mark.parametrize(
    ("version", "cc", "user", "want", "noted"),
    [
        # vllm/platforms/cuda.py check_and_update_config: FlashMLA on Hopper forces 64
        ("0.7.3", 9.0, None, 16, False),  # before FlashMLA (released 2025-02-24)
        ("0.8.5", 9.0, None, 64, True),
        ("0.10.1", 9.0, 64, 64, False),  # already 64: nothing forced
        ("0.10.1", 9.0, 128, 64, True),  # 0.8-0.10: block_size != 64 -> 64
        ("0.11.0", 9.0, 128, 128, False),  # later: a multiple of 64 is kept
        ("0.15.1", 9.0, None, 64, True),
        ("0.10.1", 8.0, None, 16, False),  # A100: Triton MLA, no forcing
        # Blackwell: CUTLASS MLA (PR #21626) 128, then FlashInfer MLA (PR #32615) 64
        ("0.10.0", 10.0, None, 16, False),
        ("0.10.1", 10.0, None, 128, True),
        ("0.15.1", 10.0, None, 64, True),
        # from PR #35122 the selected backend's preferred size: FlashAttention MLA on Hopper
        # (MultipleOf(16): 16), FlashInfer MLA on Blackwell ([32, 64]: 32); a user's size kept
        ("0.19.0", 9.0, None, 16, False),
        ("0.19.0", 9.0, 64, 64, False),
        ("0.19.0", 10.0, None, 32, True),
    ],
)
def test_mla_block_size_by_version_and_gpu(
    version: str, cc: float, user: int | None, want: int, noted: bool
) -> None:
    assert mla_block(version, cc, user) == (want, noted)


def test_block_size_of_other_models_is_the_flag_or_16() -> None:
    for version in ("0.6.4", "0.10.1", "0.19.0"):
        for user, want in ((None, 16), (32, 32)):
            serving = calc.Serving(vllm_version=version, block_size=user)
            assert eng.block_size(serving, mla=False, compute_capability=9.0) == (want, None)


def test_an_unnamed_gpu_keeps_16_and_says_why() -> None:
    size, note = eng.block_size(calc.Serving(vllm_version="0.10.1"), True, None)
    assert size == 16
    assert note is not None and "block_size=" in note
