"""plan() against brute force on many small random instances, and a hand-checked table."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from edgert.exporter.errors import PlanError
from edgert.exporter.planner.costs import memory_bytes
from edgert.exporter.planner.solver import brute_force, evaluate, plan
from edgert.schedule import simulate
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


def _instances(count: int, groups: bool, memory: bool, side_by_side: bool = False, split_backward: bool = False):
    for seed in range(count):
        rng = random.Random(seed)
        schedules = ["1f1b"] if side_by_side else ["gpipe", "1f1b", "async"]
        yield seed, random_problem(seed, devices=rng.randint(1, 4), units=rng.randint(1, 7), memory=memory,
                                   allow_groups=groups, schedule=rng.choice(schedules), stash=seed % 3 == 0,
                                   side_by_side=side_by_side, split_backward=split_backward)


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


def test_split_backward_leaves_the_weight_gradients_of_stages_after_the_first_to_the_step():
    # Backward 2 a unit, 1 of it weight gradients. The first stage pays F 1 + B 2 = 3 a unit, the last stage
    # after it B - W = 1: cut 1 gives (3, 3) where one backward per micro-batch cut 1 or 2 did (3, 6) or (6, 4).
    split = uniform_problem([1, 1], units=4, weight_ms=1.0, split_backward=True)
    placement = plan(split)
    assert placement.cut_units() == [1]
    assert [s.compute_ms for s in placement.stages] == pytest.approx([3.0, 3.0])
    whole = plan(replace(split, split_backward=False))
    assert whole.bottleneck_ms == pytest.approx(6.0)
    # the step: the 4 micro-batches' weight call (4 x 3 units x 1 ms) after the last stage's last backward, of
    # which the next step's first forward on stage 0 hides some: the interval between two steps back to back
    two, one = (simulate("1f1b", [1.0, 3.0], [2.0, 3.0], 4, [placement.link_ms[0]], weights_ms=[0.0, 12.0],
                         steps=steps) for steps in (2, 1))
    assert placement.predicted_step_ms == pytest.approx(two - one)
    assert simulate("1f1b", [1.0, 3.0], [2.0, 3.0], 4, [placement.link_ms[0]]) < two - one < one
    assert placement.predicted_step_ms < whole.predicted_step_ms
    # async computes the weight gradients after each backward; unmeasured weights are costed whole: no change
    for same in (replace(split, schedule="async"), uniform_problem([1, 1], units=4, split_backward=True)):
        assert plan(same).bottleneck_ms == pytest.approx(plan(replace(same, split_backward=False)).bottleneck_ms)


def test_split_backward_charges_memory_for_the_weight_call():
    # the last stage keeps 2 tensors of saved_bytes per unit and row for each of the step's micro-batches
    problem = uniform_problem([1, 1], units=4, weight_ms=1.0, split_backward=True, saved_bytes=1000)
    assert memory_bytes(problem, 1, 4, 1, 0) - memory_bytes(replace(problem, split_backward=False), 1, 4, 1, 0) \
        == 2 * 3 * 1000 * 8 * 4
    assert memory_bytes(problem, 0, 2, 0, 1) == memory_bytes(replace(problem, split_backward=False), 0, 2, 0, 1)
    tight = replace(problem, devices=tuple(replace(d, memory_bytes=memory_bytes(problem, 1, 4, 1, 0) - 1)
                                           for d in problem.devices))
    with pytest.raises(PlanError, match="what the weight call reads of 4 micro-batch"):
        evaluate(tight, [(0, 1, ("dev0",)), (1, 4, ("dev1",))])


@pytest.mark.parametrize("side_by_side", [False, True])
def test_plan_matches_brute_force_with_split_backward(side_by_side):
    checked = changed = 0
    for seed, problem in _instances(60, groups=False, memory=True, side_by_side=side_by_side, split_backward=True):
        found, expected = _same_or_both_impossible(problem)
        if found is None:
            continue
        assert found.bottleneck_ms == pytest.approx(expected.bottleneck_ms, rel=1e-9), seed
        if not side_by_side:
            assert found.latency_ms() == pytest.approx(expected.latency_ms(), rel=1e-9), seed
        checked += 1
        changed += found.bottleneck_ms < plan(replace(problem, split_backward=False)).bottleneck_ms * (1 - 1e-9)
    assert checked >= 40
    assert changed >= 10  # the split shortens many optima (not one device's, nor async's)


@pytest.mark.parametrize("split_backward", [False, True])
def test_plan_matches_brute_force_with_groups_and_unlimited_memory(split_backward):
    grouped = 0
    for seed, problem in _instances(60, groups=True, memory=False, split_backward=split_backward):
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
