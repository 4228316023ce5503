"""verify's copy of torchtune's activation offloading (`verify.models.offload`) on a real
autograd graph under the CPU tracker, against hand-derived bytes from torchtune's rules: the
host copies are not counted, the forward stash keeps five ids, gradients are unchanged.

The chain: a parameter ``w`` (256 fp32, 1 KiB = ``K``); ``x0 = w * 2`` (saves nothing: a
Python scalar); ``x_i = sin(x_{i-1})`` for i = 1..7, each saving its input (pack ids 1..7)."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from verify.measure.tracker import StorageTracker  # noqa: E402
from verify.models.offload import NoOp, OffloadActivations  # noqa: E402

K = 1024


def _forward(w: torch.Tensor, ctx: contextlib.AbstractContextManager) -> torch.Tensor:
    with ctx:
        x = w * 2
        for _ in range(7):
            x = torch.sin(x)
    return x


def _live_after_forward(ctx: contextlib.AbstractContextManager) -> tuple[int, torch.Tensor]:
    w = torch.nn.Parameter(torch.randn(256))
    tracker = StorageTracker(scan_baseline=False, count_late=False)
    with tracker as tr:
        tr.track(w)
        tr.reset_peak()
        out = _forward(w, ctx)
        live = tr.live_bytes
        out.sum().backward()
    return live, w.grad


def test_without_offloading_every_saved_input_stays() -> None:
    live, _ = _live_after_forward(contextlib.nullcontext())
    assert live == 9 * K  # w, x0..x6 saved, x7


def test_offloading_keeps_the_five_latest_ids_on_the_device_and_none_on_the_host() -> None:
    live, _ = _live_after_forward(OffloadActivations())
    assert live == 7 * K  # w, x2..x6 in the forward stash, x7


def test_noop_restores_plain_saving_inside_the_context() -> None:
    offload = OffloadActivations()
    with offload, NoOp():
        w = torch.nn.Parameter(torch.randn(256))
        torch.sin(w * 2)
    assert offload.last_id == 0


def test_gradients_are_those_of_the_plain_run() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256))
    _forward(w, contextlib.nullcontext()).sum().backward()
    plain = w.grad.clone()
    w.grad = None
    _forward(w, OffloadActivations()).sum().backward()
    assert torch.equal(w.grad, plain)
