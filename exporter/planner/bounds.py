"""Lower bounds that let the order search skip orders and prefixes that cannot win.

Each unit costs at least its cheapest device's time (``cheapest``). A device does at most
``speed[d] = max over units of cheapest / own time`` of that work per ms, a group the sum
of its members' speeds. So:

- bottleneck: unused devices of total speed ``R`` need at least ``cheapest work / R``;
- latency (every stage at most ``cap``): at least the time it takes to fill the fastest
  possible groups to the cap, one after another;
- memory: the units' parameter state must fit in the unused devices' memory together.

Compute only: links and all-reduce only add.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgert.exporter.planner.tables import Tables


class Used(NamedTuple):
    """Totals over the devices of an order prefix, grown one device at a time."""

    devices: int = 0
    speed: float = 0.0
    memory: float = 0.0  # bytes of the devices with a limit
    unlimited: int = 0  # devices without a limit


class WorkBounds:
    def __init__(self, tables: Tables, max_group: int):
        self.max_group = max_group
        cheapest, self.speed = _cheapest(tables.unit_work)
        self.work = np.cumsum(cheapest)  # [j - 1]: cheapest work of units [0, j)
        self.total_speed = float(self.speed.sum())
        self.state = (tables.params[0] * tables.state_factor)[1:]  # [j - 1]: parameter state of units [0, j)
        self.unlimited = np.isinf(tables.memory)
        self.memory = np.where(self.unlimited, 0.0, tables.memory)
        self.total_memory, self.total_unlimited = float(self.memory.sum()), int(self.unlimited.sum())
        cheapest_backward, speed_backward = _cheapest(tables.unit_backward)
        self.any_plan = float(cheapest_backward.sum() / speed_backward.sum())  # every plan is at least this

    def grow(self, used: Used, device: int) -> Used:
        return Used(used.devices + 1, used.speed + self.speed[device], used.memory + self.memory[device],
                    used.unlimited + int(self.unlimited[device]))

    def through(self, values: np.ndarray, used: Used, order: list[int], cap: float | None) -> float:
        """Bound on plans through a state ``(j >= 1)`` of a layer with these values, ``[0, j)`` on unused devices."""
        if used.devices >= len(self.speed):
            return np.inf
        if used.unlimited < self.total_unlimited:
            last = len(self.state)
        else:  # units [0, j) may fit for j <= last
            last = int(self.state.searchsorted(self.total_memory - used.memory, side="right"))
        if last < 1:
            return np.inf
        values, work = values[:, 1:last + 1], self.work[:last]
        if cap is None:
            return float(np.maximum(values, work / max(self.total_speed - used.speed, 1e-300)).min())
        return float((values + self._least_latency(work, order[:used.devices], cap)).min())

    def _least_latency(self, work: np.ndarray, used: list[int], cap: float) -> np.ndarray:
        unused = np.ones(len(self.speed), dtype=bool)
        unused[used] = False
        speeds = np.sort(self.speed[unused])[::-1]
        rates = np.add.reduceat(speeds, np.arange(0, len(speeds), self.max_group))
        covered = np.concatenate([[0.0], np.cumsum(rates) * cap])
        return np.interp(work, covered, np.arange(len(covered)) * cap, right=np.inf)


def _cheapest(work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per unit the cheapest device's time, and per device its best speed relative to it (<= 1)."""
    cheapest = work.min(axis=0)
    positive = cheapest > 0
    if not positive.any():
        return cheapest, np.ones(work.shape[0])
    return cheapest, (cheapest[positive] / work[:, positive]).max(axis=1)
