"""How a direction's time scales with ORT threads, and a device's cores split between the two directions.

``edgert profile`` times the whole model at 1 thread and again at a few more (``DeviceProfile.scaling``);
Amdahl's law fitted to those points gives each direction's parallel fraction ``p``: with ``n`` threads a
call takes ``(1 - p) + p / n`` of its 1-thread time. A stage that runs its forwards beside its backwards
gives the two sessions ``f`` and ``cores - f`` threads; the planner takes the split that makes the longer
of the two shortest (docs/PLANNER.md, "threads").
"""

from __future__ import annotations

from collections.abc import Sequence


def parallel_fraction(one_thread_ms: float, points: Sequence[tuple[int, float]]) -> float:
    """Amdahl's parallel fraction fitted (least squares on ``1/speedup``) to ``(threads, ms)`` points, in [0, 1];
    0 without points or a time to compare them with."""
    if one_thread_ms <= 0 or not points:
        return 0.0
    # ms / one_thread_ms - 1 = p * (1 / n - 1): a line through the origin
    xs = [1.0 / n - 1.0 for n, _ in points]
    ys = [ms / one_thread_ms - 1.0 for _, ms in points]
    denominator = sum(x * x for x in xs)
    if denominator == 0:
        return 0.0
    return min(1.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / denominator))


def scaled(ms: float, parallel: float, threads: int) -> float:
    """``ms`` (a 1-thread time) with ``threads`` threads, by Amdahl's law."""
    return ms * ((1.0 - parallel) + parallel / threads)


def split_cores(forward_ms: float, backward_ms: float, cores: int, forward_parallel: float = 0.0,
                backward_parallel: float = 0.0) -> tuple[int, int, float]:
    """(forward threads, backward threads, the longer direction's ms) of the best split of ``cores`` (>= 2)
    between a forward and a backward that run at once; the fewest forward threads among equals."""
    best: tuple[int, int, float] | None = None
    for forward_threads in range(1, cores):
        longer = max(scaled(forward_ms, forward_parallel, forward_threads),
                     scaled(backward_ms, backward_parallel, cores - forward_threads))
        if best is None or longer < best[2] * (1 - 1e-12):
            best = (forward_threads, cores - forward_threads, longer)
    assert best is not None, "split_cores needs at least 2 cores"
    return best
