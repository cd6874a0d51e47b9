"""Emulated device speed: ``--slowdown 5`` or ``--slowdown-schedule "0:1,30:8"``.

A worker F times slower makes each computation last F times its measured compute time by
sleeping the difference, so a cluster of unequal devices can be tested on one machine
without the emulated devices competing for its cores. The compute time is measured as the
computing thread's CPU time (ORT runs a 1-thread session on the calling thread): time lost
to another process holding the core is not multiplied by F.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from edgert.errors import EdgertError


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

    def factor(self, step: int) -> float:
        current = 1.0
        for start, factor in self.points:
            if step >= start:
                current = factor
        return current

    def extra(self, step: int, wall_seconds: float) -> float:
        """How much longer a computation that took ``wall_seconds`` here lasts on the emulated device."""
        return max((self.factor(step) - 1.0) * wall_seconds, 0.0)

    def emulate(self, step: int, wall_seconds: float, cpu_seconds: float | None = None) -> float:
        """Sleep until the computation has lasted F x its compute time; returns the seconds slept.

        ``cpu_seconds`` is the compute time when known (single-threaded sessions), else the
        wall time stands for it.
        """
        factor = self.factor(step)
        if factor <= 1.0:
            return 0.0
        compute = wall_seconds if cpu_seconds is None else min(cpu_seconds, wall_seconds)
        extra = factor * compute - wall_seconds
        if extra > 0:
            time.sleep(extra)
        return max(extra, 0.0)

    def __str__(self) -> str:
        return ",".join(f"{step}:{factor:g}" for step, factor in self.points)
