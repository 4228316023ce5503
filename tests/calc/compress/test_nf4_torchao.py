"""torchtune's QLoRA on torchao's NF4Tensor, against hand derivations from torchao's code.

The expected numbers come from ``torchao/dtypes/nf4tensor.py`` (0.14) read line by line: the
five tensors ``to_nf4`` keeps and the temporaries of ``get_original_weight``, each rounded to
the allocator's 512-byte blocks.
"""

from __future__ import annotations

import pytest

import calc
from calc.compress import nf4_torchao
from calc.data.cards import load_card
from calc.replay.tape import Tape
from verify.cases.scale import scaled_spec


def _r512(n: int) -> int:
    return max(512, -(-n // 512) * 512)


def _live(tape: Tape) -> int:
    return sum(int(st.size) for st in tape.live.values())


def test_a_4096_square_bf16_weight_stores_its_five_tensors():
    # n = 4096 * 4096 = 16,777,216: quantized_data n/2 uint8; quantized_scalers n/64 int8
    # (262,144); quantization_factor n/64/256 = 1,024 bf16; scaler_mean one bf16; nf4 16 bf16
    n = 4096 * 4096
    got = {name: numel * size for name, numel, size, _ in nf4_torchao.stored(n, 2)}
    assert got == {
        "nf4.quantized_data": 8_388_608,
        "nf4.quantized_scalers": 262_144,
        "nf4.quantization_factor": 2_048,
        "nf4.scaler_mean": 2,
        "nf4.table": 32,
    }


def test_one_scaler_block_keeps_the_whole_factor_storage():
    # 16,384 elements: 256 blocks, one scaler block. ``256 / (2 * absmax)`` fills all 256
    # (expanded) entries; column 0 of a [1, 256] tensor viewed as [1] is contiguous, so
    # ``.contiguous()`` copies nothing and the factor keeps 256 fp32 = 1,024 bytes.
    (factor,) = [s for s in nf4_torchao.stored(16_384, 4) if s[0] == "nf4.quantization_factor"]
    assert factor[1] * factor[2] == 1_024
    # two scaler blocks copy out the two factors
    (factor,) = [s for s in nf4_torchao.stored(32_768, 4) if s[0] == "nf4.quantization_factor"]
    assert factor[1] * factor[2] == 8


def test_dequantizing_peaks_at_the_stack_with_every_local_alive():
    # 256 x 256 bf16 (n = 65,536): the int64 indices of both nibbles (n/2 * 8 = 262,144 each),
    # both table lookups (n/2 bf16 = 65,536 each), the scalers (n/64 bf16 = 2,048), both scaled
    # halves (65,536 each) and the stack (n bf16 = 131,072) are alive together; afterwards only
    # the stack is left.
    n = 65_536
    tape = Tape()
    peak = 0
    original_new = tape.new

    def new(*args, **kw):
        nonlocal peak
        t = original_new(*args, **kw)
        peak = max(peak, _live(tape))
        return t

    tape.new = new  # type: ignore[method-assign]
    weight = nf4_torchao.dequantize(tape, n, 2)
    assert peak == 2 * 262_144 + 4 * 65_536 + 2_048 + 131_072
    assert _live(tape) == 131_072
    assert not weight.dropped


def _qlora(**kw) -> calc.Training:
    base = dict(micro_batch=1, seq_len=64, precision="bf16", implementation="torchtune",
                loop="del-logits", lora=calc.LoRA(rank=8), quant=calc.Quant(method="nf4"))  # fmt: skip
    return calc.Training(**{**base, **kw})


def test_the_quantized_base_is_what_lora_keeps_in_16_bits_less_the_nf4_bytes():
    # the same job with and without quantize_base differs at the start of the step by the
    # decoder weights: each [out, in] dense bf16 weight (2 bytes/element) replaced by the five
    # NF4 tensors. llama-3.1-8b's layer: q, o 4096x4096; k, v 1024x4096; gate, up, down
    # 14336x4096.
    spec = load_card("llama-3.1-8b")
    qlora = calc.estimate(spec, _qlora(), device="cpu")
    lora = calc.estimate(spec, _qlora(quant=None), device="cpu")
    shapes = [(4096, 4096)] * 2 + [(1024, 4096)] * 2 + [(14336, 4096)] * 3
    dense = sum(_r512(o * i * 2) for o, i in shapes)
    nf4 = sum(_r512(numel * size) for o, i in shapes
              for _, numel, size, _ in nf4_torchao.stored(o * i, 2))  # fmt: skip
    assert lora.breakdown["weights"] - qlora.breakdown["weights"] == 32 * (dense - nf4)


def test_weights_torchao_cannot_quantize_are_refused_by_name():
    # the default scaled llama-3.1-8b: hidden 64, k/v 16 x 64 = 1,024 elements
    spec = scaled_spec("llama-3.1-8b")
    with pytest.raises(ValueError, match="16384"):
        calc.estimate(spec, _qlora(), device="cpu")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"quant": calc.Quant(method="int4")}, "to_nf4"),
        ({"quant": calc.Quant(method="nf4", double_quant=False)}, "double_quant=True"),
        ({"quant": calc.Quant(method="nf4", group_size=128)}, "group_size=64"),
    ],
)
def test_what_torchtune_does_not_run_is_refused(change, match):
    spec = scaled_spec("llama-3.1-8b", kv_heads=2, head_dim=32)
    with pytest.raises(NotImplementedError, match=match):
        calc.estimate(spec, _qlora(**change), device="cpu")


def test_qwen2_biases_are_refused():
    spec = scaled_spec("qwen2.5-0.5b", kv_heads=2, head_dim=64)  # the real widths, 2 layers
    with pytest.raises(NotImplementedError, match="bias"):
        calc.estimate(spec, _qlora(), device="cpu")


def test_fsdp2_keeps_each_ranks_inner_shards_and_gathers_their_bytes():
    # torchao's fsdp_pre_all_gather hands FSDP2 quantized_scalers, quantization_factor and
    # quantized_data; _init_sharded_param's torch.chunk (nf4_split) and new_zeros give each of
    # 2 ranks half of each: for 4096 x 4096 in bf16, data 4,194,304 B, scalers 131,072 B,
    # factor 512 x 2 = 1,024 B; scaler_mean and the table (512 B each) stay, shared.
    from calc.compress.quant import existing
    from calc.parallel.fsdp import Fsdp

    tape = Tape()
    qw = existing(tape, calc.Quant(method="nf4"), 4096, 4096, "bf16", 0, library="torchao")
    values = next(t for t in qw.stored if t.name == "nf4.quantized_data")
    tape.quantized[id(values.storage)] = qw
    inputs, shapes, unpadded = nf4_torchao.fsdp_inputs(tape, [values], [(4096, 4096)])
    assert sorted(t.name for t in inputs) == sorted(nf4_torchao.GATHERED)
    fsdp = Fsdp(2, reshard_after_forward=True)
    fsdp.install(tape, inputs, shapes, unpadded)
    assert _live(tape) == 4_194_304 + 131_072 + 1_024 + 512 + 512
    # the layer's all-gather output, as uint8: 2 ranks x (4,194,304 + 131,072 + 1,024) B
    assert 2 * fsdp.groups[0].shard_bytes == 8_652_800


def test_fsdp2_needs_every_inner_tensor_to_split_evenly():
    # k and v of this llama: 64 x 256 = 16,384 elements, one quantization factor: torchao's
    # nf4_split cannot give 2 ranks half of it
    spec = scaled_spec("llama-3.1-8b", kv_heads=2, head_dim=32)
    job = _qlora(loss="chunked-ce")
    with pytest.raises(ValueError, match="the k projection"):
        calc.estimate(spec, job, parallel=calc.Parallelism(dp=2, fsdp=True), device="cpu")
    calc.estimate(spec, job, device="cpu")  # one GPU: fine


def test_fsdp2_qlora_is_torchtunes_bitsandbytes_stays_refused():
    spec = scaled_spec("llama-3.1-8b", kv_heads=4, head_dim=32)
    fsdp = calc.Parallelism(dp=2, fsdp=True)
    # torchtune's recipe is estimated (verify's dist-torchtune-fsdp2-qlora-2 measures it)
    est = calc.estimate(spec, _qlora(loss="chunked-ce"), parallel=fsdp, device="cpu")
    assert est.rank_peaks.keys() == {0, 1}
    hf = calc.Training(micro_batch=1, seq_len=64, precision="bf16", lora=calc.LoRA(rank=8),
                       quant=calc.Quant(method="nf4"))  # fmt: skip
    with pytest.raises(NotImplementedError, match="torchtune"):
        calc.estimate(spec, hf, parallel=fsdp, device="cpu")
