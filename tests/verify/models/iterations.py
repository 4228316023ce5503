"""Tracker peaks of a loss step run twice: the copies of the trainers' loops against the
libraries themselves (tests/verify/models/test_litgpt_*.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from verify.measure.tracker import StorageTracker


def two_iterations(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    model: torch.nn.Module,
    ids: torch.Tensor,
) -> list[int]:
    """Peaks of two iterations of ``step(ids, ids)`` and its backward (no optimizer: the
    gradients set to None after each), on the CPU storage tracker."""
    tracker = StorageTracker(scan_baseline=False, count_late=False)
    peaks = []
    with tracker as tr:
        tr.track(ids)
        tr.classify(model=model, inputs=[ids])
        for _ in range(2):
            tr.reset_peak()
            loss = step(ids, ids)
            loss.backward()
            del loss
            peaks.append(tr.peak_bytes)
            for p in model.parameters():
                p.grad = None
    return peaks


def assert_same_bytes_and_gradients(
    mine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    theirs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    models: tuple[torch.nn.Module, torch.nn.Module],
    ids: torch.Tensor,
) -> None:
    """The copy's step ``mine`` on ``models[0]`` and the library's ``theirs`` on
    ``models[1]`` (same weights): the same tracker peaks over two iterations, then the same
    gradients, to the bit, for every parameter that trains."""
    ours, lib = models
    assert two_iterations(mine, ours, ids) == two_iterations(theirs, lib, ids)
    for p, q in zip(ours.parameters(), lib.parameters(), strict=True):
        p.grad = q.grad = None
    mine(ids, ids).backward()
    theirs(ids, ids).backward()
    for (name, p), (_, q) in zip(ours.named_parameters(), lib.named_parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
