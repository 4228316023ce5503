"""``Training(dropout=p)`` on a derived architecture (`calc.derive.dropout`): every dropout key
of the config at ``p``, the config class's defaults included."""

from __future__ import annotations

import pytest

import calc
from calc.derive.dropout import dropout_config, dropout_keys
from tests.specs import TINY_PHI3_CONFIG

pytest.importorskip("transformers")


def test_every_dropout_key_of_the_family_takes_p_and_nothing_else_changes() -> None:
    # transformers 5.24 configuration_phi3.py: Phi3Config takes resid_pdrop, embd_pdrop and
    # attention_dropout (all 0.0 by default); the tiny config names none of them.
    out = dropout_config(TINY_PHI3_CONFIG, 0.1)
    assert {k: v for k, v in out.items() if k not in TINY_PHI3_CONFIG} == {
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attention_dropout": 0.1,
    }
    assert all(out[k] == v for k, v in TINY_PHI3_CONFIG.items())
    assert dropout_config(TINY_PHI3_CONFIG, None) == TINY_PHI3_CONFIG


def test_only_numeric_keys_named_as_dropouts_count() -> None:
    config = {"attention_dropout": 0.0, "use_dropout": True, "resid_pdrop": 0, "dropout_seed": 3}
    assert dropout_keys(config) == ("attention_dropout", "resid_pdrop")


def test_attention_dropout_under_sdpa_is_refused_on_cuda_not_on_the_cpu_tracker() -> None:
    # CUDA keeps flash/efficient SDPA with dropout; the CPU recording runs math for it
    spec = calc.ModelSpec.from_hf_config(TINY_PHI3_CONFIG)
    job = calc.Training(micro_batch=2, seq_len=64, precision="fp32", dropout=0.1)
    with pytest.raises(NotImplementedError, match=r"attention dropout 0\.1 under SDPA on CUDA"):
        calc.estimate(spec, job)
    plain = calc.Training(micro_batch=2, seq_len=64, precision="fp32")
    # the masks the dropout sites save for backward (and math attention's probabilities)
    assert (
        calc.estimate(spec, job, device="cpu").peak_bytes
        > calc.estimate(spec, plain, device="cpu").peak_bytes
    )
