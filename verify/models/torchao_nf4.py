"""torchtune's QLoRA base linear on torchao's real ``NF4Tensor`` (torchao is a verify dependency).

torchtune 0.6.1's ``FrozenNF4Linear`` (``torchtune/modules/low_precision/nf4_linear.py``) and
the frozen base of its ``LoRALinear(quantize_base=True)`` (``torchtune/modules/peft/lora.py``)
both hold ``to_nf4(weight)`` as a frozen parameter and run ``linear_nf4(input=x,
weight=self.weight)``; the adapters of ``LoRALinear`` follow (`verify.models.compress`'s
``LoRALinear`` runs the same ops around this base: ``out`` first, then ``lora_b(lora_a(x))``
times ``alpha / rank``, the sum). torchtune itself does not import here without its data
stack (datasets, torchdata), so `NF4Base` stands for both, on torchao's own functions: what
decides memory (the stored ``NF4Tensor`` and ``linear_nf4``'s dequantizations) is torchao's code.
"""

from __future__ import annotations

import torch
from torch import nn


class NF4Base(nn.Module):
    """A frozen linear whose weight is ``torchao.dtypes.nf4tensor.to_nf4(linear.weight)``
    (blocks of 64, scaler blocks of 256), run by ``linear_nf4``; no bias (torchtune's Llama
    linears have none)."""

    def __init__(self, linear: nn.Linear) -> None:
        from torchao.dtypes.nf4tensor import to_nf4

        super().__init__()
        if linear.bias is not None:
            raise NotImplementedError("torchtune's QLoRA base with a bias")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = to_nf4(linear.weight.detach())
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.dtypes.nf4tensor import linear_nf4

        return linear_nf4(input=x, weight=self.weight)
