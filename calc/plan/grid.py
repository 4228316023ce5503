"""Compiled structures as plain data, cached in memory and on disk, for the planner.

``calc.estimate`` compiles one *structure* (the tensors a step allocates; sizes are symbols) into
a timeline: candidate peaks ``(C0 + L*C1) @ sizes``, where ``sizes`` are the distinct rounded
storage sizes, sympy expressions of the symbols of ``calc.symbols`` (``calc.replay.timeline``). Here
the size expressions become integer programs (``calc.plan.program``: exact, data, never
``eval``-ed) and the structure's timeline (programs, count matrices, candidate phases) is plain data: it is kept in
memory and, through ``calc.data.cards``, in a persistent JSON cache keyed by a SHA-256 of calc's
source and of the structure, so the symbolic replay of a structure (0.3-0.8 s,
``benchmarks/bench_compile.py``) is paid once per machine and calc version.

A table can also be one rank's replay under a parallel layout (``ReplayOptions`` of
``calc.estimate``, built by ``calc.estimate.ranks.rank_replays``): the options are part of the compiled
structure's key, and the table then also keeps the order in which gradients become ready
(``grad_order``, as programs), from which ``calc.estimate.ranks`` computes DDP's buckets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.data.cards import calc_source_digest, read_plan_cache, write_plan_cache
from calc.estimate import core as _estimate
from calc.estimate.core import SINGLE, ReplayOptions, StructureKey
from calc.plan.program import program_from_json, program_to_json, to_program

CACHE_FORMAT = 3
"""Version of the cache entries' layout (part of the cache key)."""
NOT_IN_TABLES = frozenset(
    {
        "data/cards.py", "cli/main.py", "present/display.py", "plan/evidence.py", "data/gpus.py",
        "plan/planner.py", "plan/axes.py", "cli/plan.py", "plan/layouts.py", "plan/engine.py",
        "plan/grid_eval.py", "plan/result.py", "plan/search.py", "estimate/result.py",
        "present/sweep.py", "plan/throughput.py", "cli/model_source.py",
    }
)  # fmt: skip
"""Modules of ``calc`` that do not change a compiled table (the planner's presentation, the
catalog, the CLI, the bulk evaluation, the web app's display helpers): left out of the cache key. Every other module, new
ones included, is in it."""


@dataclass(frozen=True, slots=True)
class StructureTable:
    """One structure's timeline as plain data (what the persistent cache stores)."""

    programs: tuple
    """One ``to_program`` program per distinct storage size."""
    c0: np.ndarray
    """[candidates, sizes] constant counts (``calc.replay.timeline.Timeline.c0``)."""
    c1: np.ndarray
    """[candidates, sizes] counts per layer."""
    phases: tuple[str, ...]
    """Phase of each candidate."""
    not_modelled: str = ""
    """The cost model's ``NotImplementedError`` message when it does not cover the structure."""
    grad_order: tuple = ()
    """``(tag, numel program, itemsize)`` of each parameter leaf in first-backward order
    (``calc.estimate.core.Compiled.grad_order``): DDP's buckets (``calc.estimate.ranks.expand_layers``)."""
    _rows: dict = field(default_factory=dict, compare=False)
    """Memo of ``calc.plan.grid_eval.reduced``: (model dimensions, prune) -> its ``Reduced``."""

    def to_json(self) -> dict:
        """The table as JSON data: programs as nested lists, the count matrices flattened."""
        return {
            "programs": [program_to_json(p) for p in self.programs],
            "n_candidates": len(self.phases),
            "c0": self.c0.ravel().tolist(),
            "c1": self.c1.ravel().tolist(),
            "phases": list(self.phases),
            "not_modelled": self.not_modelled,
            "grad_order": [[tag, program_to_json(p), size] for tag, p, size in self.grad_order],
        }

    @classmethod
    def from_json(cls, data: dict) -> StructureTable:
        """The table back from ``to_json`` data (``ValueError``/``KeyError``/``TypeError`` if
        it is damaged: the caller recompiles)."""
        programs = tuple(program_from_json(p) for p in data["programs"])
        phases = tuple(str(p) for p in data["phases"])
        shape = (int(data["n_candidates"]), len(programs))
        if len(phases) != shape[0]:
            raise ValueError("plan cache entry: phases and candidates disagree")
        return cls(
            programs=programs,
            c0=np.asarray(data["c0"], dtype=np.int64).reshape(shape),
            c1=np.asarray(data["c1"], dtype=np.int64).reshape(shape),
            phases=phases,
            not_modelled=str(data.get("not_modelled", "")),
            grad_order=tuple(_grad_entry(e) for e in data.get("grad_order", ())),
        )

    def rows(self, n_layers: int) -> np.ndarray:
        """``C0 + n_layers * C1``: the count of each size at each candidate."""
        return self.c0 + n_layers * self.c1


def _grad_entry(entry: list) -> tuple:
    tag, prog, itemsize = entry
    if not isinstance(tag, int | str) or isinstance(tag, bool) or not isinstance(itemsize, int):
        raise ValueError("plan cache entry: a damaged gradient order")
    return (tag, program_from_json(prog), itemsize)


def structure_id(
    model: ModelSpec, job: Training | Inference, opts: ReplayOptions = SINGLE
) -> StructureKey:
    """What decides the compiled structure of ``(model, job)`` replayed with ``opts``: jobs
    with equal ids differ only in sizes and share one ``StructureTable``."""
    return _estimate._structure_key(model, job, _estimate.replay_options(job, opts))


def _branch_of(model: ModelSpec, opts: ReplayOptions) -> int:
    """The layer count the replay runs (``calc.estimate.core.compiled_for``)."""
    return model.n_layers if opts.exact_layers else _estimate._branch(model.n_layers)


def _cache_name(key: StructureKey, device: str, branch: int) -> str:
    digest = _source_digest(lambda: calc_source_digest(NOT_IN_TABLES))
    text = repr((CACHE_FORMAT, digest, key, device, branch))
    return hashlib.sha256(text.encode()).hexdigest()


_DIGEST: list[str] = []


def _source_digest(fn: Callable[[], str]) -> str:
    if not _DIGEST:
        _DIGEST.append(fn())
    return _DIGEST[0]


_TABLES: dict[tuple, StructureTable] = {}


def _compile_table(
    model: ModelSpec, job: Training | Inference, device: str, opts: ReplayOptions
) -> StructureTable:
    try:  # a structure the replay refuses, or a size the programs cannot compute: its rows
        comp, _key = _estimate.compiled_for(model, job, device, opts)  # say "not modelled"
        tl = comp.timeline
        programs = tuple(to_program(size) for size in tl.sizes)
        grad_order = tuple(
            (tag, to_program(numel), int(itemsize)) for _, tag, numel, itemsize in comp.grad_order
        )
    except NotImplementedError as exc:
        return StructureTable(
            (), np.zeros((0, 0), np.int64), np.zeros((0, 0), np.int64), (), str(exc)
        )
    return StructureTable(
        programs=programs,
        c0=np.asarray(tl.c0, dtype=np.int64),
        c1=np.asarray(tl.c1, dtype=np.int64),
        phases=tuple(c.phase for c in tl.candidates),
        grad_order=grad_order,
    )


def structure_table(
    model: ModelSpec,
    job: Training | Inference,
    device: str = "cuda",
    persist: bool = True,
    opts: ReplayOptions = SINGLE,
) -> tuple[StructureTable, bool]:
    """The structure of ``(model, job)`` replayed with ``opts`` (default: one GPU; a rank of
    a parallel layout: ``calc.estimate.ranks.RankReplay.options`` with the rank's model and job) as a
    ``StructureTable``, and whether it had to be compiled now (False: from memory or from the
    persistent cache). The cache key is ``repr`` of the compile key of ``calc.estimate``
    (frozen dataclasses, the options included), the device, the replayed layer count (all
    ``L`` with ``opts.exact_layers``), the format and calc's source digest.

    Raises ``ValueError`` for a job ``calc.Training``/``calc.Inference`` rejects (they validate
    on construction, so this only re-checks the device)."""
    opts = _estimate.replay_options(job, opts)
    key = _estimate._structure_key(model, job, opts)
    branch = _branch_of(model, opts)
    mem_key = (key, device, branch)
    if mem_key in _TABLES:
        return _TABLES[mem_key], False
    name = _cache_name(key, device, branch) if persist else ""
    if persist:
        data = read_plan_cache(name)
        if data is not None:
            try:
                table = StructureTable.from_json(data)
            except (KeyError, TypeError, ValueError):
                table = None
            if table is not None:
                _TABLES[mem_key] = table
                return table, False
    table = _compile_table(model, job, device, opts)
    _TABLES[mem_key] = table
    if persist:
        write_plan_cache(name, table.to_json())
    return table, True


def clear_memory_cache() -> None:
    """Forget the structures held in memory (the persistent cache stays)."""
    _TABLES.clear()
