"""The CLI's progress bar (`calc.cli.progress_bar`): drawn on a terminal only."""

from __future__ import annotations

import io

import calc
from calc.cli import progress_bar
from calc.derive import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_says_what_is_recorded_and_how_far() -> None:
    text = progress_bar.line(calc.Progress(3, 4, "mixtral generate"))
    assert text.startswith("recording mixtral generate from transformers' code [")
    assert text.endswith("] 3/4 runs")
    assert text.count("#") == progress_bar.WIDTH * 3 // 4


def test_a_terminal_gets_one_redrawn_line_ended_when_done() -> None:
    out = _Terminal()
    with progress_bar.shown_on(out):
        for done in range(3):
            progress.report(done, 2, "gemma2 prefill")
    drawn = out.getvalue()
    assert drawn.count("\r") == 3 and drawn.endswith("2/2 runs\n")
    assert drawn.count("\n") == 1


def test_a_pipe_gets_nothing() -> None:
    out = io.StringIO()  # not a terminal: the answer stays alone on the page
    with progress_bar.shown_on(out):
        progress.report(1, 2, "gemma2 prefill")
    assert out.getvalue() == ""
