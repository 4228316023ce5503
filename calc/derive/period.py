"""Decoder layers that differ in a repeating pattern, recorded five patterns at a time.

Gemma-2 alternates sliding and full attention (a period of 2 layers), Gemma-3 has five sliding
layers to one full one (6), DeepSeek puts ``first_k_dense_replace`` dense layers before its MoE
ones (a prefix, then a period of 1). Every such model is a few *prefix* layers, then ``N``
*units* of ``P`` consecutive layers that are alike unit for unit, then a *tail* of the first
``r < P`` layers of one more unit. A unit plays the part a layer plays in
`calc.replay.timeline`'s five-layer generalisation: the recording keeps the prefix, five units
and the tail (``prefix + 5 P + tail`` layers instead of ``L``), files each unit's storages
under the unit's number (0 to 4), and the timeline adds the ``N - 5`` middle units the recording
lacks, as it adds middle layers. Which layers are alike is read from the model transformers
builds (`calc.derive.record.layer_signatures`), never assumed from the config's names.

Pure: no torch here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from calc.replay.timeline import GENERAL_LAYERS, MIDDLE


@dataclass(frozen=True, slots=True)
class Periodic:
    """``prefix`` layers, ``units`` units of ``period`` layers, then ``tail`` layers."""

    prefix: int
    period: int
    units: int
    tail: int

    def __post_init__(self) -> None:
        if self.prefix < 0 or self.period < 1 or not 0 <= self.tail < self.period:
            raise ValueError(f"not a periodic layout: {self}")
        if self.units <= GENERAL_LAYERS:
            raise ValueError(f"{self.units} units: recording five saves nothing")

    @property
    def n_layers(self) -> int:
        """Layers of the real model."""
        return self.prefix + self.units * self.period + self.tail

    @property
    def recorded_layers(self) -> int:
        """Layers of the recorded model: the prefix, five units, the tail."""
        return self.prefix + GENERAL_LAYERS * self.period + self.tail

    def tag(self, layer: int) -> int:
        """The timeline's tag of recorded layer ``layer``: its unit's number (0 to 4) for a
        layer of the five units, ``layer - prefix`` (negative) in the prefix, 5 and up in the
        tail: never a unit's number, so the timeline never counts them more than once."""
        if not 0 <= layer < self.recorded_layers:
            raise ValueError(f"layer {layer} is not one of the {self.recorded_layers} recorded")
        offset = layer - self.prefix
        if offset < 0:
            return offset
        units_span = GENERAL_LAYERS * self.period
        if offset < units_span:
            return offset // self.period
        return GENERAL_LAYERS + offset - units_span

    def recorded_signatures(self, signatures: Sequence[Hashable]) -> list[Hashable]:
        """What the recorded model's layers must be, from the real model's ``signatures``:
        the prefix and five units, then the real tail."""
        head = list(signatures[: self.prefix + GENERAL_LAYERS * self.period])
        return head + list(signatures[len(signatures) - self.tail :]) if self.tail else head


def periodic_layout(signatures: Sequence[Hashable]) -> Periodic | None:
    """The layout that describes ``signatures`` (one per decoder layer: layer ``i`` is like
    layer ``i - period`` for every ``i >= prefix + period``) with more than five units and the
    fewest recorded layers (then the shortest prefix); None when none does (the model is then
    recorded with all its layers)."""
    n = len(signatures)
    best: Periodic | None = None
    for prefix in range(n):
        for period in range(1, (n - prefix) // (GENERAL_LAYERS + 1) + 1):
            if best is not None and prefix + GENERAL_LAYERS * period >= best.recorded_layers:
                break
            if all(signatures[i] == signatures[i - period] for i in range(prefix + period, n)):
                units, tail = divmod(n - prefix, period)
                found = Periodic(prefix, period, units, tail)
                if best is None or found.recorded_layers < best.recorded_layers:
                    best = found
                break  # a longer period at this prefix records more
    return best


def expand_order(entries: Sequence[tuple], layout: Periodic) -> tuple[tuple, ...]:
    """``(name, tag, ...)`` entries of a recording of ``layout`` (tags: recorded layer indices)
    as the real model's, in the same order: the prefix and tail layers renumbered to their
    real indices, and the five units' entries replaced, where the first of them stands, by the
    middle unit's (unit 2) for each of the ``units`` real units, from the last to the first
    (the order a backward reaches them; `calc.estimate.ranks.expand_layers` then sees every
    real layer)."""
    middle = [e for e in entries if is_layer(e[1]) and layout.tag(e[1]) == MIDDLE]
    out: list[tuple] = []
    done = False
    for e in entries:
        unit = layout.tag(e[1]) if is_layer(e[1]) else None
        if unit is None or unit < 0:  # not a layer's, or the prefix's: real index as recorded
            out.append(e)
        elif unit >= GENERAL_LAYERS:  # the tail: after the real units
            tail = unit - GENERAL_LAYERS
            out.append((e[0], layout.prefix + layout.units * layout.period + tail, *e[2:]))
        elif not done:
            done = True
            for real_unit in reversed(range(layout.units)):
                for m in middle:
                    local = (m[1] - layout.prefix) % layout.period
                    out.append((m[0], layout.prefix + real_unit * layout.period + local, *m[2:]))
    return tuple(out)


def is_layer(tag: object) -> TypeGuard[int]:
    """Whether a storage tag is a decoder layer's index (an int, not a bool)."""
    return isinstance(tag, int) and not isinstance(tag, bool)
