"""How each direction's time scales with threads, fitted to what `edgert profile` measures, and the split of a
device's cores between a forward and a backward that run side by side."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from edgert.exporter.errors import PlanError
from edgert.exporter.planner.solver import brute_force, plan
from edgert.exporter.planner.threads import parallel_fraction, scaled, split_cores
from tests.planner.planner_instances import random_problem, uniform_problem


def test_amdahls_fraction_is_recovered_from_timed_points_and_clamped():
    for p in (0.0, 0.35, 0.9, 1.0):
        points = [(n, scaled(12.0, p, n)) for n in (2, 4, 8)]
        assert parallel_fraction(12.0, points) == pytest.approx(p, abs=1e-12)
    assert parallel_fraction(10.0, [(2, 11.0)]) == 0.0  # slower with more threads: they do not help
    assert parallel_fraction(10.0, [(2, 4.0)]) == 1.0  # better than linear (noise): at most perfectly parallel
    assert parallel_fraction(10.0, []) == 0.0 and parallel_fraction(0.0, [(2, 1.0)]) == 0.0


def test_the_cores_go_where_they_shorten_the_longer_direction():
    # a forward that does not scale and a backward that does: one thread forward, the rest backward
    assert split_cores(1.0, 4.0, 4, forward_parallel=0.0, backward_parallel=1.0) == (1, 3, pytest.approx(4 / 3))
    # both scale perfectly and cost the same: an even split
    assert split_cores(4.0, 4.0, 4, 1.0, 1.0) == (2, 2, pytest.approx(2.0))
    # a forward three times the backward, both scaling: three quarters of the cores forward
    assert split_cores(6.0, 2.0, 4, 1.0, 1.0) == (3, 1, pytest.approx(2.0))
    # nothing measured: threads change nothing, the backward gets the most
    assert split_cores(1.0, 3.0, 8) == (1, 7, pytest.approx(3.0))


def test_a_plan_side_by_side_takes_the_split_its_cost_assumed():
    problem = uniform_problem([1, 1], units=4, side_by_side=True, forward_ms=2.0, backward_ms=4.0)
    scaling = replace(problem, devices=tuple(replace(d, cores=4, forward_parallel=1.0, backward_parallel=1.0)
                                             for d in problem.devices))
    placement = plan(scaling)
    first = placement.stages[0]
    forward, backward = 2.0 * (first.end - first.first), 4.0 * (first.end - first.first)
    f, b, ms = split_cores(forward, backward, 4, 1.0, 1.0)
    assert (first.forward_threads, first.backward_threads) == ((f,), (b,))
    assert first.compute_ms == pytest.approx(ms)
    assert placement.stages[-1].forward_threads == (4,)  # the last stage: every core for its one session
    assert placement.bottleneck_ms < plan(problem).bottleneck_ms  # threads that scale make the stages shorter


def test_parallel_fractions_outside_zero_to_one_are_refused():
    problem = uniform_problem([1], units=2)
    with pytest.raises(PlanError, match="forward_parallel must be a fraction in .0, 1."):
        plan(replace(problem, devices=(replace(problem.devices[0], forward_parallel=1.5),)))


def test_plan_matches_brute_force_side_by_side_with_measured_scaling():
    checked = 0
    for seed in range(50):
        rng = random.Random(seed)
        problem = random_problem(seed, devices=rng.randint(1, 4), units=rng.randint(1, 7), memory=seed % 2 == 0,
                                 schedule="1f1b", stash=seed % 3 == 0, side_by_side=True)
        problem = replace(problem, devices=tuple(replace(d, forward_parallel=rng.random(),
                                                         backward_parallel=rng.random()) for d in problem.devices))
        try:
            expected = brute_force(problem)
        except PlanError:
            with pytest.raises(PlanError):
                plan(problem)
            continue
        found = plan(problem)
        assert found.bottleneck_ms == pytest.approx(expected.bottleneck_ms, rel=1e-9), seed
        checked += 1
    assert checked >= 35
