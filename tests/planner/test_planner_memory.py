"""Memory: every returned stage fits its devices; what cannot fit is refused with a clear message."""

from __future__ import annotations

import dataclasses
import random

import pytest

from edgert.exporter.errors import ExportError, PlanError
from edgert.exporter.planner.costs import memory_bytes
from edgert.exporter.planner.solver import DeviceCosts, PlanProblem, Unit, evaluate, in_flight, plan
from edgert.schedule import max_in_flight, stage_actions
from tests.planner.planner_instances import MIB, full_matrix, random_problem, uniform_problem


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async"])
def test_in_flight_matches_the_schedules(schedule):
    for stages in range(1, 6):
        for micro_batches in range(stages, 9) if schedule == "async" else range(1, 9):
            for stage in range(stages):
                held = max_in_flight(stage_actions(schedule, stage, stages, micro_batches))
                assert in_flight(schedule, stages - 1 - stage, micro_batches) == held


def test_memory_need_is_state_plus_inputs_plus_peak():
    problem = uniform_problem([1, 1], units=4, param_bytes=MIB, input_bytes=1000, peak_bytes=3 * MIB,
                              micro_batch=8, micro_batches=4, schedule="1f1b", optimizer_slots=2)
    # Stage 0 of 2 (rank 1): min(1 + 2, 4) = 3 in-flight micro-batches; 2 units of 1 MiB params.
    assert memory_bytes(problem, 0, 2, 0, rank=1) == 2 * MIB * 4 + 3 * 8 * 1000 + 3 * MIB
    # The last stage holds one micro-batch.
    assert memory_bytes(problem, 2, 4, 1, rank=0) == 2 * MIB * 4 + 1 * 8 * 1000 + 3 * MIB


def test_async_stages_also_hold_stashed_weights():
    problem = uniform_problem([1, 1, 1], units=3, param_bytes=MIB, input_bytes=0, peak_bytes=0, schedule="async")
    assert memory_bytes(problem, 0, 1, 0, rank=2) == MIB * 4 + 3 * MIB  # 3 in flight, a weight copy each
    assert memory_bytes(problem, 2, 3, 0, rank=0) == MIB * 4  # the last stage stashes nothing


def test_stashing_stages_also_hold_saved_activations():
    problem = uniform_problem([1, 1], units=4, param_bytes=MIB, input_bytes=1000, peak_bytes=0, saved_bytes=5000,
                              micro_batch=8, micro_batches=4, schedule="1f1b", optimizer_slots=2, stash=True)
    # Stage 0 of 2 keeps, per in-flight micro-batch (3), its inputs and both units' saved tensors.
    assert memory_bytes(problem, 0, 2, 0, rank=1) == 2 * MIB * 4 + 3 * 8 * (1000 + 2 * 5000)
    # The last stage folds its forward into its backward: it saves nothing.
    assert memory_bytes(problem, 2, 4, 1, rank=0) == 2 * MIB * 4 + 1 * 8 * 1000
    # Recomputing instead of stashing keeps only the inputs.
    recompute = dataclasses.replace(problem, stash=False)
    assert memory_bytes(recompute, 0, 2, 0, rank=1) == 2 * MIB * 4 + 3 * 8 * 1000


def test_saved_activations_count_against_memory():
    # Two devices fit two units each while recomputing. Stashing, the first stage also keeps
    # its saved activations (3 in flight x 8 samples x 2 units x 64 KiB = 3 MiB), which do not fit.
    base = dict(units=4, param_bytes=MIB, input_bytes=1000, peak_bytes=0, saved_bytes=64 * 1024,
                micro_batch=8, micro_batches=4, schedule="1f1b", optimizer_slots=2)
    limit = 2 * MIB * 4 + 3 * 8 * 1000 + 1 * MIB
    recompute = plan(uniform_problem([1, 1], memory_bytes=limit, **base))
    assert [(s.first, s.end) for s in recompute.stages] == [(0, 2), (2, 4)]
    with pytest.raises(PlanError, match="saved activations.*recomputing instead of stashing"):
        plan(uniform_problem([1, 1], memory_bytes=limit, stash=True, **base))
    # With a third device the stashing plan exists, and none of its stages overflows.
    three = uniform_problem([1, 1, 1], memory_bytes=limit, stash=True, **base)
    stashing = plan(three)
    assert len(stashing.stages) == 3
    for s, stage in enumerate(stashing.stages):
        assert memory_bytes(three, stage.first, stage.end, 0, len(stashing.stages) - 1 - s) <= limit


@pytest.mark.parametrize("stash", [False, True])
def test_every_stage_fits_on_random_instances(stash):
    checked = 0
    for seed in range(30):
        rng = random.Random(seed)
        devices = rng.randint(2, 7) if seed % 10 else 9  # 9 devices: the heuristic search
        problem = random_problem(seed, devices=devices, units=rng.randint(4, 16), stash=stash,
                                 schedule=rng.choice(["gpipe", "1f1b", "async"]), allow_groups=rng.random() < 0.3)
        try:
            placement = plan(problem)
        except PlanError:
            continue
        index = {d.name: i for i, d in enumerate(problem.devices)}
        for s, stage in enumerate(placement.stages):
            for name in stage.devices:
                limit = problem.devices[index[name]].memory_bytes
                need = memory_bytes(problem, stage.first, stage.end, index[name], len(placement.stages) - 1 - s)
                assert limit == 0 or need <= limit, (seed, stage)
                assert stage.memory_bytes >= need
        checked += 1
    assert checked >= 20


def test_memory_decides_the_order():
    # Stage 0 holds 3 micro-batches of 4 MiB inputs, the last stage one: only the big device can be first.
    problem = uniform_problem([1, 1], units=2, param_bytes=0, input_bytes=512 * 1024, peak_bytes=0, micro_batch=8,
                              micro_batches=4, memory_bytes=[5 * MIB, 13 * MIB])
    placement = plan(problem)
    assert [s.devices for s in placement.stages] == [("dev1",), ("dev0",)]
    assert [s.memory_bytes for s in placement.stages] == [12 * MIB, 4 * MIB]


def test_a_unit_too_big_for_every_device_is_named():
    units = (Unit("stem", MIB, 1024), Unit("res3b", 50 * MIB, 1024), Unit("head", MIB, 1024))
    devices = tuple(DeviceCosts(name, (1.0,) * 3, (2.0,) * 3, (MIB,) * 3, memory_bytes=memory)
                    for name, memory in (("pi-1", 64 * MIB), ("pi-2", 128 * MIB)))
    problem = PlanProblem(units, devices, full_matrix(2, 1e8), full_matrix(2, 1.0), micro_batch=8, micro_batches=4)
    with pytest.raises(PlanError) as error:
        plan(problem)
    message = str(error.value)
    assert message.startswith("unit res3b needs 201 MiB")  # 50 MiB x (2 + 2 AdamW slots) + 1 MiB peak + inputs
    assert "the largest device (pi-2) has 128 MiB" in message
    assert isinstance(error.value, ExportError)


def test_a_model_too_big_for_all_devices_together_says_so():
    problem = uniform_problem([1, 1], units=4, param_bytes=10 * MIB, memory_bytes=70 * MIB)
    with pytest.raises(PlanError, match=r"no placement of the 4 units fits in memory: .* state alone take 160 MiB"):
        plan(problem)


def test_evaluating_a_plan_that_does_not_fit_names_the_stage():
    problem = uniform_problem([1, 1], units=4, param_bytes=10 * MIB, memory_bytes=[200 * MIB, 50 * MIB])
    with pytest.raises(PlanError, match=r"units u0\.\.u1 need 81 MiB on dev1 \(state 80 MiB.*dev1 has 50 MiB"):
        evaluate(problem, [(0, 2, ("dev1",)), (2, 4, ("dev0",))])
