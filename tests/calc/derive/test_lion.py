"""Lion (`calc.derive.lion`): its update by hand, and what a derived model's step holds with it."""

from __future__ import annotations

import pytest

import calc

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY_OLMO2 = {
    "model_type": "olmo2", "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 256,
    "max_position_embeddings": 512,
}  # fmt: skip
"""A type no hand-written graph models: its Lion step is recorded."""


@pytest.mark.parametrize("foreach", [False, True])
def test_one_step_is_chen_et_al_algorithm_1(foreach: bool) -> None:
    from calc.derive.lion import lion_class

    # by hand, lr 0.1, betas (0.9, 0.99), wd 0.5, m0 = 0: p = 1 * (1 - 0.1 * 0.5) = 0.95;
    # u = sign(0.9 * 0 + 0.1 * g); p -= 0.1 * u; m = 0.99 * 0 + 0.01 * g
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))
    p.grad = torch.tensor([0.5, -2.0, 0.0])
    opt = lion_class()([p], lr=0.1, weight_decay=0.5, foreach=foreach)
    opt.step()
    assert p.detach().tolist() == pytest.approx([0.85, 1.05, 0.95])
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx([0.005, -0.02, 0.0])


def _weight_bytes() -> int:
    """TINY_OLMO2's fp32 parameters, each rounded to 512 B, by hand: embedding and head 256 x 48;
    per layer q and o 48 x 48, k and v 48 x 24 (2 key/value heads of 12), gate, up and down
    48 x 96, four norms of 48 or 24 (q/k norms, post-attention, post-feed-forward); final norm."""
    block = lambda n: -(-n * 4 // 512) * 512  # noqa: E731
    layer = 2 * block(48 * 48) + 2 * block(48 * 24) + 3 * block(48 * 96) + 4 * block(48)
    return 2 * block(256 * 48) + 2 * layer + block(48)  # 268,800 B


@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_a_derived_step_holds_one_momentum_per_parameter(impl: str) -> None:
    spec = calc.ModelSpec.from_hf_config(TINY_OLMO2, name="tiny-olmo2")
    job = calc.Training(micro_batch=2, seq_len=16, optimizer="lion", optimizer_impl=impl)
    est = calc.estimate(spec, job, device="cpu")
    weights = _weight_bytes()
    assert est.breakdown["optimizer/exp_avg"] == est.breakdown["weights"] == weights
    # the first step's peak: weights, gradients, exp_avg and the sign updates alive at once:
    # foreach, every update of the one (cpu, fp32) group; for-loop, one at a time (the largest
    # parameter: the embedding or the head, 256 x 48 x 4 B)
    update = weights if impl == "foreach" else 256 * 48 * 4
    held = est.breakdown["buffers"] + est.breakdown["inputs"]  # rotary tables, token ids
    assert est.phases["step1/optimizer"] == 3 * weights + update + held
