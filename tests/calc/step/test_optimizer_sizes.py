"""8-bit Adam's ``min_8bit_size`` decided at the size values each call is given (no module state:
the app compiles on a background thread, so two replays must not share a global).

bitsandbytes keeps fp32 ``state1``/``state2`` for a param of fewer than 4096 elements and uint8
states plus fp32 ``absmax1``/``absmax2`` (one per 256-element block) from 4096 on."""

from __future__ import annotations

from calc import symbols as S
from calc.replay.tape import Tape
from calc.step.optimizer import optimizer_step


def _states(h: int | None) -> dict[str, int]:
    """The first step's states of one fp32 param of ``h`` elements (symbolic), name -> itemsize."""
    tape = Tape()
    leaf = tape.existing(S.h, 4, "p0", "weight", leaf=True, tag="p0")
    tape.grads[id(leaf.storage)] = tape.existing(S.h, 4, "grad:p0", "grad", tag="p0")
    st = optimizer_step(
        tape, [leaf], optimizer="adam8bit", impl="foreach", precision="fp32",
        first_step=True, weight_decay=0.0, device="cpu",
        size_values=None if h is None else {S.h: h},
    )  # fmt: skip
    (per_param,) = st.per_param.values()
    return {name: t.itemsize for name, t in per_param.items()}


def test_small_param_keeps_fp32_states() -> None:
    assert _states(16) == {"state1": 4, "state2": 4}  # 16 < 4096


def test_large_param_gets_uint8_states_and_absmax() -> None:
    assert _states(8192) == {"state1": 1, "state2": 1, "absmax1": 4, "absmax2": 4}


def test_each_call_decides_at_its_own_values() -> None:
    # a large replay between two small ones leaves nothing behind (the old global did)
    assert _states(16) == _states(16) != _states(8192)
    assert _states(16) == {"state1": 4, "state2": 4}


def test_undecidable_symbolic_size_counts_as_large() -> None:
    assert _states(None) == {"state1": 1, "state2": 1, "absmax1": 4, "absmax2": 4}
