"""``Training.compile``: validated at the edge, and refused by ``calc.estimate`` until the
compiled step is derived (verify measures it: ``compile-*`` cases)."""

from __future__ import annotations

import pytest

import calc
from calc.config.jobs import COMPILES, Training
from tests.specs import tiny_llama


def _spec() -> calc.ModelSpec:
    return tiny_llama()


def test_choices_are_none_and_default() -> None:
    assert COMPILES == ("none", "default")
    assert Training(micro_batch=1, seq_len=8).compile == "none"


def test_unknown_mode_names_the_field() -> None:
    with pytest.raises(ValueError, match="compile='max-autotune' is not one of"):
        Training(micro_batch=1, seq_len=8, compile="max-autotune")  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_default_mode_is_refused_by_name(device: str) -> None:
    job = Training(micro_batch=2, seq_len=32, precision="fp32", compile="default")
    with pytest.raises(NotImplementedError, match="compile='default'"):
        calc.estimate(_spec(), job, device=device)


def test_none_is_the_eager_estimate() -> None:
    # compile="none" is the default: the same job spelled both ways gives the same bytes
    plain = Training(micro_batch=2, seq_len=32, precision="fp32")
    spelled = Training(micro_batch=2, seq_len=32, precision="fp32", compile="none")
    spec = _spec()
    assert calc.estimate(spec, spelled).peak_bytes == calc.estimate(spec, plain).peak_bytes
