"""FSDP1 written by hand (`calc.parallel.fsdp1`): the flat layout, each rank's views, and the
events of a unit, by hand from ``torch/distributed/fsdp/_flat_param.py``. The whole step is
checked against torchrun ranks by the ``dist-lit-fsdp1-*`` verify cases (LitGPT's model under
Lightning's FSDPStrategy)."""

from __future__ import annotations

import sympy as sp

from calc.parallel.fsdp1 import Fsdp1, flat_layout, local_numel
from calc.replay.tape import Tape


def test_each_parameter_starts_16_byte_aligned_and_the_total_splits_evenly() -> None:
    # bf16: 8 elements to 16 bytes; 5 then 3 then 8 elements start at 0, 8, 16; 24 elements
    # split over 2 ranks as they are, over 5 padded to 25
    assert flat_layout([5, 3, 8], 2, 2) == ([0, 8, 16], 24)
    assert flat_layout([5, 3, 8], 2, 5) == ([0, 8, 16], 25)
    # fp32: 4 elements to 16 bytes; 5 and 3 start at 0 and 8, 11 elements padded to 12
    assert flat_layout([5, 3], 4, 2) == ([0, 8], 12)


def test_a_rank_holds_the_part_of_each_parameter_inside_its_piece() -> None:
    # pieces of 12 elements: rank 0 [0, 12), rank 1 [12, 24)
    assert local_numel(8, 3, 12, 0) == 3 and local_numel(8, 3, 12, 1) == 0
    assert local_numel(10, 5, 12, 0) == 2 and local_numel(10, 5, 12, 1) == 3
    h = sp.Symbol("h", positive=True, integer=True)
    assert local_numel(h, h, 3 * h, 0).subs(h, 4) == 4  # the same with symbolic sizes
    assert local_numel(2 * h, 2 * h, 3 * h, 0).subs(h, 4) == 4  # [8, 16) in [0, 12)


def _live(tape: Tape) -> int:
    return sum(int(st.size) for st in tape.live.values())


def test_a_block_is_gathered_for_its_forward_the_root_until_its_backward() -> None:
    # a block of 1,000 bf16 elements and a root of 600, 2 ranks: shards of 1,000 and 600 B
    # (512-byte blocks: 1,024 and 1,024); unsharded 2,000 B (2,048) and 1,200 B (1,536)
    tape = Tape()
    block = tape.existing(1000, 2, "w", "weight", leaf=True, tag=0)
    root = tape.existing(600, 2, "head", "weight", leaf=True, tag="head")
    fsdp = Fsdp1(2)
    fsdp.install(tape, [root, block], [(600,), (1000,)])
    assert _live(tape) == 1024 + 1024  # the leaves' own storages are hidden
    tape.phase = "step1/forward"
    fsdp.start_forward(tape)
    assert _live(tape) == 2048 + 1536  # the root gathered
    tape.segment = 0
    assert _live(tape) == 2048 + 1536 + 2048  # the block's pre-forward
    tape.segment = "head"
    assert _live(tape) == 2048 + 1536  # its post-forward; the root stays
    fsdp.end_forward(tape)
    assert _live(tape) == 2048 + 1536


def test_no_sync_keeps_the_flat_gradient_and_the_last_micro_batch_reduces_it() -> None:
    # the block's backward left: cat to a flat gradient (2,048), the gathered block freed;
    # under no_sync the flat gradient stays; syncing, a new one is added to it in place, then
    # the sharded gradient (1,024) is made and the flat one goes
    tape = Tape()
    block = tape.existing(1000, 2, "w", "weight", leaf=True, tag=0)
    fsdp = Fsdp1(2)
    fsdp.install(tape, [block], [(1000,)])
    for sync, kept in ((False, 2048), (True, 1024)):
        tape.phase = "step1/forward"
        tape.segment = 0
        tape.segment = "head"
        tape.phase = "step1/backward"
        fsdp.sync = sync
        tape.grad_enabled = False
        fsdp.start_backward(tape)
        tape.segment = 0
        tape.grads[id(block.storage)] = tape.new(1000, 2, "grad:w", "grad", 0)
        tape.segment = "embed"  # the block's post-backward
        tape.grad_enabled = True
        assert _live(tape) == 1024 + kept
