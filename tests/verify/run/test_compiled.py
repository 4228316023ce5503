"""The compiled-step protocol (`verify.run.compiled`) on a tiny hf llama, against independent
counts: the optimizer phases run eager code, so they equal what the `StorageTracker` measures
for the same eager step; what the compiled forward leaves for backward equals the storages
``saved_tensors_hooks`` sees saved (each rounded to 512 B) plus the 0-dim loss (512 B)."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from verify.cases.case import LLAMA, train  # noqa: E402
from verify.measure.tracker import StorageTracker, round_block  # noqa: E402
from verify.models.build import build_model, build_optimizer  # noqa: E402
from verify.run.compiled import measure_compiled  # noqa: E402
from verify.run.step import make_batch, pins_for, train_two_steps  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
        reason="Inductor's CPU backend needs a C++ compiler",
    ),
]


def _case():  # type: ignore[no-untyped-def]
    case = train("t", LLAMA, impl="hf", compile="default")  # hidden 64, 2 layers, 2 x 32 tokens
    spec, job = case.spec(), case.job
    ids, targets = make_batch(spec, job.micro_batch, job.seq_len, seed=0)
    return spec, job, ids, targets


def _saved_bytes(spec, job, ids, targets) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the storages a compiled forward saves; parameters, buffers (RoPE's
    ``inv_freq``, saved by the compiled forward) and inputs left out: they existed before."""
    model, loss_fn = build_model(spec, job, seed=0)
    model.compile()
    loss_fn(ids, targets).backward()  # compile outside the count
    skip = {
        t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers(), ids, targets)
    }
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in skip:
            seen[st._cdata] = round_block(st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(ids, targets)
    loss.backward()
    return sum(seen.values())


def test_compiled_protocol_against_independent_counts() -> None:
    spec, job, ids, targets = _case()
    meter, _pins, _extra = measure_compiled(spec, job, ids, targets, seed=0)
    res = meter.result
    kept = res.phase_start_bytes["step1/backward"] - res.phase_start_bytes["step1/forward"]
    assert kept == _saved_bytes(spec, job, ids, targets) + 512

    eager = StorageTracker(scan_baseline=False, count_late=False)
    with eager:
        eager.track(ids, targets)
        model, loss_fn = build_model(spec, job, seed=0)
        bundle = build_optimizer(model, job)
        eager.reset_peak()
        train_two_steps(loss_fn, bundle, ids, targets, job, pins_for(spec, job, seed=0,
                        device="cpu"), eager)  # fmt: skip
    for phase in ("step1/optimizer", "step2/optimizer"):
        assert res.phase_peaks[phase] == eager.phase_peaks[phase]
