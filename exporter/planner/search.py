"""Searching device orders: every order up to EXACT_DEVICES devices, heuristics beyond.

All walk orders through :class:`OrderDP`, reusing the layers of a shared prefix:

- :func:`exhaustive`: depth-first over order prefixes (one DP layer per node), pruned by
  :meth:`OrderDP.subtree_bound` against the best plan so far; exact.
- :func:`beam_search`: the same walk keeping only the most promising prefixes per depth.
- :func:`local_search`: swaps, reversals and moves of a whole order; a candidate is
  re-evaluated only from the first position that changed, and abandoned once it cannot
  beat the incumbent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from edgert.exporter.planner.costs import Stage
from edgert.exporter.planner.dp import Layer, OrderDP

EXACT_DEVICES = 7  # all orders up to this many devices (7! = 5040)
EXACT_DEVICES_WITH_GROUPS = 6  # when stages may be groups (each layer then has a row per group size)
HEURISTIC_MAX_GROUP = 4  # largest data-parallel group the local search considers
MAX_SWEEPS = 25  # local-search passes over all moves, at most
BEAM_WIDTH = 8  # order prefixes the beam search keeps per depth
MOVES = ("swap", "reverse", "move")
GROUP_SWEEPS = 1  # passes of the second local search, which allows groups (swaps only)
IMPROVEMENT = 1e-9  # relative gain a move must bring to be taken


@dataclass
class Best:
    """The best complete plan seen so far: its value (bottleneck or latency) and where the DP left it."""

    value: float = math.inf
    order: list[int] = field(default_factory=list)  # the device order it was found on (it uses a prefix)
    layers: list[Layer] = field(default_factory=list)
    group: int = 0  # the group size of the first pipeline stage
    dp: OrderDP | None = None

    @property
    def stages(self) -> list[Stage]:
        return self.dp.stages(self.order, self.layers, self.group) if self.dp else []


def exhaustive(dp: OrderDP, devices: int, incumbent: Best | None = None) -> Best:
    """Every order of every subset of devices (as prefixes of orders); exact. Beats ``incumbent`` or returns it."""
    best = Best(**vars(incumbent)) if incumbent else Best()

    def visit(order: list[int], layers: list[Layer]) -> None:
        for device in range(devices):
            if device in order:
                continue
            extended = order + [device]
            deeper = layers + [dp.layer(extended, layers)]
            _record(dp, best, extended, deeper, deeper[-1])
            if dp.subtree_bound(extended, deeper) < best.value:
                visit(extended, deeper)

    visit([], [])
    return best


def beam_search(dp: OrderDP, devices: int, width: int = BEAM_WIDTH) -> Best:
    """Grow order prefixes device by device, keeping the ``width`` prefixes with the best subtree bounds."""
    best = Best()
    beam: list[tuple[list[int], list[Layer]]] = [([], [])]
    for _ in range(devices):
        grown = []
        for order, layers in beam:
            for device in range(devices):
                if device not in order:
                    extended = order + [device]
                    deeper = layers + [dp.layer(extended, layers)]
                    _record(dp, best, extended, deeper, deeper[-1])
                    grown.append((dp.subtree_bound(extended, deeper), extended, deeper))
        grown.sort(key=lambda item: item[0])
        beam = [(order, layers) for bound, order, layers in grown[:width] if bound < best.value]
        if not beam:
            break
    return best


def local_search(dp: OrderDP, start: list[int], sweeps: int = MAX_SWEEPS, kinds: tuple[str, ...] = MOVES) -> Best:
    """First-improvement search over swaps, reversals and moves of the order, from ``start``."""
    current = _Evaluated.of(dp, start, [], math.inf)
    for _ in range(sweeps):
        improved = False
        for move in _moves(len(start), kinds):
            candidate, changed = _apply(move, current.order)
            target = current.best.value * (1 - IMPROVEMENT)
            evaluated = _Evaluated.of(dp, candidate, current.layers[:changed], target)
            if evaluated.best.value < target or (math.isinf(evaluated.best.value) and evaluated.reach < current.reach):
                current, improved = evaluated, True
        if not improved:
            break
    return current.best


def chain(dp: OrderDP, order: list[int]) -> Best:
    """The best plan on prefixes of one order."""
    return _Evaluated.of(dp, order, [], math.inf).best


def order_key(dp: OrderDP, order: list[int]) -> tuple[float, int]:
    """How good an order is before any search: its best plan, else how much of the model fits on it."""
    evaluated = _Evaluated.of(dp, order, [], math.inf)
    return evaluated.best.value, evaluated.reach


@dataclass
class _Evaluated:
    order: list[int]
    layers: list[Layer]
    best: Best

    @property
    def reach(self) -> int:
        """The first unit from which the rest fits on a prefix: how close an order without a plan came."""
        placed = [np.isfinite(layer.values).any(axis=0) for layer in self.layers]
        return min(int(row.argmax()) if row.any() else len(row) for row in placed)

    @classmethod
    def of(cls, dp: OrderDP, order: list[int], layers: list[Layer], target: float) -> _Evaluated:
        """Evaluate ``order`` after the given prefix layers; stop once it cannot get below ``target``."""
        layers, best = list(layers), Best()
        for depth in range(len(layers)):
            _record(dp, best, order, layers[:depth + 1], layers[depth])
        while len(layers) < len(order):
            layers.append(dp.layer(order, layers))
            _record(dp, best, order, layers, layers[-1])
            if dp.subtree_bound(order, layers) >= min(target, best.value):
                break
        return cls(list(order), layers, best)


def _record(dp: OrderDP, best: Best, order: list[int], layers: list[Layer], last: Layer) -> None:
    """Keep the complete plan ending at layer ``last`` (the last of ``layers``) if it beats ``best``."""
    complete = last.values[:, 0]
    group = int(complete.argmin())
    if complete[group] < best.value:
        best.value, best.order, best.layers, best.group, best.dp = (
            float(complete[group]), list(order), list(layers), group + 1, dp)


def _moves(n: int, kinds: tuple[str, ...]):
    """Swaps ``(a, b)``, reversals of ``[a, b]`` (2-opt) and moves of the device at ``a`` to ``b``."""
    if "swap" in kinds:
        yield from (("swap", a, b) for a in range(n) for b in range(a + 1, n))
    if "reverse" in kinds:  # a reversal of three is a swap
        yield from (("reverse", a, b) for a in range(n) for b in range(a + 3, n))
    if "move" in kinds:  # a move by one is a swap
        yield from (("move", a, b) for a in range(n) for b in range(n) if abs(a - b) > 1)


def _apply(move: tuple[str, int, int], order: list[int]) -> tuple[list[int], int]:
    """The order after ``move``, and the first position it changed."""
    kind, a, b = move
    changed = list(order)
    if kind == "swap":
        changed[a], changed[b] = changed[b], changed[a]
    elif kind == "reverse":
        changed[a:b + 1] = changed[a:b + 1][::-1]
    else:
        changed.insert(b, changed.pop(a))
    return changed, min(a, b)
