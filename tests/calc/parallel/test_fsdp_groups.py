"""FSDP2's all-gather of a group whose inputs have several dtypes (`calc.parallel.fsdp`):
``foreach_all_gather`` views every input as uint8 (torch 2.13
``_fsdp_collectives.py``), so the output is the world size times the inputs' bytes. Expected
values by hand, in 512-byte blocks."""

from __future__ import annotations

from calc.parallel.fsdp import Fsdp
from calc.replay.tape import Tape


def _live(tape: Tape) -> int:
    return sum(int(st.size) for st in tape.live.values())


def test_a_bf16_base_and_fp32_adapters_gather_as_bytes() -> None:
    # layer 0: a frozen bf16 [512, 512] weight and fp32 adapters A [8, 512], B [512, 8], on 2
    # ranks: shards 256 x 512 x 2 = 262,144 B, 4 x 512 x 4 = 8,192 B, 256 x 8 x 4 = 8,192 B
    tape = Tape()
    base = tape.existing(512 * 512, 2, "q_proj", "weight", tag=0)
    a = tape.existing(8 * 512, 4, "q.lora_A", "adapter", True, 0)
    b = tape.existing(512 * 8, 4, "q.lora_B", "adapter", True, 0)
    fsdp = Fsdp(2, reshard_after_forward=True)
    fsdp.install(tape, [base, a, b], [(512, 512), (8, 512), (512, 8)])
    assert _live(tape) == 262_144 + 8_192 + 8_192  # the shards alone at rest
    group = fsdp.groups[0]
    assert group.shard_bytes == 262_144 + 8_192 + 8_192
    fsdp._all_gather(tape, group)  # the all-gather output: 2 x 278,528 B, uint8
    assert _live(tape) == 278_528 + 2 * 278_528
    fsdp._copy_out(tape, group, keep=False)  # the unsharded parameters; the output freed
    assert _live(tape) == 278_528 + 2 * 262_144 + 2 * 8_192 + 2 * 8_192


def test_torchtitan_units_free_the_embedding_and_keep_the_head() -> None:
    # torchtitan's apply_fsdp on 2 ranks, fp32: embedding [1024, 64] (a unit), one layer
    # [64, 64], the final norm [64] with the head [1024, 64] (one unit, kept unsharded after
    # forward); the root holds no parameter. Shards: 131,072 + 8,192 + 512 (128 B) + 131,072
    # = 270,848 B at rest.
    tape = Tape()
    embed = tape.existing(1024 * 64, 4, "embed", "weight", True, "embed")
    layer = tape.existing(64 * 64, 4, "wq", "weight", True, 0)
    norm = tape.existing(64, 4, "norm", "weight", True, "head")
    head = tape.existing(1024 * 64, 4, "output", "weight", True, "head")
    fsdp = Fsdp(2, reshard_after_forward=True, own_units=True)
    shapes = [(1024, 64), (64, 64), (64,), (1024, 64)]
    fsdp.install(tape, [embed, layer, norm, head], shapes)
    assert set(fsdp.groups) == {"embed", 0, "head"}
    assert _live(tape) == 270_848
    tape.phase = "step1/forward"
    tape.segment = "embed"  # all-gather output 262,144 and the unsharded embedding 262,144
    assert _live(tape) == 270_848 + 2 * 262_144
    tape.segment = 0  # the embedding resharded, its all-gather output freed at the copy-out;
    assert _live(tape) == 270_848 + 16_384 + 16_384  # the layer's output and parameters
    tape.segment = "head"  # layer resharded; norm + head gathered: 2 x 131,200 -> 262,656
    assert _live(tape) == 270_848 + 262_656 + 512 + 262_144
    fsdp.end_forward(tape)  # the all-gather output freed; norm and head stay unsharded
    assert _live(tape) == 270_848 + 512 + 262_144
