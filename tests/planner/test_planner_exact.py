"""plan() against brute force on many small random instances, and a hand-checked table."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from edgert.exporter.errors import PlanError
from edgert.exporter.planner.costs import memory_bytes
from edgert.exporter.planner.solver import brute_force, evaluate, plan
from tests.planner.planner_instances import random_problem, uniform_problem


def test_two_equal_devices_hand_checked():
    # Non-last stage: forward 1 + backward 2 = 3 ms per unit; last stage: backward 2 ms per unit.
    # Cut 1 gives (3, 6), cut 2 gives (6, 4): both bottleneck 6, cut 1 has the smaller latency 9.
    placement = plan(uniform_problem([1, 1], units=4))
    assert placement.cut_units() == [1]
    assert [s.compute_ms for s in placement.stages] == pytest.approx([3.0, 6.0])
    assert placement.bottleneck_ms == pytest.approx(6.0)
    assert placement.link_codecs == ("none",)
    assert placement.unused_devices == ()
    assert [s.forward_threads for s in placement.stages] == [(2,), (2,)]


def test_one_device_runs_the_whole_model_as_the_last_stage():
    placement = plan(uniform_problem([1], units=3))
    assert [(s.first, s.end, s.devices) for s in placement.stages] == [(0, 3, ("dev0",))]
    assert placement.bottleneck_ms == pytest.approx(6.0)  # backward only: 3 x 2 ms
    assert placement.link_ms == () and placement.cut_units() == []


def test_a_ten_times_slower_device_is_left_unused():
    placement = plan(uniform_problem([1, 1, 10], units=6))
    assert placement.unused_devices == ("dev2",)
    assert placement.bottleneck_ms == pytest.approx(8.0)  # 2 units x 3 ms | 4 units x 2 ms
    assert brute_force(uniform_problem([1, 1, 10], units=6)).bottleneck_ms == pytest.approx(8.0)


def _instances(count: int, groups: bool, memory: bool, side_by_side: bool = False):
    for seed in range(count):
        rng = random.Random(seed)
        schedules = ["1f1b"] if side_by_side else ["gpipe", "1f1b", "async"]
        yield seed, random_problem(seed, devices=rng.randint(1, 4), units=rng.randint(1, 7), memory=memory,
                                   allow_groups=groups, schedule=rng.choice(schedules), stash=seed % 3 == 0,
                                   side_by_side=side_by_side)


def _same_or_both_impossible(problem):
    try:
        expected = brute_force(problem)
    except PlanError:
        with pytest.raises(PlanError):
            plan(problem)
        return None, None
    return plan(problem), expected


@pytest.mark.parametrize("memory", [False, True])
def test_plan_matches_brute_force_without_groups(memory):
    checked = unused = 0
    for seed, problem in _instances(80, groups=False, memory=memory):
        found, expected = _same_or_both_impossible(problem)
        if found is None:
            continue
        assert found.bottleneck_ms == pytest.approx(expected.bottleneck_ms, rel=1e-9), seed
        assert found.latency_ms() == pytest.approx(expected.latency_ms(), rel=1e-9), seed
        checked += 1
        unused += bool(found.unused_devices)
    assert checked >= 65
    assert unused >= 8  # the optimum often leaves a device out, and plan finds those too


def test_side_by_side_costs_the_longer_direction_and_splits_the_cores():
    # Non-last stage side by side: max(forward 1, backward 2) = 2 ms per unit, as the last stage's backward:
    # the even cut wins (4, 4) where one after the other cut 1 did (3, 6); the 2 cores split 1 and 1.
    placement = plan(uniform_problem([1, 1], units=4, side_by_side=True))
    assert placement.cut_units() == [2]
    assert [s.compute_ms for s in placement.stages] == pytest.approx([4.0, 4.0])
    assert [(s.forward_threads, s.backward_threads) for s in placement.stages] == [((1,), (1,)), ((2,), (2,))]
    one_after = plan(uniform_problem([1, 1], units=4))
    assert placement.predicted_step_ms < one_after.predicted_step_ms
    # GPipe has nothing to overlap, and a device with one core cannot run both at once: nothing changes
    for same in (uniform_problem([1, 1], units=4, side_by_side=True, schedule="gpipe"),
                 _with_cores(uniform_problem([1, 1], units=4, side_by_side=True), 1)):
        assert plan(same).cut_units() == plan(replace(same, side_by_side=False)).cut_units()
    # stashing: the backward (5 a unit) no longer recomputes the forward (1); side by side max(F, B - F) = 4
    stashed = plan(_with_cores(uniform_problem([1, 1], units=4, side_by_side=True, stash=True, backward_ms=5.0), 4))
    assert stashed.cut_units() == [2] and stashed.stages[0].compute_ms == pytest.approx(2 * 4.0)
    assert stashed.stages[0].forward_threads == (1,) and stashed.stages[0].backward_threads == (3,)


def _with_cores(problem, cores):
    return replace(problem, devices=tuple(replace(d, cores=cores) for d in problem.devices))


def test_plan_matches_brute_force_side_by_side():
    checked = 0
    for seed, problem in _instances(60, groups=False, memory=True, side_by_side=True):
        found, expected = _same_or_both_impossible(problem)
        if found is None:
            continue
        assert found.bottleneck_ms == pytest.approx(expected.bottleneck_ms, rel=1e-9), seed
        checked += 1
    assert checked >= 45


def test_plan_matches_brute_force_with_groups_and_unlimited_memory():
    grouped = 0
    for seed, problem in _instances(60, groups=True, memory=False):
        found, expected = plan(problem), brute_force(problem)
        assert found.bottleneck_ms == pytest.approx(expected.bottleneck_ms, rel=1e-9), seed
        assert found.latency_ms() == pytest.approx(expected.latency_ms(), rel=1e-9), seed
        grouped += any(len(s.devices) > 1 for s in found.stages)
    assert grouped >= 8


def test_groups_under_memory_limits_are_planned_conservatively():
    """The DP charges a stage for every device after it (not every stage): never over memory, rarely worse."""
    worse = 0
    for seed, problem in _instances(60, groups=True, memory=True):
        found, expected = _same_or_both_impossible(problem)
        if found is None:
            continue
        assert found.bottleneck_ms >= expected.bottleneck_ms * (1 - 1e-9), seed
        _assert_fits(problem, found)
        worse += found.bottleneck_ms > expected.bottleneck_ms * (1 + 1e-9)
    assert worse <= 4


def test_evaluate_agrees_with_plan_on_its_own_stages():
    problem = random_problem(3, devices=4, units=8, memory=False)
    found = plan(problem)
    again = evaluate(problem, [(s.first, s.end, s.devices) for s in found.stages])
    assert again == found


def _assert_fits(problem, placement):
    index = {d.name: i for i, d in enumerate(problem.devices)}
    count = len(placement.stages)
    for s, stage in enumerate(placement.stages):
        for name in stage.devices:
            limit = problem.devices[index[name]].memory_bytes
            need = memory_bytes(problem, stage.first, stage.end, index[name], count - 1 - s)
            assert limit == 0 or need <= limit
