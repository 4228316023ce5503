"""Hugging Face ``generate`` recorded from the modeling code: the regime and the stop decision.

`calc.derive.record` runs ``model.generate(ids, max_new_tokens=n, do_sample=False)`` on fake
tensors (verify's protocol, ``verify/run/step.py``, ``generate``): the prefill, the ``n - 1``
decode steps and generate's own bookkeeping (transformers 5.24 ``generation/utils.py``,
``_sample`` from line 3123), with the model's real cache (``DynamicCache`` with its sliding
window layers, or ``cache_implementation="static"``). The stream then has one prefill and
``n - 1`` decode steps, so it is recorded for the job's ``new_tokens`` (fixed in the regime:
`generate_regime`) and fitted in the batch and the prompt only; the context is ``prompt + n``.

Two things differ from a prefill's recording:

* the stop decision ``bool(unfinished_sequences.max() == 0)`` (``StopCheck.__call__``,
  utils.py:393-396) reads a value: `stop_after` runs the same ops and answers "not finished"
  until the ids reach ``max_length`` (no row meets its eos token early, as in the estimate of
  the hand-written graphs, `calc.models.hf_generate`);
* the code path changes where the context crosses a window (a sliding-window layer stops
  growing, its mask changes): a prompt whose generation reaches a window is fixed at the job's
  value, and the sampled prompts keep clear of every window (`generate_regime`).

torch and transformers are imported only inside `stop_after`: ``calc`` imports without them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from calc.derive import lift

MARGIN = 2
"""Tokens kept between a window and the sampled prompts (and their contexts)."""


def generate_regime(
    batch: int, prompt: int, new_tokens: int, thresholds: Sequence[int]
) -> lift.Regime:
    """The regime of a ``generate`` job of ``new_tokens`` after ``prompt`` tokens, ``batch``
    rows: ``b`` and ``s`` sampled (`calc.derive.lift.regime`) where every sampled generation
    stays on one side of each window ``t`` of ``thresholds`` (``s + new_tokens + MARGIN <= t``
    or ``s > t + MARGIN``); a job whose own generation comes near a window (from ``prompt -
    MARGIN`` to ``prompt + new_tokens + MARGIN``) has ``s`` fixed at ``prompt``. ``n`` is always
    fixed: the stream has one decode step per new token after the first."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens} must be >= 1 for generate")
    limits = [x for t in thresholds for x in (t - new_tokens - MARGIN, t + MARGIN) if x > 1]
    reg = lift.regime({"b": batch, "s": prompt}, limits)
    near = any(prompt - MARGIN <= t <= prompt + new_tokens + MARGIN for t in thresholds)
    free = tuple(f for f in reg.free if not (near and f[0] == "s"))
    fixed = reg.fixed
    if near and all(name != "s" for name, _ in fixed):
        fixed += (("s", prompt),)
    return lift.Regime(free, (*fixed, ("n", new_tokens)))


@contextlib.contextmanager
def stop_after(max_length: int) -> Iterator[None]:
    """``StopCheck.__call__`` (transformers ``generation/utils.py``:393-396) as the eager run
    executes it, with its answer taken from the length: the ops ``unfinished.max() == 0`` run
    (and allocate) as in the real call; "finished" when the ids hold ``max_length`` tokens."""
    from transformers.generation import utils

    original = utils.StopCheck.__call__

    def call(self: object, unfinished: object, tokens: object, length: int) -> bool:
        done = unfinished.max() == 0  # type: ignore[attr-defined]
        del done
        return length >= max_length

    utils.StopCheck.__call__ = call  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        utils.StopCheck.__call__ = original  # type: ignore[method-assign]
