"""Data-parallel groups (Asteroid, DLion): devices sharing a stage split each micro-batch by speed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from edgert.exporter.planner.solver import evaluate, plan
from tests.planner.planner_instances import MIB, uniform_problem


def _one_heavy_unit(slowdowns, bandwidth=1e9, **options):
    """A single unit (no cut can split it): backward 20 ms x slowdown, 1 MiB of parameters."""
    return uniform_problem(slowdowns, units=1, forward_ms=10.0, backward_ms=20.0, param_bytes=MIB,
                           bandwidth=bandwidth, micro_batches=4, **options)


ALLREDUCE_MS = 2 * MIB / 1e9 * 1000 / 4  # 2 x parameters over 1 GB/s, once per 4 micro-batches


def test_two_equal_devices_share_a_stage_when_compute_dominates():
    alone = plan(_one_heavy_unit([1, 1]))
    shared = plan(_one_heavy_unit([1, 1], allow_groups=True))
    assert alone.bottleneck_ms == pytest.approx(20.0)
    assert [s.devices for s in shared.stages] == [("dev0", "dev1")]
    assert shared.stages[0].shares == pytest.approx((0.5, 0.5))
    assert shared.bottleneck_ms == pytest.approx(10.0 + ALLREDUCE_MS)
    assert shared.bottleneck_ms < alone.bottleneck_ms / 1.9


def test_shares_follow_speed():
    shared = plan(_one_heavy_unit([1, 2], allow_groups=True))
    stage = shared.stages[0]
    assert dict(zip(stage.devices, stage.shares)) == pytest.approx({"dev0": 2 / 3, "dev1": 1 / 3})
    assert stage.compute_ms == pytest.approx(1 / (1 / 20 + 1 / 40) + ALLREDUCE_MS)
    assert stage.forward_threads == stage.backward_threads == (2, 2)


def test_no_group_when_the_allreduce_costs_more_than_it_saves():
    # 2 MiB over 1 MB/s every 4 micro-batches: 524 ms per micro-batch, against 10 ms saved.
    placement = plan(_one_heavy_unit([1, 1], bandwidth=1e6, allow_groups=True))
    assert [s.devices for s in placement.stages] == [("dev0",)]
    assert placement.unused_devices == ("dev1",)


def test_async_pays_the_allreduce_every_micro_batch():
    placement = evaluate(_one_heavy_unit([1, 1], schedule="async", allow_groups=True), [(0, 1, ("dev0", "dev1"))])
    assert placement.bottleneck_ms == pytest.approx(10.0 + 4 * ALLREDUCE_MS)


def test_hybrid_pipeline_of_a_group_and_a_single_device():
    # Two compute-heavy units with few parameters, then a light unit with 64 MiB of parameters:
    # a 3-device group takes the heavy units (the all-reduce is cheap there), one device the rest.
    heavy, light = (10.0, 20.0, MIB // 10), (1.0, 2.0, 64 * MIB)
    costs = [heavy, heavy, light]
    problem = uniform_problem([1, 1, 1, 1], units=3, allow_groups=True)
    units = tuple(replace(unit, param_bytes=params) for unit, (_, _, params) in zip(problem.units, costs))
    devices = tuple(replace(d, forward_ms=tuple(f for f, _, _ in costs), backward_ms=tuple(b for _, b, _ in costs))
                    for d in problem.devices)
    placement = plan(replace(problem, units=units, devices=devices))
    assert [(s.first, s.end, len(s.devices)) for s in placement.stages] == [(0, 2, 3), (2, 3, 1)]
    allreduce = 2 * 2 * (MIB // 10) / 1e9 * 1000 / 4
    assert placement.bottleneck_ms == pytest.approx(60.0 / 3 + allreduce)
    pipeline_only = plan(replace(problem, units=units, devices=devices, allow_groups=False))
    assert pipeline_only.bottleneck_ms == pytest.approx(30.0)
