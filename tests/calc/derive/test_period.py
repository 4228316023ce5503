"""Layers that differ in a repeating pattern (`calc.derive.period`): the pattern found, each
recorded layer filed under its unit, and the estimate from five recorded units equal to the
one from every layer recorded."""

from __future__ import annotations

import pytest

import calc
from calc.derive import replay
from calc.derive.period import Periodic, expand_order, periodic_layout
from calc.estimate import core

S, F = "sliding", "full"


def test_gemma3_27b_five_sliding_then_one_full_in_62_layers() -> None:
    # Gemma-3-27B (num_hidden_layers 62, sliding_window_pattern 6): layer i is full when
    # (i + 1) % 6 == 0. Ten units of six, then the two sliding layers of an 11th: record
    # 5 x 6 + 2 = 32 layers.
    kinds = [F if (i + 1) % 6 == 0 else S for i in range(62)]
    layout = periodic_layout(kinds)
    assert layout == Periodic(prefix=0, period=6, units=10, tail=2)
    assert layout.recorded_layers == 32 and layout.n_layers == 62


def test_gemma2_alternates_in_pairs_and_deepseek_has_one_dense_layer_first() -> None:
    assert periodic_layout([S, F] * 21) == Periodic(0, 2, 21, 0)  # Gemma-2-9B: 42 layers
    deepseek_v2_lite = ["dense"] + ["moe"] * 26  # first_k_dense_replace 1, 27 layers
    assert periodic_layout(deepseek_v2_lite) == Periodic(1, 1, 26, 0)


def test_no_pattern_with_more_than_five_units_records_every_layer() -> None:
    assert periodic_layout([S, F, F, S, F, S, S, F]) is None  # 8 layers: no six units
    assert periodic_layout([S, F] * 5) is None  # five pairs: recording five saves nothing


def test_each_recorded_layer_is_filed_under_its_unit() -> None:
    # one prefix layer, units of two, a tail of one: 1 + 5 x 2 + 1 = 12 layers recorded
    layout = Periodic(prefix=1, period=2, units=7, tail=1)
    tags = [layout.tag(i) for i in range(layout.recorded_layers)]
    assert tags == [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
    with pytest.raises(ValueError, match="layer 12"):
        layout.tag(12)


def test_the_gradient_order_repeats_the_middle_unit_for_every_real_unit() -> None:
    # Backward order of a recording of prefix 1, units of 2 (6 real units), no tail:
    # head, units 4..0 (layer 10 down to 1), then the prefix layer 0, then the embedding.
    layout = Periodic(prefix=1, period=2, units=6, tail=0)
    recorded = [("head", "head")] + [(f"w{t}", t) for t in range(10, 0, -1)]
    recorded += [("w0", 0), ("embed", "embed")]
    real = expand_order(recorded, layout)
    # unit 2 is recorded layers 5 and 6 (backward order: 6 then 5); real unit u is layers
    # 1 + 2u and 2 + 2u
    expected = [("head", "head")]
    for unit in range(5, -1, -1):
        expected += [("w6", 2 + 2 * unit), ("w5", 1 + 2 * unit)]
    expected += [("w0", 0), ("embed", "embed")]
    assert list(real) == expected


@pytest.mark.parametrize(
    ("fields", "bad"),
    [({"prefix": 0, "period": 2, "units": 5, "tail": 0}, "5 units"),
     ({"prefix": 0, "period": 2, "units": 7, "tail": 2}, "not a periodic layout")],
)  # fmt: skip
def test_a_layout_outside_its_range_is_refused(fields: dict, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        Periodic(**fields)


TINY_GEMMA2 = {
    "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 12,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512,
    "sliding_window": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 16,
}  # fmt: skip
TINY_DEEPSEEK_V2 = {
    "model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
    "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "greedy",
    "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}  # fmt: skip
EAGER = {"implementation": "hf", "attention": "eager"}


def _estimate(config: dict, job: object, parallel: object) -> calc.Estimate:
    core._compile.cache_clear()
    core.compiled_for.cache_clear()
    spec = calc.ModelSpec.from_hf_config(config)
    if parallel is None:
        return calc.estimate(spec, job, device="cpu")
    return calc.estimate(spec, job, parallel, device="cpu")


@pytest.mark.parametrize(
    ("config", "job", "parallel"),
    [
        (TINY_GEMMA2, calc.Training(micro_batch=2, seq_len=64, precision="fp32", **EAGER),
         None),
        (TINY_GEMMA2, calc.Training(micro_batch=2, seq_len=64, precision="fp32", **EAGER),
         calc.Parallelism(dp=2)),
        (TINY_DEEPSEEK_V2, calc.Inference(batch=2, context=96, prompt=48, precision="bf16",
                                          **EAGER), None),
    ],
)  # fmt: skip
def test_five_recorded_units_give_the_bytes_of_every_layer_recorded(
    config: dict, job: object, parallel: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The expected value is the recording of every layer (the layout switched off): an
    # independent replay of the same modeling code, no generalisation in it. Gemma-2 with 12
    # layers is six (sliding, full) units, 10 layers recorded; DeepSeek-V2 one dense layer
    # and seven MoE ones, 6 recorded. DDP's buckets follow the expanded gradient order.
    periodic = _estimate(config, job, parallel)
    monkeypatch.setattr(replay, "layout_of", lambda config, checkpoint_every=1: None)
    every = _estimate(config, job, parallel)
    assert periodic.peak_bytes == every.peak_bytes
    assert periodic.peak_phase == every.peak_phase
    assert periodic.breakdown == every.breakdown


def test_gemma2_layers_alternate_in_what_transformers_builds() -> None:
    pytest.importorskip("transformers")
    from calc.derive.record import layer_signatures

    sig = layer_signatures(TINY_GEMMA2)
    assert sig[0] == sig[2] != sig[1]  # is_sliding / sliding_window differ, layer_idx does not
    assert replay.layout_of(TINY_GEMMA2) == Periodic(0, 2, 6, 0)
