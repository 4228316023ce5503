"""Compile, in the background, the structures one widget change away from the page's job.

A rerun whose job has a *structure* the server has not compiled (a precision, optimizer,
recompute, attention kernel or modeling code not used before) pays the symbolic replay and
compile (``calc.estimate``: about half a second for a 32B card on this machine,
``benchmarks/bench_compile.py``). After each page the calculator hands its job here; one
daemon thread then compiles, one by one, the jobs that differ from it in one of those
choices, so that the next change of one of them finds its structure compiled (a rerun like any
other). It starts a compile only when no page has started for ``QUIET_S`` (``page_started``,
called by ``app.py`` at each rerun), so it runs between a user's interactions rather than
competing with a rerun for the interpreter. The thread only fills ``calc.estimate``'s own compile cache: nothing it computes is
shown, and an error (a combination not modelled) is ignored.

Set ``VRAMPLAN_PREFETCH=0`` to switch it off (the test suite does, so that tests measure only
what they run).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

import calc
from calc.config import jobs
from calc.plan import planner

NEIGHBOUR_CHOICES: dict[type, dict[str, tuple[str, ...]]] = {
    calc.Training: {
        "precision": jobs.PRECISIONS,
        "optimizer": jobs.OPTIMIZERS,
        "recompute": jobs.HAND_RECOMPUTES,
        "attention": jobs.ATTENTIONS,
        "implementation": jobs.IMPLEMENTATIONS,
    },
    calc.Inference: {
        "precision": jobs.INFERENCE_PRECISIONS,
        "attention": jobs.ATTENTIONS,
        "implementation": jobs.INFERENCE_IMPLEMENTATIONS,
    },
}
"""The choices whose one-step changes are compiled ahead, per job class, with their values."""
MAX_REMEMBERED = 4096
"""Structures remembered as queued; beyond, the memory is cleared (a structure queued again is
then a cache hit in ``calc.estimate``, nearly free)."""

QUIET_S = 0.3
"""Seconds since the last page started before the thread starts a compile (a rerun takes well
under this; a compile already running when a page starts finishes first, about half a
second at most for a 32B card)."""

_queue: queue.Queue = queue.Queue()
_last_page_start = [0.0]
_queued: set = set()
_lock = threading.Lock()
_worker: list[threading.Thread] = []


def enabled() -> bool:
    """Whether prefetching is on (``VRAMPLAN_PREFETCH`` unset or not ``0``)."""
    return os.environ.get("VRAMPLAN_PREFETCH", "1") != "0"


def neighbours(job: calc.Training | calc.Inference) -> list[calc.Training | calc.Inference]:
    """The valid jobs that differ from ``job`` in exactly one of ``NEIGHBOUR_CHOICES``; none
    for a compiled step, nor ``implementation="derived"``: each is a recording of transformers'
    code (seconds), made when asked for. A recording holds ``calc.derive.record.RECORDING``
    (one at a time per process), so one made here would keep the page's own waiting."""
    if isinstance(job, calc.Training) and job.compile != "none":
        return []
    out = []
    for field, values in NEIGHBOUR_CHOICES[type(job)].items():
        for value in values:
            if value == getattr(job, field) or value == "derived":
                continue
            try:
                out.append(replace(job, **{field: value}))  # type: ignore[arg-type]
            except ValueError:  # a combination the job class refuses
                continue
    return out


def warm(
    spec: calc.ModelSpec,
    model_key: str,
    job: calc.Training | calc.Inference,
    parallel: calc.Parallelism | None,
    device: str,
) -> int:
    """Queue ``job``'s neighbours for compiling in the background; returns how many were new.
    ``model_key`` names the model (``webapp.cached.model_key``). None for a derived model
    (every structure a recording, `neighbours`)."""
    if spec.derived:
        return 0
    return _enqueue(
        (
            (model_key, other, parallel, device),
            partial(calc.estimate, spec, other, parallel, device),
        )
        for other in neighbours(job)
    )


def warm_plan(spec: calc.ModelSpec, key: Hashable, **plan_args: Any) -> int:
    """Queue the planner's compiles for the plan ``plan_args`` describe
    (`calc.plan.planner.precompile`'s arguments), so that opening the planner page finds its
    structures compiled (cold, a 32B card's default plan took 39 s); 1 when newly queued.
    ``key`` names the plan (model and arguments). None for a derived model (its structures
    are recordings, `neighbours`)."""
    if spec.derived:
        return 0
    return _enqueue([(("plan", key), partial(planner.precompile, spec, **plan_args))])


def _enqueue(items: Iterable[tuple[Hashable, Callable[[], object]]]) -> int:
    if not enabled():
        return 0
    new = 0
    with _lock:
        if len(_queued) > MAX_REMEMBERED:
            _queued.clear()
        for key, task in items:
            if key in _queued:
                continue
            _queued.add(key)
            _queue.put(task)
            new += 1
        if new and not (_worker and _worker[0].is_alive()):
            _worker[:] = [threading.Thread(target=_run, name="vramplan-prefetch", daemon=True)]
            _worker[0].start()
    return new


def page_started() -> None:
    """A page (a rerun) starts now: the background thread waits for quiet."""
    _last_page_start[0] = time.monotonic()


def _wait_for_quiet() -> None:
    while (since := time.monotonic() - _last_page_start[0]) < QUIET_S:
        time.sleep(QUIET_S - since)


def _run() -> None:
    while True:
        task = _queue.get()
        _wait_for_quiet()
        try:
            task()
        except (ValueError, NotImplementedError, OverflowError):
            pass  # not modelled or invalid: the page says so if the user picks it
        finally:
            _queue.task_done()


def wait_idle() -> None:
    """Block until every queued structure is compiled (benchmarks and tests)."""
    _queue.join()
