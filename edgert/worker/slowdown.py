"""Emulated device speed: ``--slowdown 5`` or ``--slowdown-schedule "0:1,30:8"``.

A worker F times slower makes each computation last F times its compute time by sleeping
the difference, so a cluster of unequal devices can be tested on one machine without the
emulated devices competing for its cores. The compute time is the computing thread's CPU
time (ORT runs a 1-thread session on the calling thread): time lost to another process
holding the core is not multiplied by F. And it is the *warm* compute time, the least seen
for the same call: on a PC, a computation right after a sleep of 10 ms or more takes up to
twice the CPU time (cold caches, a core clocked down), and the longer sleeps of a slower
device would multiply that artifact by F (:class:`SlowdownEmulator`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

from edgert.errors import EdgertError

WEIGHT_CALL = "weights"  # the emulator's name for a split backward's weight-gradient call (with its rows)


@dataclass(frozen=True)
class SlowdownSchedule:
    """Slowdown factors by step: ``((0, 1.0), (30, 8.0))`` means 1x until step 30, then 8x."""

    points: tuple[tuple[int, float], ...] = ((0, 1.0),)

    @classmethod
    def parse(cls, text: str) -> SlowdownSchedule:
        """Parse ``"F"`` or ``"STEP:F,STEP:F,..."``."""
        try:
            if ":" not in text:
                points = ((0, float(text)),)
            else:
                points = tuple((int(step), float(factor)) for step, factor in
                               (item.split(":") for item in text.split(",") if item.strip()))
        except ValueError:
            raise EdgertError(f"slowdown {text!r}: expected a factor like 5 or a schedule like '0:1,30:8'") from None
        if not points or any(factor < 1 for _, factor in points) or any(step < 0 for step, _ in points):
            raise EdgertError(f"slowdown {text!r}: factors must be >= 1 and steps >= 0")
        return cls(tuple(sorted(points)))

    @property
    def emulates(self) -> bool:
        """Whether any step runs slower than this host."""
        return any(factor > 1 for _, factor in self.points)

    def factor(self, step: int) -> float:
        current = 1.0
        for start, factor in self.points:
            if step >= start:
                current = factor
        return current

    def extra(self, step: int, wall_seconds: float) -> float:
        """How much longer a computation that took ``wall_seconds`` here lasts on the emulated device."""
        return max((self.factor(step) - 1.0) * wall_seconds, 0.0)

    def __str__(self) -> str:
        return ",".join(f"{step}:{factor:g}" for step, factor in self.points)


class SlowdownEmulator:
    """Makes computations last F x their warm compute time, F from a :class:`SlowdownSchedule`."""

    def __init__(self, schedule: SlowdownSchedule | None = None):
        self.schedule = schedule or SlowdownSchedule()
        self._warm: dict[Hashable, float] = {}

    def record(self, call: Hashable, wall_seconds: float, cpu_seconds: float | None = None) -> float:
        """Note one run of ``call`` without sleeping (a warm-up); returns its warm time so far."""
        compute = wall_seconds if cpu_seconds is None else min(cpu_seconds, wall_seconds)
        warm = min(self._warm.get(call, compute), compute)
        self._warm[call] = warm
        return warm

    def emulate(self, step: int, call: Hashable, wall_seconds: float, cpu_seconds: float | None = None) -> float:
        """Sleep until the computation has lasted F x the warm time of ``call``; returns the seconds slept.

        ``call`` names what was computed (same work, same key: e.g. ``(Computation.FORWARD, rows)``);
        ``cpu_seconds`` is the compute time when known (single-threaded sessions), else the
        wall time stands for it.
        """
        warm = self.record(call, wall_seconds, cpu_seconds)
        factor = self.schedule.factor(step)
        if factor <= 1.0:
            return 0.0
        extra = factor * warm - wall_seconds
        if extra > 0:
            time.sleep(extra)
        return max(extra, 0.0)
