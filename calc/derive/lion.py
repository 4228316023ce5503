"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 1), the
optimizer of ``Training(optimizer="lion")``: torch has none, so this one is the workload verify
steps (``verify/models/optimizers.py``) and the recording of a derived model steps.

Per parameter ``p`` with gradient ``g`` and momentum ``m`` (``exp_avg``, in the parameter's
dtype, made on the first step): ``p *= 1 - lr * wd``; ``u = sign(b1 * m + (1 - b1) * g)``;
``p -= lr * u``; ``m = b2 * m + (1 - b2) * g``, as lucidrains' ``lion-pytorch`` writes it. The
update ``u`` is the one temporary, on purpose explicit: per parameter with ``foreach=False``
(made, applied, deleted before the next parameter), per (device, dtype) group of parameters with
``foreach=True`` (``torch._foreach_mul`` of the group's momenta, deleted before the momentum
update). `calc.step.optimizer` counts the same for the hand-written graphs.

torch is imported only inside `lion_class`: ``calc`` imports without it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


def _by_kind(rows: list[tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
    """Rows grouped by the (device, dtype) of their parameter, in order of first use."""
    kinds: dict[tuple[Any, Any], list[tuple[Any, ...]]] = {}
    for row in rows:
        kinds.setdefault((row[0].device, row[0].dtype), []).append(row)
    return list(kinds.values())


def _step_foreach(rows: list[tuple[Any, ...]], lr: float, wd: float, b1: float, b2: float) -> None:
    """One step of ``(param, grad, exp_avg)`` rows, one update tensor per (device, dtype)."""
    import torch

    for kind in _by_kind(rows):
        ps, gs, ms = ([row[i] for row in kind] for i in range(3))
        if wd != 0:
            torch._foreach_mul_(ps, 1 - lr * wd)
        updates = torch._foreach_mul(ms, b1)
        torch._foreach_add_(updates, gs, alpha=1 - b1)
        torch._foreach_sign_(updates)
        torch._foreach_add_(ps, updates, alpha=-lr)
        del updates
        torch._foreach_mul_(ms, b2)
        torch._foreach_add_(ms, gs, alpha=1 - b2)


def _step_each(rows: list[tuple[Any, ...]], lr: float, wd: float, b1: float, b2: float) -> None:
    """One step of ``(param, grad, exp_avg)`` rows, one update tensor per parameter."""
    for p, grad, m in rows:
        if wd != 0:
            p.mul_(1 - lr * wd)
        update = m.mul(b1)
        update.add_(grad, alpha=1 - b1).sign_()
        p.add_(update, alpha=-lr)
        del update
        m.mul_(b2).add_(grad, alpha=1 - b2)


@lru_cache(maxsize=1)
def lion_class() -> Any:
    """``Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, foreach=False)``: the
    class, made on first use."""
    import torch

    class Lion(torch.optim.Optimizer):
        """Lion with decoupled weight decay; ``exp_avg`` in the parameter's dtype."""

        def __init__(
            self,
            params: Any,
            lr: float = 1e-4,
            betas: tuple[float, float] = (0.9, 0.99),
            weight_decay: float = 0.0,
            foreach: bool = False,
        ) -> None:
            defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "foreach": foreach}
            super().__init__(params, defaults)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            for group in self.param_groups:
                rows = []
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    rows.append((p, p.grad, state["exp_avg"]))
                run = _step_foreach if group["foreach"] else _step_each
                run(rows, group["lr"], group["weight_decay"], *group["betas"])
            return None

    return Lion
