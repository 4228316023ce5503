"""Progress of a recording: how many of its runs on fake tensors are done.

A derived replay (`calc.derive.replay`) records the job at several sizes (the sample plan of
`calc.derive.lift`) and a compiled or generating job takes seconds to minutes the first time
(then the disk cache answers). Whoever waits for it (the CLI's bar, the app's) registers a
callback with `reporting`; `report` calls it. No I/O here: the callers draw.

The callback is held in a ``ContextVar``: it applies to the estimates made inside the ``with``
block, in that thread (or task), and nested blocks restore the outer one on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Progress:
    """One step of a recording."""

    done: int
    """Runs recorded so far."""
    total: int
    """Runs the recording plans (it may grow when a quick fit fails and the full grid runs)."""
    what: str
    """What is being recorded: the model type and the kind of job, e.g. ``"mixtral generate"``."""

    @property
    def title(self) -> str:
        """The words every progress display leads with."""
        return f"recording {self.what} from transformers' code"

    @property
    def fraction(self) -> float:
        """``done / total`` in [0, 1]."""
        return min(1.0, self.done / self.total) if self.total > 0 else 1.0


Callback = Callable[[Progress], None]
"""What `reporting` registers: called once before the first run and after each run."""

_CALLBACK: ContextVar[Callback | None] = ContextVar("vramplan_progress", default=None)


@contextlib.contextmanager
def reporting(callback: Callback) -> Iterator[None]:
    """Inside the block, each recording calls ``callback`` with its `Progress`. ``ValueError``
    if ``callback`` is not callable."""
    if not callable(callback):
        raise ValueError(f"callback={callback!r} must be callable (it takes a Progress)")
    token = _CALLBACK.set(callback)
    try:
        yield
    finally:
        _CALLBACK.reset(token)


def report(done: int, total: int, what: str) -> None:
    """Tell the registered callback (if any) that ``done`` of ``total`` runs are recorded."""
    callback = _CALLBACK.get()
    if callback is not None:
        callback(Progress(done, total, what))
