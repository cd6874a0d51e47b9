"""The planner's entry point: cuts, device order, data-parallel groups, threads and link codecs, as a pure function.

:func:`plan` minimises the bottleneck (the slowest stage or link per micro-batch), then,
among plans with that bottleneck, the latency (sum of stage and link times).
"""

from __future__ import annotations

import math
import random

from edgert.exporter.errors import PlanError
from edgert.exporter.planner.brute import brute_force
from edgert.exporter.planner.costs import RELATIVE_TOLERANCE
from edgert.exporter.planner.dp import OrderDP
from edgert.exporter.planner.placement import Placement, StagePlan, build_placement, evaluate, explain_no_fit
from edgert.exporter.planner.problem import DeviceCosts, PlanProblem, Unit, check_problem, in_flight
from edgert.exporter.planner.search import (
    EXACT_DEVICES,
    EXACT_DEVICES_WITH_GROUPS,
    GROUP_SWEEPS,
    HEURISTIC_MAX_GROUP,
    IMPROVEMENT,
    Best,
    beam_search,
    chain,
    exhaustive,
    local_search,
    order_key,
)
from edgert.exporter.planner.tables import Tables, build_tables

SEARCH_STARTS = 2  # local searches run, from the best of the speed, memory and beam orders
RESTART_LAYERS = 20_000  # more local searches, from shuffled orders, while fewer DP layers were built
STALE_RESTARTS = 8  # restarts in a row that found nothing better end them

__all__ = ["DeviceCosts", "PlanProblem", "Placement", "StagePlan", "Unit", "brute_force", "evaluate",
           "in_flight", "memory_order", "plan", "speed_order"]


def plan(problem: PlanProblem) -> Placement:
    """The fastest placement of ``problem``; raises :class:`PlanError` if nothing fits in memory."""
    check_problem(problem)
    tables = build_tables(problem)
    least_bottleneck = _search(problem, tables, cap=None)
    cap = least_bottleneck.value * (1 + RELATIVE_TOLERANCE) + 1e-12
    least_latency = _search(problem, tables, cap=cap, order=least_bottleneck.order)
    return build_placement(problem, least_latency.stages)


def speed_order(problem: PlanProblem) -> list[int]:
    """Device positions from the fastest (least total forward + backward time) to the slowest."""
    totals = [sum(d.forward_ms) + sum(d.backward_ms) for d in problem.devices]
    return sorted(range(len(totals)), key=lambda d: (totals[d], d))


def memory_order(problem: PlanProblem) -> list[int]:
    """Device positions from the least memory (unlimited last) to the most, faster first among equals.

    Read from the back of the pipeline, it puts the devices with the most memory first in
    the pipeline, where stages hold the most in-flight micro-batches.
    """
    speed = {d: rank for rank, d in enumerate(speed_order(problem))}
    return sorted(speed, key=lambda d: (problem.devices[d].memory_bytes or math.inf, speed[d]))


def _search(problem: PlanProblem, tables: Tables, cap: float | None, order: list[int] | None = None) -> Best:
    """The heuristic (under a cap: just ``order``), then, for few enough devices, every order to beat it."""
    devices = len(problem.devices)
    exact = devices <= (EXACT_DEVICES_WITH_GROUPS if problem.allow_groups else EXACT_DEVICES)
    max_group = (devices if exact else HEURISTIC_MAX_GROUP) if problem.allow_groups else 1
    if cap is None:
        found = _heuristic(problem, tables, max_group, restarts=not exact)
    else:
        found = chain(OrderDP(tables, max_group, cap), order)
    if exact:
        found = exhaustive(OrderDP(tables, max_group, cap, sorted_groups=True), devices, incumbent=found)
    if not found.stages:
        raise PlanError(explain_no_fit(problem))
    return found


def _heuristic(problem: PlanProblem, tables: Tables, max_group: int, restarts: bool) -> Best:
    """Local search on single devices from good starts (and shuffled orders if ``restarts``), then with groups."""
    single = OrderDP(tables, 1)
    found = _best_local_search(single, _starts(problem, single), restarts)
    if max_group > 1:
        start = found.order if found.stages else speed_order(problem)
        grouped = local_search(OrderDP(tables, max_group), start, sweeps=GROUP_SWEEPS, kinds=("swap",))
        if grouped.value < found.value:
            found = grouped
    return found


def _starts(problem: PlanProblem, dp: OrderDP) -> list[list[int]]:
    """The best SEARCH_STARTS of the speed order, the memory order and the beam search's order."""
    fastest = speed_order(problem)
    beam = beam_search(dp, len(fastest))
    starts = [fastest, memory_order(problem)] + ([_completed(beam.order, fastest)] if beam.stages else [])
    return sorted(starts, key=lambda start: order_key(dp, start))[:SEARCH_STARTS]


def _best_local_search(dp: OrderDP, starts: list[list[int]], restarts: bool) -> Best:
    """Local search from each start, then from shuffled orders until RESTART_LAYERS DP layers were
    built or STALE_RESTARTS restarts in a row found nothing better (seeded: the result is repeatable)."""
    found = min((local_search(dp, start) for start in starts), key=lambda best: best.value)
    shuffle, stale = random.Random(0), 0
    while restarts and dp.layers_built < RESTART_LAYERS and stale < STALE_RESTARTS:
        searched = local_search(dp, shuffle.sample(starts[0], len(starts[0])))
        stale = 0 if searched.value < found.value * (1 - IMPROVEMENT) else stale + 1
        if searched.value < found.value:
            found = searched
    return found


def _completed(prefix: list[int], order: list[int]) -> list[int]:
    """``prefix`` followed by the devices it lacks, in ``order``."""
    return prefix + [d for d in order if d not in prefix]
