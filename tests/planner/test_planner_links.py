"""Link codecs: compression only on a link that would otherwise be the bottleneck, and no stronger than needed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from edgert.exporter.planner.solver import plan
from tests.planner.planner_instances import uniform_problem


def _slow_device_problem(slow_bandwidth: float, **options):
    """Three equal devices; dev2 reaches the others only over ``slow_bandwidth``; 1 MB crosses each cut."""
    problem = uniform_problem([1, 1, 1], units=3, input_bytes=125_000, micro_batch=8, bandwidth=1e9, **options)
    bandwidth = [list(row) for row in problem.bandwidth]
    for other in (0, 1):
        bandwidth[2][other] = bandwidth[other][2] = slow_bandwidth
    return replace(problem, bandwidth=tuple(map(tuple, bandwidth)))


def test_int8_only_on_the_slow_link():
    # One unit per stage: compute 3 ms (last stage 2 ms). The slow link takes 10 ms raw, 5 ms in fp16, 2.5 in int8.
    placement = plan(_slow_device_problem(1e8))
    assert len(placement.stages) == 3
    slow = [i for i, (a, b) in enumerate(zip(placement.stages, placement.stages[1:]))
            if "dev2" in a.devices + b.devices]
    assert len(slow) == 1
    assert placement.link_codecs[slow[0]] == "int8"
    assert placement.link_ms[slow[0]] == pytest.approx(2.5)
    assert [c for i, c in enumerate(placement.link_codecs) if i != slow[0]] == ["none"]
    assert placement.bottleneck_ms == pytest.approx(3.0)


def test_the_weakest_codec_that_is_enough():
    placement = plan(_slow_device_problem(2.5e8))  # raw 4 ms, fp16 2 ms: fp16 is enough
    assert sorted(placement.link_codecs) == ["fp16", "none"]
    assert placement.bottleneck_ms == pytest.approx(3.0)


def test_no_codec_when_compute_is_the_bottleneck():
    placement = plan(_slow_device_problem(5e8))  # raw 2 ms < 3 ms of compute
    assert placement.link_codecs == ("none", "none")


def test_without_codecs_the_slow_device_is_left_out():
    placement = plan(_slow_device_problem(1e8, codecs={"none": 1.0}))
    assert placement.unused_devices == ("dev2",)
    assert placement.bottleneck_ms == pytest.approx(4.0)  # 1 unit x 3 ms | 2 units x 2 ms
    assert placement.link_codecs == ("none",)


def test_rtt_counts_half_and_compression_only_when_it_helps():
    # Six units on two devices: compute at best 3 x 2 | 2 x 4 = 8 ms; the link adds rtt / 2 = 9 ms.
    placement = plan(uniform_problem([1, 1], units=6, input_bytes=0, rtt_ms=18.0))
    assert placement.link_ms == (pytest.approx(9.0),)
    assert placement.bottleneck_ms == pytest.approx(9.0)  # still better than one device's 12 ms
    assert placement.link_codecs == ("none",)  # nothing to compress: no codec shortens it


def test_the_strongest_codec_when_the_link_stays_the_bottleneck():
    # Compute: one device 6 x 20 = 120 ms; two at best 2 x 30 | 4 x 20 = 80 ms. The link carries
    # 8 MB at 20 MB/s: 400 ms raw, 100 ms in int8: the bottleneck, yet better than one device.
    problem = uniform_problem([1, 1], units=6, forward_ms=10.0, backward_ms=20.0, input_bytes=1_000_000,
                              micro_batch=8, bandwidth=2e7)
    placement = plan(problem)
    assert placement.unused_devices == ()
    assert placement.link_codecs == ("int8",)
    assert placement.link_ms == (pytest.approx(100.0),)
    assert placement.bottleneck_ms == pytest.approx(100.0)
