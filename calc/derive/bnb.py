"""bitsandbytes' Adam optimizers in the recording: the states ``init_state`` makes, nothing else.

bitsandbytes' ``Adam8bit``/``Adam32bit`` (and their paged forms) update every parameter with one
CUDA kernel that writes the parameter and its states in place (``optimizer_update_8bit_
blockwise``/``optimizer_update_32bit``): the step allocates nothing. What it holds are the
states ``Optimizer2State.init_state`` makes on a parameter's first step (bitsandbytes/optim/
optimizer.py at commit 51294d9): fp32 ``state1``/``state2`` for ``optim_bits=32`` or a param of
fewer than ``min_8bit_size`` (4096) elements, else uint8 ``state1``/``state2`` and fp32
``absmax1``/``absmax2`` per 256 elements; ``get_state_buffer`` puts a paged optimizer's
``state1``/``state2`` of a param of 100,000 elements or more in CUDA managed memory, outside
PyTorch's allocator (left out here: nothing is made for them). The thresholds are
`calc.data.bitsandbytes`'. The recording runs on the CPU,
so the quantisation maps bitsandbytes copies to the GPU once per optimizer (2 KiB) are not made.

`bnb_adam_class` is the optimizer the recorder steps; its update changes no value (the
recording runs on fake tensors: values do not matter, allocations do). torch is imported only
inside it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from calc.data.bitsandbytes import BNB_BLOCK, BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL


@lru_cache(maxsize=1)
def bnb_adam_class() -> Any:
    """``BnbAdam(params, optim_bits, paged)``: the class (made on first use)."""
    import torch

    class BnbAdam(torch.optim.Optimizer):
        """The states of bitsandbytes' Adam (see the module docstring); an in-place step."""

        def __init__(self, params: Any, optim_bits: int, paged: bool) -> None:
            super().__init__(params, {"lr": 1e-3})
            self.optim_bits = optim_bits
            self.paged = paged

        def _init_state(self, p: Any) -> None:
            state = self.state[p]
            state["step"] = 0
            n = p.numel()
            outside = self.paged and n >= BNB_PAGED_MIN_NUMEL
            if self.optim_bits == 32 or n < BNB_MIN_8BIT_SIZE:
                if not outside:
                    state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                    state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                return
            if not outside:
                state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
            blocks = -(-n // BNB_BLOCK)
            state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            for p in stepped:  # Optimizer8bit.step: init_state on the first step, then the
                state = self.state[p]  # kernel, which updates p and the states in place
                if not state:
                    self._init_state(p)
                state["step"] += 1
            return None

    return BnbAdam
