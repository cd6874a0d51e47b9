"""Brute force: every cut, every device subset, order and grouping, judged by the scalar cost model.

Exponential; for small instances and for tests, which check :func:`plan` against it.
"""

from __future__ import annotations

import itertools

from edgert.exporter.errors import PlanError
from edgert.exporter.planner import costs
from edgert.exporter.planner.costs import Stage, at_most
from edgert.exporter.planner.placement import Placement, build_placement, explain_no_fit
from edgert.exporter.planner.problem import PlanProblem, check_problem


def brute_force(problem: PlanProblem) -> Placement:
    """The placement with the least bottleneck, then the least latency, over every possible plan.

    Memory uses each stage's exact position (the DP bounds it for groups, see exporter/planner/dp.py).
    """
    check_problem(problem)
    scored = [(_key(problem, stages), stages) for stages in _all_plans(problem)]
    if not scored:
        raise PlanError(explain_no_fit(problem))
    bottleneck = min(key[0] for key, _ in scored)
    tied = [(key[1], stages) for key, stages in scored if at_most(key[0], bottleneck)]
    return build_placement(problem, min(tied, key=lambda item: item[0])[1])


def _all_plans(problem: PlanProblem):
    """Every list of stages that fits in memory."""
    units, devices = len(problem.units), len(problem.devices)
    for count in range(1, min(units, devices) + 1):
        for cuts in itertools.combinations(range(1, units), count - 1):
            bounds = list(zip((0, *cuts), (*cuts, units)))
            for groups in _device_groups(devices, count, problem.allow_groups):
                stages = [(first, end, group) for (first, end), group in zip(bounds, groups)]
                if all(costs.fits(problem, first, end, d, count - 1 - s)
                       for s, (first, end, group) in enumerate(stages) for d in group):
                    yield stages


def _device_groups(devices: int, count: int, allow_groups: bool):
    """Sequences of ``count`` disjoint non-empty device sets (single devices unless groups are allowed)."""
    if not allow_groups:
        for chosen in itertools.permutations(range(devices), count):
            yield [(d,) for d in chosen]
        return
    for assignment in itertools.product(range(count + 1), repeat=devices):  # count = unused
        groups = [tuple(d for d in range(devices) if assignment[d] == s) for s in range(count)]
        if all(groups):
            yield groups


def _key(problem: PlanProblem, stages: list[Stage]) -> tuple[float, float]:
    """(bottleneck, latency) with each link's codec chosen against the bottleneck."""
    last = len(stages) - 1
    compute = [costs.compute_ms(problem, stage, s == last) for s, stage in enumerate(stages)]
    pairs = list(zip(stages, stages[1:]))
    bottleneck = max(compute + [costs.strongest_link_ms(problem, a[2], b[2], b[0]) for a, b in pairs])
    links = [costs.choose_codec(problem, a[2], b[2], b[0], bottleneck)[1] for a, b in pairs]
    return bottleneck, sum(compute) + sum(links)
