"""The tape's live-set counts (kept up to date as storages come, go and change) against a
recount of the live storages from scratch at every event.

`calc.replay.tape` keeps the count of each (category, name, layer tag, size) key incrementally so that
an event costs one copy of that table, not a walk over every live storage; a storage renamed,
re-tagged or saved by autograd is re-filed. ``VRAMPLAN_CHECK_TAPE`` (``calc.replay.tape.CHECK_COUNTS``)
makes every event recount the live storages the plain way and compare: these tests replay one
structure of each kind of step with the check on, so a path that changes a live storage without
re-filing it fails here.
"""

from __future__ import annotations

import pytest

import calc
from calc.estimate import core as _estimate
from calc.replay import tape
from tests.specs import tiny_llama

LLAMA = {"name": "count-check", "hidden": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
         "ffn": 96, "vocab": 256, "max_positions": 512}  # fmt: skip
"""A GQA llama wider than ``tests/specs.py``'s (its other fields)."""


def _model(n_layers: int) -> calc.ModelSpec:
    return tiny_llama(**LLAMA, n_layers=n_layers)


def _train(**kw: object) -> calc.Training:
    return calc.Training(**{"micro_batch": 2, "seq_len": 16, **kw})  # type: ignore[arg-type]


CASES = {
    "plain hf": (6, _train(), None),
    "reference, full recompute, exact layers": (4, _train(implementation="reference", recompute="full"), None),
    "selective recompute, adam8bit": (6, _train(implementation="reference", recompute="selective", optimizer="adam8bit"), None),
    "lora": (6, _train(lora=calc.LoRA(rank=4)), None),
    "qlora": (6, _train(lora=calc.LoRA(rank=4), quant=calc.Quant(method="nf4", group_size=64), precision="bf16"), None),
    "distillation": (6, _train(implementation="reference", distill=calc.Distill(teacher=_model(6))), None),
    "inference": (6, calc.Inference(batch=2, context=16), None),
    "ddp": (6, _train(implementation="reference"), calc.Parallelism(dp=2)),
    "zero-2": (6, _train(implementation="reference"), calc.Parallelism(dp=2, zero=2)),
    "fsdp2": (6, _train(implementation="reference"), calc.Parallelism(dp=2, fsdp=True)),
    "zero-3 offload": (6, _train(implementation="reference"), calc.Parallelism(dp=2, zero=3, offload="optimizer")),
    "tp2 sequence parallel": (6, _train(implementation="reference"), calc.Parallelism(tp=2, sp=True)),
    "pp2 1f1b": (6, _train(implementation="reference", precision="fp32", micro_batch=4), calc.Parallelism(pp=2, pp_microbatches=2)),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_incremental_live_counts_equal_a_recount_at_every_event(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    n_layers, job, parallel = CASES[case]
    monkeypatch.setattr(tape, "CHECK_COUNTS", True)
    _estimate._compile.cache_clear()  # replay now, with the check on
    _estimate.compiled_for.cache_clear()
    try:
        est = calc.estimate(_model(n_layers), job, parallel, device="cpu")
    finally:
        _estimate._compile.cache_clear()
        _estimate.compiled_for.cache_clear()
    assert est.peak_bytes > 0


def test_the_check_catches_a_storage_changed_behind_the_tapes_back() -> None:
    """The check is not vacuous: a key field written past the re-filing setter is caught."""
    t = tape.Tape()
    a = t.new(256, 4, "a")
    object.__setattr__(a.storage, "_name", "renamed")  # bypasses Storage.name's setter
    check_before = tape.CHECK_COUNTS
    tape.CHECK_COUNTS = True
    try:
        with pytest.raises(AssertionError, match="out of date"):
            t.new(256, 4, "b")
    finally:
        tape.CHECK_COUNTS = check_before


def test_renaming_a_live_storage_refiles_it() -> None:
    """AccumulateGrad stealing a gradient renames its storage: the next event counts it under
    its new key only (one 1024 B storage before and after)."""
    t = tape.Tape()
    g = t.new(256, 4, "g")
    g.storage.kind, g.storage.name = "grad", "grad:w"
    t.new(256, 4, "h")
    live = dict(t.events[-1].live)
    assert live == {("grad", "grad:w", None, 1024): 1, ("act", "h", None, 1024): 1}
