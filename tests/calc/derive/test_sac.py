"""`calc.derive.sac`: torchtitan's op-level selective checkpointing (``recompute="op"``),
recorded from transformers' code, against hand arithmetic."""

from __future__ import annotations

import pytest

import calc
from tests.specs import tiny_llama

pytest.importorskip("transformers")


def _job(recompute: str, **changes: object) -> calc.Training:
    job: dict[str, object] = {"micro_batch": 2, "seq_len": 32, "precision": "bf16"}
    return calc.Training(recompute=recompute, **{**job, **changes})  # type: ignore[arg-type]


def test_the_policy_keeps_sdpa_and_every_other_mm_of_each_layer() -> None:
    # Llama's layer runs seven mm (q, k, v, o, gate, up, down); the policy keeps the 1st, 3rd,
    # 5th and 7th, and the flash kernel's output and logsumexp. At b=2, s=32 (64 tokens),
    # hidden 16 (2 heads of 8, 2 kv heads), ffn 24, in bf16: q 64x16x2 = 2,048 B, v 2,048 B,
    # gate 64x24x2 = 3,072 B, down 2,048 B, SDPA out 2x2x32x8x2 = 2,048 B, logsumexp 2x2x32x4
    # = 512 B (fp32): 11,776 B a layer more than full recomputation keeps (both keep the
    # layer's input), held by all four layers at the forward's peak (the 8,192-entry head).
    model = tiny_llama(vocab=8192, n_layers=4)
    by_op = calc.estimate(model, _job("op"), device="cpu")
    full = calc.estimate(model, _job("full"), device="cpu")
    assert by_op.phases["step2/forward"] - full.phases["step2/forward"] == 4 * 11_776
    assert any("derived from transformers' code" in n for n in by_op.notes)


@pytest.mark.parametrize("implementation", ["reference", "torchtune"])
def test_the_hand_graphs_refuse_it_by_name(implementation: str) -> None:
    with pytest.raises(NotImplementedError, match="recompute='op'"):
        calc.estimate(tiny_llama(), _job("op", implementation=implementation), device="cpu")


def test_pipeline_stages_refuse_it() -> None:
    job = _job("op", implementation="reference", precision="fp32")
    with pytest.raises(NotImplementedError, match="recompute='op'"):
        calc.estimate(
            tiny_llama(n_layers=4), job, calc.Parallelism(pp=2, pp_microbatches=2), device="cpu"
        )
