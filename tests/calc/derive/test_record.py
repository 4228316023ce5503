"""`calc.derive.record`: recordings in several threads of one process.

A recording session sets state that is not its thread's own (the global RNG's seed, the patches
of `calc.derive.book`, Dynamo's caches). The web app records from more than one thread (its
prefetch thread, each user's session): before `record.RECORDING`, four concurrent recordings of
this tiny Mixtral refused two ("the ops it runs change with the sizes").
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import calc
from calc.estimate import core
from verify.cases.derived import CONFIGS

JOBS = (
    calc.Training(micro_batch=1, seq_len=256),
    calc.Training(micro_batch=1, seq_len=256, precision="bf16"),
    calc.Training(micro_batch=1, seq_len=256, precision="fp32"),
    calc.Training(micro_batch=1, seq_len=256, recompute="full"),
)
"""Four structures of one model: four recordings, none found in another's cache."""


def test_concurrent_recordings_give_what_each_gives_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = calc.ModelSpec.from_hf_config(CONFIGS["mixtral"], name="mixtral")
    results: dict[int, object] = {}

    def estimate(i: int) -> None:
        try:
            results[i] = calc.estimate(model, JOBS[i], device="cpu").peak_bytes
        except NotImplementedError as exc:  # what the race gave: a refusal
            results[i] = str(exc)

    threads = [threading.Thread(target=estimate, args=(i,)) for i in range(len(JOBS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # each job again, alone, recorded anew (a fresh folder, the compiled structures forgotten)
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path / "alone"))
    core._compile.cache_clear()
    alone = {i: calc.estimate(model, job, device="cpu").peak_bytes for i, job in enumerate(JOBS)}
    assert results == alone
    assert len(set(alone.values())) == len(JOBS)  # four different structures indeed
