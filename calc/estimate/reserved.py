"""Reserved memory: calc's exact alloc/free stream at the job's sizes, through the CUDA caching
allocator (`calc.replay.caching_allocator`).

The stream is the single-GPU step replayed with every layer (no generalisation from five; a
derived architecture's step recorded with all its layers, `calc.derive.replay.derived_events`), its
sizes evaluated at the job's values, so it is slower than the peak (about a second for a small
model, tens of seconds for 80 layers) and runs only when asked (`Estimate.reserved`), never in
the planner's sweep. How the stream is read from the tape's events: an event is the live set
after one allocation (``+name``) or free (``-name``); between two events storages can also be
re-filed (saved by autograd, renamed) without being allocated or freed, which keeps their size:
the one size that appears or disappears beyond those pairs is the allocation or the free. A
free takes the most recently allocated live storage of its key. Storages that exist before the
replay (the weights) are allocated first, in the tape's order. The cuBLAS workspaces
(`calc.estimate.workspace`) are allocated where their threads first run a matmul: the forward's
at the start, the backward's at the first backward event.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from functools import lru_cache

import sympy as sp

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.derive.replay import derived_events
from calc.replay.caching_allocator import AllocatorConfig, AllocatorStats, replay
from calc.replay.tape import Event
from calc.step.inference import replay_inference
from calc.step.sizes import values_for
from calc.step.training import replay_training

Stream = list[tuple[bool, object, int]]


@lru_cache(maxsize=8)
def _events(model: ModelSpec, job: Training | Inference, device: str) -> tuple[Event, ...]:
    if model.derived or job.implementation == "derived":  # recorded with all its layers
        return tuple(derived_events(model, job, model.n_layers, every_layer=True).events)
    if isinstance(job, Inference):
        return tuple(replay_inference(model, job, device, model.n_layers))
    return tuple(replay_training(model, job, device, model.n_layers))


def _pair_refiles(minus: Counter, plus: Counter, keys: list) -> tuple[list, list, list]:
    """Match disappearing with appearing key numbers of one size (re-filed storages, the same
    name and layer first): the pairs (old, new), then the key numbers left: freed, allocated."""
    pairs = []
    for old in list(minus.elements()):
        same = [k for k in plus if plus[k] > 0 and keys[k][3] == keys[old][3]]
        if not same:
            continue
        new = next((k for k in same if keys[k][1:3] == keys[old][1:3]), same[0])
        pairs.append((old, new))
        minus[old] -= 1
        plus[new] -= 1
    return pairs, list((+minus).elements()), list((+plus).elements())


def _stream(events: tuple[Event, ...], vals: dict, workspace_bytes: int, handles: int) -> Stream:
    sizes: dict[sp.Expr, int] = {}

    def nbytes(key: tuple) -> int:
        if key[3] not in sizes:
            sizes[key[3]] = int(sp.sympify(key[3]).subs(vals))
        return sizes[key[3]]

    out: Stream = [(True, ("workspace", 0), workspace_bytes)]
    ids: dict[int, list[int]] = defaultdict(list)
    serial = iter(range(1 << 62))
    prev_items: frozenset = frozenset()
    prev: dict[int, int] = {}
    backward_workspace = handles > 1
    for e in events:
        if backward_workspace and "backward" in e.phase:
            out.append((True, ("workspace", 1), workspace_bytes))
            backward_workspace = False
        items = frozenset(e.counts)
        cur = dict(e.counts)
        minus: Counter = Counter()
        plus: Counter = Counter()
        for k in {k for k, _ in items ^ prev_items}:
            d = cur.get(k, 0) - prev.get(k, 0)
            if d > 0:
                plus[k] = d
            elif d < 0:
                minus[k] = -d
        pairs, freed, made = _pair_refiles(minus, plus, e.keys)
        for old, new in pairs:
            ids[new].append(ids[old].pop())
        for k in freed:
            out.append((False, ids[k].pop(), nbytes(e.keys[k])))
        for k in made:
            i = next(serial)
            ids[k].append(i)
            out.append((True, i, nbytes(e.keys[k])))
        prev_items, prev = items, cur
    return out


@lru_cache(maxsize=4)
def stream(
    model: ModelSpec, job: Training | Inference, device: str, workspace_bytes: int, handles: int
) -> Stream:
    """The step's ``(is_alloc, key, bytes)`` events at ``job``'s sizes (module docstring)."""
    return _stream(_events(model, job, device), values_for(model, job), workspace_bytes, handles)


def allocator_stats(
    model: ModelSpec,
    job: Training | Inference,
    device: str,
    workspace_bytes: int,
    handles: int,
    config: AllocatorConfig | None = None,
) -> AllocatorStats:
    """`stream` through the caching allocator with ``config`` (torch 2.13's defaults)."""
    return replay(stream(model, job, device, workspace_bytes, handles), config)
