"""peft's ``lora_dropout`` in the replay (`calc.compress.lora.lora_linear`), by hand on the tiny
llama (hidden 16, ffn 24, 2 layers; one sequence of 8 tokens, fp32, reference)."""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama, tiny_training


def _phases(dropout: float, device: str) -> dict[str, int]:
    job = tiny_training(lora=calc.LoRA(rank=4, modules=("down",), dropout=dropout))
    return dict(calc.estimate(tiny_llama(), job, device=device).phases)


@pytest.mark.parametrize(("device", "mask_bytes"), [("cpu", 1024), ("cuda", 512)])
def test_dropout_on_the_down_adapter_adds_one_mask(device: str, mask_bytes: int) -> None:
    # Adapters on down_proj only. Its input x = act(gate) * up is [8, 24] fp32 = 768 B -> 1,024.
    # Without dropout lora_A saves x. With it lora_A saves the dropped copy (1,024) and x dies
    # (the frozen base saves its weight, not x): a wash, plus the mask where the dropout has a
    # gradient to carry. Layer 0's x needs none (the frozen base before it), so its mask dies
    # at once; layer 1's is saved: CPU keeps it in x's dtype (1,024), CUDA as bool (192 B ->
    # 512). Everything saved is alive through the forward's end and into the backward.
    plain, dropped = _phases(0.0, device), _phases(0.1, device)
    for phase in ("step1/forward", "step1/backward", "step2/forward", "step2/backward"):
        assert dropped[phase] - plain[phase] == mask_bytes
    assert dropped["step1/optimizer"] == plain["step1/optimizer"]  # all of it is gone by then
