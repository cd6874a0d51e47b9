"""Malformed problems are refused up front, naming the bad value."""

from __future__ import annotations

from dataclasses import replace

import pytest

from edgert.exporter.errors import PlanError
from edgert.exporter.planner.solver import brute_force, plan
from tests.planner.planner_instances import uniform_problem


def _bad(**changes):
    return replace(uniform_problem([1, 1], units=3), **changes)


@pytest.mark.parametrize(("problem", "message"), [
    (_bad(micro_batch=0), r"micro_batch must be a positive integer \(got 0\)"),
    (_bad(micro_batches=-2), r"micro_batches must be a positive integer \(got -2\)"),
    (_bad(schedule="zero-bubble"), r"unknown schedule 'zero-bubble'; choose one of gpipe, 1f1b, async"),
    (_bad(optimizer_slots=-1), r"optimizer_slots must be a non-negative integer \(got -1\)"),
    (_bad(units=()), r"no units"),
    (_bad(devices=()), r"no devices"),
    (_bad(bandwidth=((1e9, 1e9),)), r"bandwidth must be a 2x2 matrix .* got 1 rows of lengths \[2\]"),
    (_bad(bandwidth=((1e9, 0.0), (1e9, 1e9))), r"bandwidth\[0\]\[1\] must be > 0 bytes/s \(got 0.0\)"),
    (_bad(rtt_ms=((0.0, -1.0), (0.0, 0.0))), r"rtt_ms\[0\]\[1\] must be finite and >= 0 \(got -1.0\)"),
    (_bad(codecs={"none": 1.0, "int4": 0.5}), r"codec 'int4': compression ratio must be finite and >= 1 \(got 0.5\)"),
])
def test_bad_problem(problem, message):
    with pytest.raises(PlanError, match=message):
        plan(problem)
    with pytest.raises(PlanError, match=message):
        brute_force(problem)


def test_device_cost_lengths_must_match_the_units():
    problem = uniform_problem([1, 1], units=3)
    short = replace(problem.devices[1], forward_ms=(1.0, 1.0))
    with pytest.raises(PlanError, match=r"device 'dev1': forward_ms has 2 entries for 3 units"):
        plan(replace(problem, devices=(problem.devices[0], short)))


def test_weight_gradients_must_be_one_per_unit_and_part_of_the_backward():
    problem = uniform_problem([1, 1], units=3, split_backward=True)  # backward 2 ms a unit
    for weights, message in (((1.0, 1.0), r"device 'dev1': weight_ms has 2 entries for 3 units \(or none"),
                             ((1.0, 2.5, 1.0), r"device 'dev1': weight_ms of unit 1 must be finite, >= 0 and at "
                                               r"most its backward_ms \(got 2.5\)")):
        bad = replace(problem.devices[1], weight_ms=weights)
        with pytest.raises(PlanError, match=message):
            plan(replace(problem, devices=(problem.devices[0], bad)))


def test_negative_times_and_duplicate_names():
    problem = uniform_problem([1, 1], units=3)
    negative = replace(problem.devices[0], backward_ms=(1.0, -2.0, 1.0))
    with pytest.raises(PlanError, match=r"device 'dev0': backward_ms must be finite and >= 0 \(got -2.0\)"):
        plan(replace(problem, devices=(negative, problem.devices[1])))
    with pytest.raises(PlanError, match=r"device names repeat: dev0"):
        plan(replace(problem, devices=(problem.devices[0], problem.devices[0])))


def test_evaluate_refuses_stages_that_do_not_cover_the_model():
    from edgert.exporter.planner.solver import evaluate

    problem = uniform_problem([1, 1], units=3)
    with pytest.raises(PlanError, match=r"stages \[\(0, 1\), \(2, 3\)\] must cover units 0..3 contiguously"):
        evaluate(problem, [(0, 1, ("dev0",)), (2, 3, ("dev1",))])
    with pytest.raises(PlanError, match=r"no device 'pi-9'; devices are dev0, dev1"):
        evaluate(problem, [(0, 3, ("pi-9",))])
    with pytest.raises(PlanError, match=r"each stage needs its own devices"):
        evaluate(problem, [(0, 1, ("dev0",)), (1, 3, ("dev0",))])
