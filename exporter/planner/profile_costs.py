"""A device's per-unit costs from its profile (``devices.json``): what the re-planner builds the planner's view from.

Units measured alone against the whole model measured as one stage (the fixed cost of being a stage), each
direction's thread scaling, and the weight gradients a split backward computes once a step.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgert.devices import DeviceProfile
from edgert.exporter.planner.threads import parallel_fraction


@dataclass(frozen=True)
class UnitCosts:
    """A worker's ms per micro-batch for every unit, and the fixed cost of a stage (whatever its units)."""

    forward: list[float]
    backward: list[float]
    optimizer: list[float]
    call: tuple[float, float, float] = (0.0, 0.0, 0.0)  # forward, backward and optimizer calls of a stage


def split_stage_cost(forward: list[float], backward: list[float], optimizer: list[float],
                     whole: tuple[float, float, float] | None, param_bytes: list[int] | None = None) -> UnitCosts:
    """Reconcile one-unit measurements with the whole model measured as one stage.

    ``n`` units measured alone pay a stage's fixed cost (session calls, boundary tensors)
    ``n`` times, the whole model once: when the units sum to more than the whole, the fixed
    cost is ``c = (sum - whole) / (n - 1)`` (at most the cheapest unit) and leaves the units.
    When they sum to less (the optimizer: a large stage's state outgrows the caches), the
    excess is spread over the units, by parameter bytes for the optimizer.
    """
    if whole is None or len(forward) < 2:
        return UnitCosts(forward, backward, optimizer)
    call, net = [], []
    for kind, (values, total) in enumerate(zip((forward, backward, optimizer), whole)):
        excess = total - sum(values)
        if excess > 0:
            weights = param_bytes if kind == 2 and param_bytes and sum(param_bytes) > 0 else values
            scale = excess / sum(weights) if sum(weights) > 0 else 0.0
            call.append(0.0)
            net.append([v + w * scale for v, w in zip(values, weights)])
        else:
            fixed = min(-excess / (len(values) - 1), min(values))
            call.append(fixed)
            net.append([v - fixed for v in values])
    return UnitCosts(*net, call=tuple(call))


def parallel_fractions(profile: DeviceProfile | None) -> dict[str, float]:
    """Each direction's Amdahl fraction from the whole model timed at 1 thread and at more (none: 0, no gain)."""
    if profile is None or profile.whole is None or not profile.scaling:
        return {}
    return {"forward_parallel": parallel_fraction(profile.whole.forward_ms,
                                                  [(s.threads, s.forward_ms) for s in profile.scaling]),
            "backward_parallel": parallel_fraction(profile.whole.backward_ms,
                                                   [(s.threads, s.backward_ms) for s in profile.scaling])}


def profiled_weights(profile: DeviceProfile, scale: float, backward: list[float]) -> tuple[float, ...]:
    """Each unit's weight gradients (``weight_ms``, ``edgert profile --split-backward``) times ``scale``, at most
    its ``backward``; none measured: empty, and the planner costs every backward whole."""
    if not any(t.weight_ms for t in profile.blocks):
        return ()
    return tuple(min(t.weight_ms * scale, b) for t, b in zip(profile.blocks, backward))
