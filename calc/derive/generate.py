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
from calc.derive.book import Trace

MARGIN = 2
"""Tokens kept between a window and the sampled prompts (and their contexts)."""
WHOLE_MAX = 24
"""``new_tokens`` up to this are recorded whole (every decode step); longer generations are
recorded at shorter ones and cut (`cut`)."""
MAX_KEPT = 128
"""The most new tokens recorded whole when each step's scores or logits are kept."""
HEAD = 2
"""Forwards kept at the start of a cut recording: the prefill and the first decode step."""
MIN_NEW = 8
"""The fewest new tokens a cut recording samples (so that a middle of at least 5 decode steps
is cut out, and the carried state is the same at every sample point)."""
STEP = 4
"""Spacing of the sampled prompts and contexts of a cut recording."""
CUT = ("cut", HEAD)
"""The fixed entry that marks a cut regime."""


def generate_regime(
    batch: int, prompt: int, new_tokens: int, thresholds: Sequence[int], kept: bool = False
) -> lift.Regime:
    """The regime of a ``generate`` job of ``new_tokens`` after ``prompt`` tokens, ``batch``
    rows. Up to `WHOLE_MAX` new tokens (`whole_regime`) the generation is recorded whole,
    ``n`` fixed; longer ones (`cut_regime`) are recorded at shorter generations and cut.
    ``kept``: each step's scores or logits are kept until generate returns
    (``output_scores``/``output_logits``), one more storage per new token, which no cut
    stream of fixed length holds: recorded whole up to `MAX_KEPT`, refused beyond."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens} must be >= 1 for generate")
    if kept and new_tokens > MAX_KEPT:
        raise NotImplementedError(
            f"output_scores/output_logits with new_tokens={new_tokens}: each step's kept "
            f"tensor is recorded (one per new token), up to {MAX_KEPT} new tokens"
        )
    if new_tokens <= WHOLE_MAX or kept:
        return whole_regime(batch, prompt, new_tokens, thresholds)
    return cut_regime(batch, prompt, prompt + new_tokens, thresholds)


def whole_regime(
    batch: int, prompt: int, new_tokens: int, thresholds: Sequence[int]
) -> lift.Regime:
    """``b`` and ``s`` sampled (`calc.derive.lift.regime`) where every sampled generation
    stays on one side of each window ``t`` of ``thresholds`` (``s + new_tokens + MARGIN <= t``
    or ``s > t + MARGIN``); a job whose own generation comes near a window (from ``prompt -
    MARGIN`` to ``prompt + new_tokens + MARGIN``) has ``s`` fixed at ``prompt``. ``n`` is always
    fixed: the stream has one decode step per new token after the first."""
    limits = [x for t in thresholds for x in (t - new_tokens - MARGIN, t + MARGIN) if x > 1]
    reg = lift.regime({"b": batch, "s": prompt}, limits)
    near = any(prompt - MARGIN <= t <= prompt + new_tokens + MARGIN for t in thresholds)
    free = tuple(f for f in reg.free if not (near and f[0] == "s"))
    fixed = reg.fixed
    if near and all(name != "s" for name, _ in fixed):
        fixed += (("s", prompt),)
    return lift.Regime(free, (*fixed, ("n", new_tokens)))


def _side(value: int, span: int, thresholds: Sequence[int]) -> tuple[int, int] | None:
    """``(low, high]`` of the values ``v`` whose lengths ``v - span .. v`` lie on the same side
    of every threshold as ``value``'s, ``MARGIN`` tokens away (``high`` -1: unbounded); None
    when ``value``'s own lengths come within ``MARGIN`` of one."""
    if any(value - span - MARGIN <= t <= value + MARGIN for t in thresholds):
        return None
    low = max((t + span + MARGIN for t in thresholds if t < value), default=1)
    high = min((t - MARGIN - 1 for t in thresholds if t > value), default=-1)
    return low, high


def cut_regime(batch: int, prompt: int, context: int, thresholds: Sequence[int]) -> lift.Regime:
    """A long generation (`cut`): ``b``, ``s`` and ``c`` sampled, every sampled generation at
    least `MIN_NEW` tokens. ``s`` keeps the first `HEAD` forwards (lengths ``s .. s + HEAD``)
    on the job's side of every window (and of a one-token prompt), ``c`` the last forward
    (lengths ``c - 2 .. c``); a size whose own forwards come near a window, or whose interval
    cannot hold its samples, is fixed at the job's value."""
    fixed: list[tuple[str, int]] = [("b", 1)] if batch == 1 else []
    free: list[tuple[str, int, int]] = [] if batch == 1 else [("b", 1, -1)]
    top = prompt
    side = _side(prompt + HEAD, HEAD, [1, *thresholds])
    s_free = None
    if side is not None:
        low, high = side[0] - HEAD, side[1] - HEAD if side[1] != -1 else -1
        axis = _axis(low, 4)
        if high == -1 or axis[-1] <= high:
            s_free, top = ("s", low, high), axis[-1]
    side = _side(context, 2, thresholds)
    c_free = None
    if side is not None:
        axis = _axis(max(side[0], top + MIN_NEW), 3)
        if side[1] == -1 or axis[-1] <= side[1]:
            c_free = ("c", side[0], side[1])
    if s_free is not None and (c_free is not None or top + MIN_NEW <= context):
        free.append(s_free)
    else:
        fixed.append(("s", prompt))
    if c_free is not None:
        free.append(c_free)
    else:
        fixed.append(("c", context))
    return lift.Regime(tuple(free), (*fixed, CUT))


def _axis(low: int, count: int) -> list[int]:
    """``count`` multiples of `STEP` above ``low`` (and above 1)."""
    first = (max(low, 1) // STEP + 1) * STEP
    return [first + STEP * i for i in range(count)]


def sample_plan(reg: lift.Regime) -> tuple[list[dict[str, int]], dict[str, int]]:
    """(grid points, held-out point) of a regime: `calc.derive.lift.sample_plan`, or for a cut
    regime prompts and contexts `STEP` apart with every context at least `MIN_NEW` tokens
    beyond every prompt (three prompts and two contexts fitted, one more of each held out)."""
    if CUT not in reg.fixed:
        return lift.sample_plan(reg)
    fixed = dict(reg.fixed)
    axes: dict[str, list[int]] = {}
    for name, low, _high in reg.free:
        if name == "b":
            axes[name] = [2, 3, 4]
        elif name == "s":
            axes[name] = _axis(low, 4)
        else:
            top = axes["s"][-1] if "s" in axes else fixed["s"]
            axes[name] = _axis(max(low, top + MIN_NEW), 3)
    return lift.points(axes, fixed)


def is_cut(reg: lift.Regime) -> bool:
    """Whether ``reg`` is a cut regime (`cut_regime`)."""
    return CUT in reg.fixed


def cut(trace: Trace, starts: Sequence[int]) -> Trace:
    """A recorded generate without its middle forwards: the first `HEAD` forwards, then the
    events of the middle that concern what lives on (the frees of storages made before it, the
    allocations of storages that outlive it: the cache, ids and positions the last forward
    starts from), then the last forward and generate's end; storages renumbered in order of
    first use. Every storage of decode step ``i`` is at least as large as in step ``i - 1``
    (one more cached token; a sliding window's cache stays at the window), so the middle's
    peak is at most the last forward's (`calc.models.hf_generate` argues the same); the kept
    middle events hold a subset of what the real run holds at each moment."""
    if len(starts) < HEAD + 2:
        return trace
    head_end, tail_start = starts[HEAD], starts[-1]
    alive = set(trace.baseline)
    for alloc, sid, _, _ in trace.stream[:head_end]:
        if alloc:
            alive.add(sid)
        else:
            alive.discard(sid)
    middle = trace.stream[head_end:tail_start]
    freed = {sid for alloc, sid, _, _ in middle if not alloc}
    kept = [e for e in middle if (e[1] in alive if not e[0] else e[1] not in freed)]
    stream = [*trace.stream[:head_end], *kept, *trace.stream[tail_start:]]
    order: dict[int, int] = {}
    for sid in [*trace.baseline, *(e[1] for e in stream)]:
        order.setdefault(sid, len(order))
    old = sorted(order, key=order.__getitem__)
    return Trace(
        tuple(trace.nbytes[i] for i in old),
        tuple(trace.info[i] for i in old),
        tuple(order[i] for i in trace.baseline),
        tuple((a, order[i], p, g) for a, i, p, g in stream),
    )


@contextlib.contextmanager
def stop_after(prompt: int, new_tokens: int, answers: list[int]) -> Iterator[None]:
    """generate's stop decisions as the eager run takes them when no row meets its eos token,
    each taken from the length, their ops run (and allocating) as in the real call:

    * greedy and sampling: ``StopCheck.__call__`` (transformers ``generation/utils.py``:393-396)
      runs ``unfinished.max() == 0`` and answers "finished" when the ids hold ``prompt +
      new_tokens`` tokens;
    * beam search: ``_beam_search_has_unfinished_sequences`` (utils.py:3422) runs its
      reductions and answers "finished" at its ``new_tokens``-th call (one per new token). The
      search then crops its outputs to the generated length (utils.py:3880-3883: two int reads,
      views of no size of their own): ``answers`` gets them, ``prompt + new_tokens`` and
      ``new_tokens``, which `calc.derive.book` hands out in that order."""
    from transformers.generation import utils

    mixin = utils.GenerationMixin
    original = utils.StopCheck.__call__
    beam_check = mixin.__dict__["_beam_search_has_unfinished_sequences"]
    calls = [0]

    def call(self: object, unfinished: object, tokens: object, length: int) -> bool:
        done = unfinished.max() == 0  # type: ignore[attr-defined]
        del done
        return length >= prompt + new_tokens

    def beams_left(*args: object) -> bool:
        left = beam_check.__func__(*args)
        del left
        calls[0] += 1
        if calls[0] < new_tokens:
            return True
        answers[:] = [prompt + new_tokens, new_tokens]
        return False

    utils.StopCheck.__call__ = call  # type: ignore[method-assign,assignment]
    mixin._beam_search_has_unfinished_sequences = staticmethod(beams_left)  # type: ignore[assignment]
    try:
        yield
    finally:
        utils.StopCheck.__call__ = original  # type: ignore[method-assign]
        mixin._beam_search_has_unfinished_sequences = beam_check  # type: ignore[method-assign]
