"""`Estimate.reserved`: calc's alloc/free stream through the caching allocator.

The tiny llama (tests/specs.py) trains with two 32 MiB cuBLAS workspaces (forward thread and
autograd thread, `calc.estimate.workspace`); every other tensor of its step is far below 1 MiB
(the CPU tracker's whole step, which has no workspaces, peaks below 1 MiB: asserted), so the
small pool needs one 2 MiB segment. Workspaces are >= 10 MiB requests: segments of exactly
32 MiB each (``get_allocation_size`` rounds to 2 MiB). Reserved: 2 x 32 + 2 = 66 MiB, three
segments. With expandable segments the large pool maps 20 MiB pages: the first workspace maps
40 MiB (8 MiB free after it), the second extends that free tail by 24 MiB -> two more pages:
80 MiB; the small pool one 2 MiB page: 82 MiB, two segments.
"""

from __future__ import annotations

import pytest

import calc
from calc.replay.caching_allocator import AllocatorConfig
from tests.specs import tiny_llama

MIB = 1 << 20
TINY = tiny_llama()
JOB = calc.Training(micro_batch=2, seq_len=16)


def test_stream_replays_calc_peak_and_reserves_by_hand() -> None:
    est = calc.estimate(TINY, JOB)
    assert calc.estimate(TINY, JOB, device="cpu").peak_bytes < MIB
    st = est.reserved()
    assert st.requested_bytes == est.peak_bytes  # the stream is calc's: same peak
    assert (st.reserved_bytes, st.segments) == (66 * MIB, 3)
    assert est.reserved_bytes == 66 * MIB >= est.peak_bytes
    exp = est.reserved(AllocatorConfig(expandable_segments=True))
    assert (exp.reserved_bytes, exp.segments) == (82 * MIB, 2)
    assert exp.requested_bytes == est.peak_bytes


def test_a100_workspaces_follow_the_gpu() -> None:
    # 8,519,680 B workspaces (1-10 MiB): the first opens a 20 MiB large-pool segment and is
    # split (11.875 MiB left > 1 MiB); the second best-fits that remainder: one 20 MiB
    # segment, plus the small pool's 2 MiB: 22 MiB.
    est = calc.estimate(TINY, JOB, gpu="a100-80gb")
    st = est.reserved()
    assert st.requested_bytes == est.peak_bytes
    assert (st.reserved_bytes, st.segments) == (22 * MIB, 2)


def test_inference_has_one_workspace() -> None:
    job = calc.Inference(batch=1, context=16, implementation="reference")
    est = calc.estimate(TINY, job)
    st = est.reserved()
    assert st.requested_bytes == est.peak_bytes
    assert st.reserved_bytes == 32 * MIB + 2 * MIB


def test_not_modelled_where_it_is_not() -> None:
    with pytest.raises(NotImplementedError, match="one GPU"):
        calc.estimate(TINY, JOB, device="cpu").reserved()
    with pytest.raises(NotImplementedError, match="one GPU"):
        _ = calc.estimate(TINY, JOB, calc.Parallelism(dp=2)).reserved_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
def test_reserved_at_least_the_peak_on_a_real_card(precision: str) -> None:
    model = calc.load_card("gpt2")
    job = calc.Training(micro_batch=1, seq_len=128, precision=precision)
    est = calc.estimate(model, job)
    for config in (None, AllocatorConfig(expandable_segments=True)):
        st = est.reserved(config)
        assert st.requested_bytes == est.peak_bytes
        assert st.reserved_bytes >= st.allocated_bytes >= est.peak_bytes


def test_a_derived_architecture_replays_its_recorded_stream_by_hand() -> None:
    # Phi-3 (no hand-written graph: calc records transformers' model). Its tiny bf16 prefill
    # holds one 32 MiB cuBLAS workspace and, on the CPU tracker, peaks below 1 MiB: the small
    # pool needs one 2 MiB segment. Reserved: 32 + 2 = 34 MiB in two segments; expandable
    # segments map 20 MiB pages for the workspace (40 MiB) and one 2 MiB small page: 42 MiB.
    pytest.importorskip("transformers")
    from tests.specs import TINY_PHI3_CONFIG

    spec = calc.ModelSpec.from_hf_config(TINY_PHI3_CONFIG)
    job = calc.Inference(batch=2, context=32, prompt=16, precision="bf16")
    assert calc.estimate(spec, job, device="cpu").peak_bytes < MIB
    est = calc.estimate(spec, job)
    st = est.reserved()
    assert st.requested_bytes == est.peak_bytes
    assert (st.reserved_bytes, st.segments) == (34 * MIB, 2)
    assert est.reserved(AllocatorConfig(expandable_segments=True)).reserved_bytes == 42 * MIB


def test_generate_with_a_static_cache_on_cuda_says_transformers_would_compile_it() -> None:
    static = calc.Inference(batch=1, prompt=8, new_tokens=4, cache="static")
    assert any("disable_compile=True" in n for n in calc.estimate(TINY, static).notes)
    for job, device in ((static, "cpu"), (calc.Inference(batch=1, prompt=8, new_tokens=4), "cuda")):
        assert not any(
            "disable_compile" in n for n in calc.estimate(TINY, job, device=device).notes
        )
