"""The answer `calc.estimate` returns: the peak, where it happens, and what it is made of."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import sympy as sp

from calc.replay.caching_allocator import AllocatorConfig, AllocatorStats
from calc.units import GIB


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """Predicted memory of one step on the most-loaded GPU.

    ``peak_bytes`` is the predicted ``torch.cuda.max_memory_allocated()`` over the run on a GPU
    (``device="cuda"``), or what the CPU storage tracker measures (``device="cpu"``).
    """

    peak_bytes: int
    """Predicted peak of allocated bytes."""
    peak_phase: str
    """Phase of the step where the peak happens, e.g. ``step2/backward``."""
    peak_event: str
    """The allocation that makes the peak (a tensor name from the replay)."""
    breakdown_fn: Callable[[], Mapping[str, int]]
    """Builds the breakdown on demand (see ``breakdown``)."""
    phases: Mapping[str, int]
    """Peak bytes within each phase (``step1/forward``, ``step1/backward``, ...)."""
    expression_fn: Callable[[], sp.Expr]
    """Builds the peak formula on demand (see ``expression``)."""
    peak_expression_fn: Callable[[], sp.Expr]
    """Builds the formula of the allocation that is the peak (see ``peak_expression``)."""
    values: Mapping[sp.Symbol, int]
    """The symbol values this estimate was evaluated at."""
    device: str
    """``cuda`` or ``cpu``: which measurement the estimate predicts."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Assumptions that decided terms (SDPA kernel chosen, workspaces, ...)."""
    rank: int = 0
    """The most-loaded rank (global rank; 0 for one GPU): the one this estimate describes."""
    rank_peaks: Mapping[int, int] = field(default_factory=dict)
    """Peak bytes of every rank of a parallel job (empty for one GPU)."""
    allocator_fn: Callable[[AllocatorConfig | None], AllocatorStats] | None = None
    """Replays the step's alloc/free stream through the CUDA caching allocator (see
    ``reserved``); None where that is not modelled (CPU, several GPUs)."""
    paged_state_bytes: int = 0
    """A paged bitsandbytes optimizer's states in CUDA managed memory (``paged_optimizer``):
    outside PyTorch's allocator, so not in ``peak_bytes``; on the GPU until it runs short,
    then paged to the host (`calc.step.optimizer.paged_state_bytes`). 0 otherwise."""

    def reserved(self, config: AllocatorConfig | None = None) -> AllocatorStats:
        """The caching allocator's reserved bytes, allocated bytes and segments for this step
        (`calc.estimate.reserved`; ``config``: ``PYTORCH_CUDA_ALLOC_CONF`` settings, torch
        2.13's defaults when None). Slow (it replays every layer): computed on demand."""
        if self.allocator_fn is None:
            raise NotImplementedError(
                "reserved memory is modelled for one GPU with device='cuda' only"
            )
        return self.allocator_fn(config)

    @property
    def reserved_bytes(self) -> int:
        """``torch.cuda.max_memory_reserved()`` predicted with the default allocator settings;
        at least ``peak_bytes``."""
        return self.reserved().reserved_bytes

    @property
    def breakdown(self) -> Mapping[str, int]:
        """Slash-keyed tree of the bytes live at the peak; a parent is the sum of its children
        and ``total`` equals ``peak_bytes``."""
        return self.breakdown_fn()

    @property
    def expression(self) -> sp.Expr:
        """The peak as a sympy expression of the job and model symbols (``calc.symbols``):
        ``Max`` over the allocations that can be the peak, each a sum of rounded sizes."""
        return self.expression_fn()

    @property
    def peak_expression(self) -> sp.Expr:
        """The live bytes at the peak allocation, as a sympy sum of (count x rounded tensor
        size): the formula that gives ``peak_bytes`` at these ``values`` (``expression`` is the
        ``Max`` of such sums over every allocation that can be the peak)."""
        return self.peak_expression_fn()

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def latex(self, full: bool = False) -> str:
        """The peak formula in LaTeX: the peak allocation's sum, or with ``full=True`` the
        ``Max`` over all candidate allocations (long)."""
        return sp.latex(self.expression if full else self.peak_expression)
