"""`calc.replay.tape.Tape`, the replay engine, on hand-made graphs with hand-derived byte counts.

Every tensor here is 256 fp32 elements (1024 B, exactly two 512-byte blocks) unless a test says
otherwise, so live bytes are counted in units of ``K = 1024``. Graphs are built from one toy op,
`_op`: it creates its autograd node (saving what it is told to), then allocates its output; its
backward allocates one fresh gradient per differentiable input, named ``d<op>.<i>``, and logs
the op's name so tests can read the order in which the engine ran the nodes.
"""

from __future__ import annotations

import pytest
import sympy as sp

from calc.replay.tape import Node, Tape, Tensor, round_block

K = 1024
N = 256  # elements of every toy tensor: 256 * 4 B = 1024 B = K
FP32 = 4


def _live(tape: Tape) -> int:
    """Bytes held right now."""
    return sum(st.size for st in tape.live.values())


def _trace(tape: Tape, phase: str | None = None) -> list[tuple[str, int]]:
    """(label, live bytes after it) of every event, optionally of one phase only."""
    return [
        (e.label, sum(key[3] * count for key, count in e.live))
        for e in tape.events
        if phase is None or e.phase == phase
    ]


def _backward_trace(tape: Tape, root: Tensor) -> list[tuple[str, int]]:
    """Run ``root.backward()`` in phase ``backward``; that phase's (label, live bytes)."""
    tape.phase = "backward"
    tape.backward(root)
    return _trace(tape, "backward")


def _op(
    tape: Tape,
    name: str,
    inputs: list[Tensor],
    saves: tuple[Tensor, ...] = (),
    log: list[str] | None = None,
    numel: int = N,
) -> Tensor:
    """A toy op: node first (saving ``saves``), then a ``numel`` fp32 output named ``name``.

    Backward: one new gradient per input that needs one, ``d<name>.<i>``, shaped like it."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        if log is not None:
            log.append(name)
        return [
            None if edge is None else tape.new(x.numel, x.itemsize, f"d{name}.{i}")
            for i, (x, edge) in enumerate(zip(inputs, node.edges, strict=True))
        ]

    node = tape.node(name, rule, inputs, saved=list(saves))
    return tape.output(tape.new(numel, FP32, name), node)


def _leaf(tape: Tape, name: str = "w", numel: int = N) -> Tensor:
    """A parameter alive before the replay (no event)."""
    return tape.existing(numel, FP32, name, "weight", leaf=True)


# ------------------------------------------------------------------------------ allocation


def test_round_block_rounds_up_to_512_and_keeps_zero() -> None:
    # max(512, ceil(n/512)*512) for n > 0, and 0 for an empty tensor.
    assert round_block(1) == 512
    assert round_block(511) == 512
    assert round_block(512) == 512
    assert round_block(513) == 1024
    assert round_block(1024) == 1024
    assert round_block(1025) == 1536
    assert round_block(0) == 0


def test_round_block_symbolic_agrees_with_int() -> None:
    n = sp.Symbol("n", positive=True, integer=True)
    expr = round_block(n)
    for value in (1, 511, 512, 513, 1025, 4096):
        assert int(expr.subs(n, value)) == round_block(value)


def test_new_charges_rounded_bytes_and_empty_tensor_is_free() -> None:
    tape = Tape()
    tape.new(1, 1, "one_byte")  # 1 B -> 512
    tape.new(513, 1, "odd")  # 513 B -> 1024
    tape.new(0, 4, "empty")  # 0 B -> nothing, and no event
    tape.new(3, 4, "three_floats")  # 12 B -> 512
    assert _trace(tape) == [("+one_byte", 512), ("+odd", 1536), ("+three_floats", 2048)]
    assert _live(tape) == 2048


def test_view_allocates_nothing_and_keeps_its_base_alive() -> None:
    tape = Tape()
    x = tape.new(N, FP32, "x")  # K
    v = tape.alias(x)  # a view: same storage, no event
    assert len(tape.events) == 1
    assert _live(tape) == K
    tape.drop(x)  # the base's Python reference dies; the view still holds the storage
    assert _live(tape) == K
    assert len(tape.events) == 1
    tape.drop(v)  # last reference: freed
    assert _trace(tape) == [("+x", K), ("-x", 0)]


def test_existing_storages_make_no_event() -> None:
    tape = Tape()
    _leaf(tape)
    tape.existing(10, 8, "ids", "input")  # 80 B -> 512
    assert tape.events == []
    assert _live(tape) == K + 512


# ------------------------------------------------------------------------------ saved tensors


def test_saved_tensor_outlives_its_python_reference_until_backward_frees_it() -> None:
    # Forward: w (leaf, K, pre-existing); a = A(w) saves nothing; b = B(a) saves a.
    tape = Tape()
    w = _leaf(tape)
    a = _op(tape, "a", [w])
    b = _op(tape, "b", [a], saves=(a,))
    tape.drop(a)  # Python's `a` dies; B's saved variable keeps the storage
    assert _live(tape) == 3 * K  # w, a, b
    # +grad_seed (ones_like(b), K)            w a b seed          4K
    # B runs: +db.0 (grad of a)              w a b seed db.0      5K
    #   drop its incoming grad (a view of seed, Python holds seed): nothing freed
    #   release_variables: a's last holder -> -a                  4K
    # A runs: +da.0 (grad of w)                                   5K
    #   drop its incoming grad db.0 -> -db.0                      4K
    # AccumulateGrad steals da.0 as w.grad (no event); seed dropped at the end -> 3K
    assert _backward_trace(tape, b) == [
        ("+grad_seed", 4 * K),
        ("+db.0", 5 * K),
        ("-a", 4 * K),
        ("+da.0", 5 * K),
        ("-db.0", 4 * K),
        ("-grad_seed", 3 * K),
    ]


def test_unsaved_tensor_dies_with_its_python_reference() -> None:
    tape = Tape()
    w = _leaf(tape)
    a = _op(tape, "a", [w])
    _op(tape, "b", [a])  # saves nothing
    tape.drop(a)
    assert _trace(tape)[-1] == ("-a", 2 * K)  # w, b


def test_no_grad_mode_saves_nothing() -> None:
    tape = Tape()
    tape.grad_enabled = False
    w = _leaf(tape)
    a = _op(tape, "a", [w])
    b = _op(tape, "b", [a], saves=(a,))
    assert b.grad_fn is None
    tape.drop(a)  # not saved: freed at once
    assert _live(tape) == 2 * K  # w, b


# ------------------------------------------------------------------------------ engine order


def test_backward_runs_ready_nodes_highest_sequence_number_first() -> None:
    # p = P(x) is created first (seq 1), then q1 = Q1(x) (seq 2), q2 = Q2(q1) (seq 3), and the
    # root r = R(q2, p) (seq 4). After R both P (1) and Q2 (3) are ready: Q2 runs. Then P (1)
    # and Q1 (2) are ready: Q1 runs before P. A FIFO over R's edges would run P second; a
    # LIFO would run P first. The engine's order: R, Q2, Q1, P.
    tape = Tape()
    x = _leaf(tape)
    log: list[str] = []
    p = _op(tape, "P", [x], log=log)
    q1 = _op(tape, "Q1", [x], log=log)
    q2 = _op(tape, "Q2", [q1], log=log)
    r = _op(tape, "R", [q2, p], log=log)
    assert [p.grad_fn.seq, q1.grad_fn.seq, q2.grad_fn.seq, r.grad_fn.seq] == [1, 2, 3, 4]
    tape.backward(r)
    assert log == ["R", "Q2", "Q1", "P"]


def test_accumulate_grad_runs_as_soon_as_ready() -> None:
    # y = Y(w1, w2) with two leaves, then root z = Z(y). Z's grad reaches Y; Y hands one grad to
    # each leaf's AccumulateGrad (sequence number 2**62): both run before any other node, and
    # steal their gradient without a copy: the live bytes at the end are w1, w2, y, z + 2 grads.
    tape = Tape()
    w1, w2 = _leaf(tape, "w1"), _leaf(tape, "w2")
    y = _op(tape, "y", [w1, w2])
    z = _op(tape, "z", [y])
    tape.backward(z)
    assert _live(tape) == 6 * K
    assert sorted(g.name for g in tape.grads.values()) == ["grad:w1", "grad:w2"]
    labels = [label for label, _ in _trace(tape)]
    assert "+grad:w1" not in labels and "+grad:w2" not in labels  # stolen, not copied


# ------------------------------------------------------------------------------ InputBuffer


def _diamond(tape: Tape) -> Tensor:
    """x leaf; m = M(x) (seq 1); p = P(m) (seq 2); q = Q(m) (seq 3); r = p + q (seq 4), whose
    backward hands a *view of its incoming gradient* to both operands (like ``add``)."""
    x = _leaf(tape, "x")
    m = _op(tape, "m", [x])
    p = _op(tape, "p", [m])
    q = _op(tape, "q", [m])

    def add_rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.alias(grads[0]), tape.alias(grads[0])]

    node = tape.node("Add", add_rule, [p, q])
    r = tape.output(tape.new(N, FP32, "r"), node)
    tape.drop(m, p, q)  # nothing saved: all three die; live: x, r
    return r


# Forward leaves x, r (2K). Backward, in place (InputBuffer unshared, no dispatch mode):
#   +grad_seed                                      3K
#   Add hands views of the seed to P and Q (no allocation)
#   Q (seq 3): +dq.0 (grad of m): M's buffer = dq.0              4K
#   P (seq 2): +dp.0                                             5K
#     M's buffer holds dq.0, unshared -> dq.0.add_(dp.0): -dp.0  4K
#   M: +dm.0 (grad of x) 5K, its incoming dq.0 dropped 4K; AccumulateGrad steals dm.0
#   -grad_seed: x, r, grad:x                                     3K
# Out of place (under a dispatch mode): as above up to +dp.0 (5K); then old + new: +grad_sum
# 6K, -dq.0 5K, -dp.0 4K; M runs on grad_sum: +dm.0 5K, -grad_sum 4K; -grad_seed 3K. One block
# of K more at the peak.
@pytest.mark.parametrize(
    ("inplace", "expected"),
    [
        pytest.param(
            True,
            [("+grad_seed", 3 * K), ("+dq.0", 4 * K), ("+dp.0", 5 * K), ("-dp.0", 4 * K),
             ("+dm.0", 5 * K), ("-dq.0", 4 * K), ("-grad_seed", 3 * K)],
            id="in-place-when-unshared",
        ),
        pytest.param(
            False,
            [("+grad_seed", 3 * K), ("+dq.0", 4 * K), ("+dp.0", 5 * K), ("+grad_sum", 6 * K),
             ("-dq.0", 5 * K), ("-dp.0", 4 * K), ("+dm.0", 5 * K), ("-grad_sum", 4 * K),
             ("-grad_seed", 3 * K)],
            id="out-of-place-under-a-dispatch-mode",
        ),
    ],
)  # fmt: skip
def test_input_buffer_sums_two_gradients(inplace: bool, expected: list) -> None:
    tape = Tape(inplace_accumulate=inplace)
    assert _backward_trace(tape, _diamond(tape)) == expected


def test_input_buffer_sums_out_of_place_when_the_buffered_gradient_is_shared() -> None:
    # x leaf; m = M(x); p = P(m) (seq 2); r = m + p (seq 3) with add's view-of-grad backward.
    # M's buffer first receives a view of the seed (Python also holds the seed: shared), so
    # P's gradient is summed out of place even with inplace_accumulate=True:
    #   forward live: x, r (m, p die)               2K
    #   +grad_seed                                  3K
    #   Add: M's buffer = view(seed); P gets view(seed)
    #   P: +dp.0 4K; old (seed view) shared -> +grad_sum 5K; the view dropped (seed stays);
    #      -dp.0 4K
    #   M: +dm.0 5K, -grad_sum 4K; -grad_seed 3K
    tape = Tape(inplace_accumulate=True)
    x = _leaf(tape, "x")
    m = _op(tape, "m", [x])
    p = _op(tape, "p", [m])

    def add_rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.alias(grads[0]), tape.alias(grads[0])]

    r = tape.output(tape.new(N, FP32, "r"), tape.node("Add", add_rule, [m, p]))
    tape.drop(m, p)
    assert _backward_trace(tape, r) == [
        ("+grad_seed", 3 * K),
        ("+dp.0", 4 * K),
        ("+grad_sum", 5 * K),
        ("-dp.0", 4 * K),
        ("+dm.0", 5 * K),
        ("-grad_sum", 4 * K),
        ("-grad_seed", 3 * K),
    ]


# ------------------------------------------------------------------------------ AccumulateGrad


def test_accumulate_grad_steals_an_unshared_first_gradient() -> None:
    # y = Y(w); backward allocates dy.0 (K) for w; AccumulateGrad makes it w.grad: renamed
    # grad:w, kind "grad", no copy. End: w, y, grad:w = 3K.
    tape = Tape()
    w = _leaf(tape)
    y = _op(tape, "y", [w])
    tape.backward(y)
    (g,) = tape.grads.values()
    assert (g.name, g.storage.kind, g.size) == ("grad:w", "grad", K)
    assert [label for label, _ in _trace(tape)] == ["+y", "+grad_seed", "+dy.0", "-grad_seed"]
    assert _live(tape) == 3 * K


def test_accumulate_grad_copies_a_shared_first_gradient() -> None:
    # y = w + 0 (add: backward hands on a view of the seed, which Python holds): AccumulateGrad
    # cannot steal it and allocates w.grad (K). End: w, y, grad:w = 3K, the seed freed.
    tape = Tape()
    w = _leaf(tape)

    def pass_rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.alias(grads[0])]

    y = tape.output(tape.new(N, FP32, "y"), tape.node("Add", pass_rule, [w]))
    tape.backward(y)
    assert _trace(tape) == [
        ("+y", 2 * K),
        ("+grad_seed", 3 * K),
        ("+grad:w", 4 * K),
        ("-grad_seed", 3 * K),
    ]


def test_accumulate_grad_adds_later_gradients_in_place() -> None:
    # Two backward passes over y = Y(w) without zero_grad: the second dy.0 is added into the
    # existing w.grad and freed with the node's inputs; w.grad keeps its storage.
    tape = Tape()
    w = _leaf(tape)
    y = _op(tape, "y", [w])
    tape.backward(y)
    first = next(iter(tape.grads.values())).storage
    y2 = _op(tape, "y2", [w])
    tape.phase = "second"
    tape.backward(y2)
    assert next(iter(tape.grads.values())).storage is first
    # w, y, grad:w (3K); +y2 4K; +seed 5K; +dy2.0 6K, dropped after AccumulateGrad 5K; -seed 4K
    assert _trace(tape, "second") == [
        ("+grad_seed", 5 * K),
        ("+dy2.0", 6 * K),
        ("-dy2.0", 5 * K),
        ("-grad_seed", 4 * K),
    ]


# A tied embedding/head: e = E(w) (seq 1); y = H(e, w) (seq 2). w's AccumulateGrad has two
# incoming edges, so it runs only after both E and H: their two gradients of w meet in its
# InputBuffer first. Forward live: w, e (not saved, but Python keeps it), y = 3K.
# In place:
#   +grad_seed 4K
#   H: +dH.0 (grad of e) 5K, +dH.1 (grad of w) 6K; AccumulateGrad's buffer = dH.1
#   E: +dE.0 (grad of w) 7K, -dH.0 6K; buffer holds dH.1 unshared: in place, -dE.0 5K
#   AccumulateGrad (now ready) steals dH.1 as grad:w; -grad_seed 4K (w, e, y, grad:w)
# Out of place: E's gradient of w and the buffered dH.1 are summed into a new grad_sum, which
# AccumulateGrad then steals (one grad:w, no copy of it):
#   +grad_seed 4K; H: +dH.0 5K, +dH.1 6K
#   E: +dE.0 7K, -dH.0 6K (its incoming grad), then the sum: +grad_sum 7K, -dH.1 6K, -dE.0 5K
#   AccumulateGrad steals grad_sum; -grad_seed 4K
@pytest.mark.parametrize(
    ("inplace", "expected"),
    [
        pytest.param(
            True,
            [("+grad_seed", 4 * K), ("+dH.0", 5 * K), ("+dH.1", 6 * K), ("+dE.0", 7 * K),
             ("-dH.0", 6 * K), ("-dE.0", 5 * K), ("-grad_seed", 4 * K)],
            id="summed-in-place-before-accumulate-grad",
        ),
        pytest.param(
            False,
            [("+grad_seed", 4 * K), ("+dH.0", 5 * K), ("+dH.1", 6 * K), ("+dE.0", 7 * K),
             ("-dH.0", 6 * K), ("+grad_sum", 7 * K), ("-dH.1", 6 * K), ("-dE.0", 5 * K),
             ("-grad_seed", 4 * K)],
            id="summed-out-of-place-then-stolen",
        ),
    ],
)  # fmt: skip
def test_tied_leaf_gradients(inplace: bool, expected: list) -> None:
    tape = Tape(inplace_accumulate=inplace)
    w = _leaf(tape)
    e = _op(tape, "E", [w])
    y = _op(tape, "H", [e, w])
    assert _backward_trace(tape, y) == expected
    (g,) = tape.grads.values()
    assert (g.name, g.size) == ("grad:w", K)


def test_zero_grad_frees_the_gradients() -> None:
    tape = Tape()
    w = _leaf(tape)
    y = _op(tape, "y", [w])
    tape.backward(y)
    assert _live(tape) == 3 * K
    tape.zero_grad()
    assert tape.grads == {}
    assert _live(tape) == 2 * K


# ------------------------------------------------------------------------------ checkpoint


def _region(tape: Tape, x: Tensor, log: list[str]) -> Tensor:
    """u = S1(x) saving x; v = S2(u) saving u; u dies at the end of the function."""
    u = _op(tape, "u", [x], saves=(x,), log=log)
    v = _op(tape, "v", [u], saves=(u,), log=log)
    tape.drop(u)
    return v


def _checkpoint_graph(checkpointed: bool) -> tuple[Tape, Tensor, list[str]]:
    """w leaf; x = A(w); v = region(x), checkpointed or not; then Python drops x."""
    tape = Tape()
    log: list[str] = []
    w = _leaf(tape)
    x = _op(tape, "x", [w], log=log)
    if checkpointed:
        v = tape.checkpoint(lambda: _region(tape, x, log), [x])
    else:
        v = _region(tape, x, log)
    tape.drop(x)
    return tape, v, log


def test_checkpoint_forward_keeps_no_saved_tensor() -> None:
    # Without checkpoint the forward ends with w, x (saved by S1), u (saved by S2), v: 4K.
    # With it, S1 and S2 save placeholders; u dies when the function drops it; the checkpoint
    # frame holds its input x: w, x, v = 3K.
    plain, _, _ = _checkpoint_graph(checkpointed=False)
    ckpt, _, _ = _checkpoint_graph(checkpointed=True)
    assert _live(plain) == 4 * K
    assert _live(ckpt) == 3 * K
    # The forward itself allocated the same tensors: +x 2K, +u 3K, +v 4K, -u (ckpt only) 3K.
    assert _trace(ckpt) == [("+x", 2 * K), ("+u", 3 * K), ("+v", 4 * K), ("-u", 3 * K)]


_AFTER_RECOMPUTATION = [
    ("+dv.0", 6 * K),
    ("-u", 5 * K),
    ("+du.0", 6 * K),
    ("-dv.0", 5 * K),
    ("-x", 4 * K),
    ("+dx.0", 5 * K),
    ("-du.0", 4 * K),
    ("-grad_seed", 3 * K),
]
"""The backward of `_checkpoint_graph`'s region from 5K, u held (kept, recomputed or saved)
and no second v: S2's formula, the release of u, S1's, the frame's x, then A and the seed."""


def test_checkpoint_backward_recomputes_saved_tensors_and_frees_them() -> None:
    # Backward of the checkpointed graph (forward end: w, x, v = 3K):
    #   +grad_seed                                                         4K
    #   S2 (seq 3) is the region's first node to run: recompute. S1's node saves x (1 of 2),
    #   +u (the recomputed u) 5K; S2's node saves u (2 of 2): early stop, v is not remade.
    #   S2's formula: +dv.0 (grad of u) 6K; its locals die: the recomputed u -> -u 5K
    #   S1: +du.0 (grad of x) 6K; x's saved reference released (the frame still holds x);
    #       -dv.0 5K; the region's last node done: the frame drops x -> -x 4K
    #   A: +dx.0 (grad of w) 5K, -du.0 4K; AccumulateGrad steals dx.0; -grad_seed 3K
    tape, v, log = _checkpoint_graph(checkpointed=True)
    assert _backward_trace(tape, v) == [("+grad_seed", 4 * K), ("+u", 5 * K), *_AFTER_RECOMPUTATION]
    assert log == ["v", "u", "x"]  # each node's backward once, recomputation included
    assert _live(tape) == 3 * K  # w, v, grad:w


def test_checkpoint_without_early_stop_recomputes_the_whole_function() -> None:
    # checkpoint(early_stop=False) (torchtitan's wrapper): after S2's node saves u (2 of 2)
    # the recomputation goes on: +v (the recomputed output) 6K, the function returns, and its
    # leftover v dies -> -v 5K; the rest is the early-stop trace.
    tape = Tape()
    log: list[str] = []
    w = _leaf(tape)
    x = _op(tape, "x", [w], log=log)
    v = tape.checkpoint(lambda: _region(tape, x, log), [x], early_stop=False)
    tape.drop(x)
    assert _live(tape) == 3 * K
    assert _backward_trace(tape, v) == [
        ("+grad_seed", 4 * K),
        ("+u", 5 * K),
        ("+v", 6 * K),
        ("-v", 5 * K),
        *_AFTER_RECOMPUTATION,
    ]


def _mm(tape: Tape, name: str, inputs: list[Tensor], saves: tuple[Tensor, ...]) -> Tensor:
    """`_op` whose output is an ``mm`` call's (`Tape.op_outputs`)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.new(x.numel, x.itemsize, f"d{name}.{i}") for i, x in enumerate(inputs)]

    node = tape.node(name, rule, inputs, saved=list(saves))
    (out,) = tape.op_outputs("mm", lambda: [tape.new(N, FP32, name)])
    assert out is not None
    return tape.output(out, node)


def _op_checkpoint_graph() -> tuple[Tape, Tensor]:
    """w leaf; x = A(w); v = region(x) checkpointed by op, keeping the first mm's output:
    u = mm(x) saving x, v = mm(u) saving u, u dropped by the function; then Python drops x."""
    tape = Tape()
    w = _leaf(tape)
    x = _op(tape, "x", [w])

    def region() -> Tensor:
        u = _mm(tape, "u", [x], saves=(x,))
        v = _mm(tape, "v", [u], saves=(u,))
        tape.drop(u)
        return v

    v = tape.checkpoint(region, [x], early_stop=False, policy=lambda op, n: n == 1)
    tape.drop(x)
    return tape, v


def test_op_checkpoint_keeps_the_saved_ops_outputs_through_the_forward() -> None:
    # The policy's storage keeps u (MUST_SAVE) after the function drops it: w, x (the frame's
    # input), u, v = 4K, where the whole-function checkpoint ends with 3K.
    tape, _ = _op_checkpoint_graph()
    assert _trace(tape) == [("+x", 2 * K), ("+u", 3 * K), ("+v", 4 * K)]
    assert _live(tape) == 4 * K


def test_op_checkpoint_recomputation_takes_the_kept_output() -> None:
    # +grad_seed 5K; the recomputation's first mm takes u from the policy's storage (no
    # event; S1 saves x), the second runs: +v 6K (S2 saves u), the leftover v dies -> -v 5K;
    # then as after a whole-function recomputation: +dv.0 6K, u released -> -u 5K, +du.0 6K,
    # -dv.0 5K, the frame's x -> -x 4K, +dx.0 5K, -du.0 4K, -grad_seed 3K.
    tape, v = _op_checkpoint_graph()
    assert _backward_trace(tape, v) == [
        ("+grad_seed", 5 * K),
        ("+v", 6 * K),
        ("-v", 5 * K),
        *_AFTER_RECOMPUTATION,
    ]
    assert _live(tape) == 3 * K  # w, v, grad:w


def test_op_checkpoint_needs_the_whole_recomputation() -> None:
    # An early stop would leave kept outputs the recomputation never took: refused.
    tape = Tape()
    x = _leaf(tape)
    with pytest.raises(NotImplementedError, match="early stop"):
        tape.checkpoint(lambda: x, [x], policy=lambda op, n: True)


def test_plain_backward_of_the_same_graph_for_contrast() -> None:
    # Forward end w, x, u, v (4K); +grad_seed 5K; S2: +dv.0 6K, release u -> -u 5K;
    # S1: +du.0 6K, -dv.0 5K, release x -> -x 4K; A: +dx.0 5K, -du.0 4K; -grad_seed 3K.
    tape, v, _ = _checkpoint_graph(checkpointed=False)
    assert _backward_trace(tape, v) == [("+grad_seed", 5 * K), *_AFTER_RECOMPUTATION]
