"""torchtune's QLoRA base on torchao's NF4Tensor (`verify.models.torchao_nf4`): what it computes
and what the CPU tracker counts of it, against torchao's own functions and hand-derived bytes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from torch import nn  # noqa: E402
from torchao.dtypes.nf4tensor import NF4Tensor  # noqa: E402

from verify.models.torchao_nf4 import NF4Base  # noqa: E402
from verify.run.runner import CpuMeter  # noqa: E402


def test_the_base_is_a_frozen_nf4_tensor_and_computes_with_its_dequantized_weight():
    torch.manual_seed(0)
    dense = nn.Linear(256, 64, bias=False, dtype=torch.bfloat16)
    base = NF4Base(dense)
    assert isinstance(base.weight, NF4Tensor)
    assert not base.weight.requires_grad
    assert [p for p in base.parameters() if p.requires_grad] == []
    x = torch.randn(2, 8, 256, dtype=torch.bfloat16, requires_grad=True)
    out = base(x)
    expected = x @ base.weight.get_original_weight().t()
    assert torch.equal(out, expected)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_the_meter_counts_every_storage_of_the_model_also_the_nf4_table():
    # a 64 x 256 fp32 weight, 16,384 elements: quantized_data 8,192 B; quantized_scalers 256
    # int8 (one 512-B block); quantization_factor keeps its 256-entry fp32 storage (1,024 B: one
    # scaler block, ``.contiguous()`` copies nothing); scaler_mean 4 B and the 16-entry fp32
    # table (64 B), one block each. The table is made by ``torch.tensor``, which the tracker
    # would otherwise treat as late and leave out (10,240 B).
    meter = CpuMeter()
    ids = torch.zeros(1, dtype=torch.long)
    with meter.tracker as tracker:
        base = NF4Base(nn.Linear(256, 64, bias=False))
        meter.setup_done(base, None, ids, None)
        assert tracker.peak_bytes == 8_192 + 512 + 1_024 + 512 + 512
