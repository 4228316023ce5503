"""The CLI's progress bar for a first estimate that records transformers' code.

`calc.reporting` hands each `calc.Progress` to `printer`'s callback, which redraws one line
on the terminal (``\\r``). Nothing is drawn when the stream is not a terminal (a pipe or a log
file keeps the answer alone), nor when the estimate comes from the disk cache (nothing is
recorded, so nothing is reported).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TextIO

from calc.derive.progress import Progress, reporting

WIDTH = 24
"""Characters of the bar itself."""


def line(p: Progress) -> str:
    """The bar's text for ``p``: what is recorded, the bar, runs done of planned."""
    filled = round(p.fraction * WIDTH)
    bar = "#" * filled + "." * (WIDTH - filled)
    return f"{p.title} [{bar}] {p.done}/{p.total} runs"


def printer(stream: TextIO) -> Callable[[Progress], None]:
    """A callback drawing `line` on ``stream``, ending the line when every run is done."""

    def draw(p: Progress) -> None:
        end = "\n" if p.done >= p.total else ""
        stream.write("\r" + line(p) + end)
        stream.flush()

    return draw


@contextlib.contextmanager
def shown_on(stream: TextIO) -> Iterator[None]:
    """While inside, recordings draw their progress on ``stream`` when it is a terminal."""
    isatty = getattr(stream, "isatty", None)
    if not (callable(isatty) and isatty()):
        yield
        return
    with reporting(printer(stream)):
        yield
