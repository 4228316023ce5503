"""`calc.replay.offload`: torchtune's activation offloading on hand-made graphs, with the bytes
derived by hand from its rules (torchtune 0.6.1 ``training/_activation_offloading.py``).

Every tensor is 256 fp32 elements (1 KiB, ``K``) unless a test says otherwise. The chain used
below: a parameter ``w``; ``x0 = f(w)``; then seven ops ``x_i = f(x_{i-1})`` that each save
their input (pack ids 1..7 for x0..x6), each input dropped once used, ``x7`` the root.
"""

from __future__ import annotations

import sympy as sp

from calc.replay.offload import MIN_OFFLOAD_BYTES, Offload
from calc.replay.tape import Node, Tape, Tensor

K = 1024
N = 256
FP32 = 4


def _live(tape: Tape) -> int:
    return sum(st.size for st in tape.live.values())


def _op(tape: Tape, name: str, x: Tensor, saves: tuple[Tensor, ...], seen: list[int]) -> Tensor:
    """A toy op: node (saving ``saves``), then an output; its backward notes the live bytes as
    it starts (after the unpack hooks), then makes the input's gradient."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        seen.append(_live(tape) // K)
        return [tape.new(x.numel, x.itemsize, f"d{name}")]

    node = tape.node(name, rule, [x], saved=list(saves))
    return tape.output(tape.new(N, FP32, name), node)


def _chain(offload: bool) -> tuple[Tape, list[int]]:
    tape = Tape()
    if offload:
        tape.offload = Offload(active=True)
    seen: list[int] = []
    w = tape.existing(N, FP32, "w", "weight", leaf=True)
    x = _op(tape, "x0", w, (), seen)
    for i in range(1, 8):
        nxt = _op(tape, f"x{i}", x, (x,), seen)
        tape.drop(x)
        x = nxt
    if offload:
        tape.offload.active = False
    tape.phase = "backward"
    tape.backward(x)
    tape.drop(x)
    return tape, seen


def test_the_forward_stash_keeps_the_last_offloaded_tensors_within_five_ids() -> None:
    # At pack id 7 (x6), ids <= 2 are dropped: x2..x6 stay (5 K) beside w and x7.
    tape = Tape()
    tape.offload = Offload(active=True)
    w = tape.existing(N, FP32, "w", "weight", leaf=True)
    x = _op(tape, "x0", w, (), [])
    for i in range(1, 8):
        nxt = _op(tape, f"x{i}", x, (x,), [])
        tape.drop(x)
        x = nxt
    assert _live(tape) == 7 * K
    assert sorted(tape.offload.fwd) == [3, 4, 5, 6, 7]


def test_without_offloading_autograd_keeps_every_saved_input() -> None:
    _, seen = _chain(offload=False)
    # x7's node starts with w, x0..x6 saved, x7 and the seed: 10 K.
    assert seen[0] == 10


def test_tensors_come_back_one_node_ahead_and_leave_after_the_next() -> None:
    _, seen = _chain(offload=True)
    # x7: w, x7, seed, and x2..x6 in the forward stash (x6 handed back from it) = 8 K; its
    # post-hook then clears the stash. x6: x5 brought back (1 K) beside w, x7, seed, dx7 = 5 K.
    # x5..x1: the copy of the node before is still in the backward stash until this node has
    # run: w, x7, seed, the incoming gradient, two copies = 6 K. x0 saves nothing: x0's copy
    # waits for the end of the backward: 5 K.
    assert seen == [8, 5, 6, 6, 6, 6, 6, 5]


def test_the_end_of_backward_drops_the_backward_stash() -> None:
    tape, _ = _chain(offload=True)
    assert tape.offload.bwd == {}
    names = {st.name for st in tape.live.values()}
    assert names == {"w", "grad:w"}  # the parameter and its gradient


def test_parameters_and_tensors_under_1_kib_stay_with_autograd() -> None:
    tape = Tape()
    tape.offload = Offload(active=True)
    w = tape.existing(N, FP32, "w", "weight", leaf=True)
    small = _op(tape, "small", w, (), [])
    tape.node("uses", lambda *_: [None, None], [small, w], saved=[w])
    tiny = tape.new(MIN_OFFLOAD_BYTES // FP32 - 1, FP32, "tiny")  # 1020 B
    tape.node("tiny", lambda *_: [None], [small], saved=[tiny])
    assert tape.offload.fwd == {}  # nothing went to the host
    assert w.storage.saved == 1 and tiny.storage.saved == 1


def test_a_size_written_in_symbols_is_offloaded() -> None:
    # The estimate refuses micro-batches under MIN_TOKENS, where a per-token tensor could fall
    # under the threshold; above it every symbolic size is 1 KiB or more.
    tape = Tape()
    tape.offload = Offload(active=True)
    w = tape.existing(N, FP32, "w", "weight", leaf=True)
    x = tape.new(sp.Symbol("b") * sp.Symbol("s"), FP32, "rstd")
    tape.node("norm", lambda *_: [None], [w], saved=[x])
    assert list(tape.offload.fwd) == [1] and x.storage.saved == 0
