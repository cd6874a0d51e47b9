"""The heterogeneity target at model level: devices 1x, 2x, 5x and 10x slow (FTPipeHD's setting)."""

from __future__ import annotations

import pytest

from edgert.exporter.planner.solver import evaluate, plan
from tests.planner.planner_instances import uniform_problem

SLOWDOWNS = [1, 2, 5, 10]


def _equal_cuts_in_device_order(problem):
    units, devices = len(problem.units), len(problem.devices)
    bounds = [round(units * s / devices) for s in range(devices + 1)]
    return evaluate(problem, [(bounds[s], bounds[s + 1], (problem.devices[s].name,)) for s in range(devices)])


@pytest.mark.parametrize("units", [8, 20, 40])
def test_planned_bottleneck_is_three_times_better_than_equal_cuts(units):
    problem = uniform_problem(SLOWDOWNS, units=units)
    planned, equal = plan(problem), _equal_cuts_in_device_order(problem)
    # Equal cuts: the 10x device holds a quarter of the model as the last stage: units / 4 x 2 ms x 10.
    assert equal.bottleneck_ms == pytest.approx(units / 4 * 20)
    assert equal.bottleneck_ms / planned.bottleneck_ms >= 3.0
    assert equal.predicted_step_ms / planned.predicted_step_ms >= 3.0


def test_forty_units_use_every_device_by_its_speed():
    placement = plan(uniform_problem(SLOWDOWNS, units=40))
    sizes = {s.devices[0]: s.end - s.first for s in placement.stages}
    assert placement.bottleneck_ms == pytest.approx(54.0)  # equal cuts: 200 ms, 3.7x slower
    assert sizes["dev0"] > sizes["dev1"] > sizes["dev2"] >= sizes["dev3"] >= 1


def test_few_units_leave_the_slowest_devices_out():
    placement = plan(uniform_problem(SLOWDOWNS, units=8))
    assert set(placement.unused_devices) == {"dev2", "dev3"}
    assert placement.bottleneck_ms == pytest.approx(12.0)  # 2 units x 3 ms x 2 | 6 units x 2 ms x 1


def test_async_predicts_the_time_between_steps_not_one_batchs_trip():
    """No flush under async: in steady state a step ends every bottleneck, once the pipeline is full."""
    problem = uniform_problem([1, 1, 1, 1], units=8, schedule="async", micro_batches=1, rtt_ms=0.0, bandwidth=1e12)
    placement = evaluate(problem, [(2 * s, 2 * s + 2, (f"dev{s}",)) for s in range(4)])
    # each stage: 2 units x (1 ms forward + 2 ms backward); the last folds its forward into its backward
    assert placement.bottleneck_ms == pytest.approx(6.0, rel=0.01)
    assert placement.predicted_step_ms == pytest.approx(placement.bottleneck_ms, rel=0.01)
    synchronous = evaluate(uniform_problem([1, 1, 1, 1], units=8, micro_batches=1, bandwidth=1e12),
                           [(2 * s, 2 * s + 2, (f"dev{s}",)) for s in range(4)])
    assert synchronous.predicted_step_ms > 3 * placement.predicted_step_ms  # one batch's whole trip
