"""How bitsandbytes lays out its Adam optimizers' states (bitsandbytes/optim/optimizer.py,
``Optimizer8bit`` and ``Optimizer2State``, at commit 51294d9, the releases with AdEMAMix: 0.44
on). Read by the hand-written optimizer replay (`calc.step.optimizer`) and by the recording's
stand-in optimizer (`calc.derive.bnb`)."""

from __future__ import annotations

BNB_OPTIMIZERS = ("adam8bit", "adam32bit")
"""calc's names of bitsandbytes' ``Adam8bit``/``AdamW8bit`` and ``Adam32bit``/``AdamW32bit``:
states made by ``init_state``, updated in place by one kernel."""
BNB_BLOCK = 256
"""Elements per absmax block of the blockwise 8-bit states: ``blocks = n // 256`` (+1 for a
remainder) in ``Optimizer2State.init_state``; older releases used 2048 (commit 06029dd): one
fp32 absmax per 2048 elements, 0.2 % of an 8-bit state instead of 1.6 %."""
BNB_MIN_8BIT_SIZE = 4096
"""``min_8bit_size``: smaller params keep fp32 states."""
BNB_PAGED_MIN_NUMEL = 100_000
"""A paged optimizer puts ``state1``/``state2`` in CUDA managed memory only for params of at
least this many elements (``get_state_buffer``: ``if not self.is_paged or p.numel() < 1e5:
torch.zeros_like(...)`` else ``F.get_paged``)."""
BNB_QMAP_NUMEL = 256
"""Entries of each dynamic quantisation map (fp32)."""
