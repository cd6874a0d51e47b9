"""Planning time: 64 units on 16 devices (the heuristic) and 64 units on 7 devices (every order)."""

from __future__ import annotations

import time

from edgert.exporter.planner.solver import plan
from tests.planner.planner_instances import random_problem, uniform_problem


def _timed(problem):
    start = time.process_time()  # CPU time: other processes on a shared host do not count
    placement = plan(problem)
    return placement, time.process_time() - start


def test_64_units_on_16_devices_plan_within_a_second():
    problem = random_problem(1, devices=16, units=64, memory=False)
    placement, seconds = _timed(problem)
    print(f"\n64 units x 16 devices: {seconds:.2f} s CPU, bottleneck {placement.bottleneck_ms:.1f} ms, "
          f"{len(placement.stages)} stages")
    assert seconds < 3.0
    assert len(placement.stages) >= 8


def test_64_units_on_16_spread_devices():
    problem = uniform_problem([1, 1, 2, 2, 2, 3, 3, 4, 5, 5, 6, 8, 8, 10, 10, 10], units=64)
    placement, seconds = _timed(problem)
    print(f"\n64 equal units x 16 devices 1x..10x: {seconds:.2f} s CPU, bottleneck {placement.bottleneck_ms:.1f} ms")
    assert seconds < 3.0
    # Perfect balance of 3 ms per unit over the devices' speeds is a lower bound; stay close to it.
    lower = 64 * 3 / sum(1 / s for s in [1, 1, 2, 2, 2, 3, 3, 4, 5, 5, 6, 8, 8, 10, 10, 10])
    assert placement.bottleneck_ms < 1.5 * lower


def test_64_units_on_7_devices_search_every_order():
    placement, seconds = _timed(random_problem(2, devices=7, units=64, memory=False))
    print(f"\n64 units x 7 devices, all orders: {seconds:.2f} s CPU")
    assert seconds < 5.0
