"""`calc.derive.offload`: transformers' ``activation_checkpointing_enable(offload=True)``,
recorded from its code, against hand arithmetic."""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama

pytest.importorskip("transformers")


def _job(offload: bool) -> calc.Training:
    return calc.Training(micro_batch=2, seq_len=32, precision="bf16", recompute="full",
                         offload_activations=offload)  # fmt: skip


def test_the_checkpoints_inputs_leave_the_device() -> None:
    # save_on_cpu around each checkpointed layer: its one positional input, hidden_states
    # [b, s, h] in bf16, is packed to the host instead of held by the checkpoint frame. At the
    # forward's peak (the head, a vocabulary of 8,192) the frames of all four layers would hold
    # theirs: 4 x 2 x 32 x 16 x 2 B = 4 x 2,048 B, each its own 512-B blocks.
    model = tiny_llama(vocab=8192, n_layers=4)
    off = calc.estimate(model, _job(True), device="cpu")
    plain = calc.estimate(model, _job(False), device="cpu")
    assert plain.phases["step2/forward"] - off.phases["step2/forward"] == 4 * 2 * 32 * 16 * 2
    assert any("derived from transformers' code" in n for n in off.notes)
