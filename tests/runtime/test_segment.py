"""``POST /run``'s segment: its windows, its checkpoint steps, and a malformed command refused."""

import numpy as np
import pytest

from edgert.coordinator.data import Batch
from edgert.coordinator.segments import next_segment
from edgert.errors import ProtocolError
from edgert.protocol import MAX_SEGMENT_STEPS, Segment
from edgert.transport import Envelope
from edgert.transport.envelope import decode_envelope, encode_envelope


def wire(segment: Segment) -> Segment:
    """The segment after a trip through the wire format."""
    return Segment.from_envelope(decode_envelope(encode_envelope(segment.to_envelope("r1"))))


def test_checkpoint_steps_survive_the_wire():
    segment = Segment("async", 3, first_step=10, steps=50, batch_size=64, micro_batches=1, checkpoint_steps=(21, 43))
    assert wire(segment) == segment
    assert len(segment.windows()) == 1  # async: one window across the epoch ends, no drain between


def test_a_segment_without_checkpoint_steps_has_none():
    meta = {"command": "run", "schedule": "1f1b", "stages": 2, "first_step": 0, "steps": 4, "batch_size": 8,
            "micro_batches": 2}
    assert Segment.from_envelope(Envelope(kind="control", run_id="r1", meta=meta)).checkpoint_steps == ()


@pytest.mark.parametrize("steps,message", [([9], "not all in steps 10..59"), ([60], "not all in steps 10..59"),
                                           (["x"], "malformed"), (5, "malformed")])
def test_checkpoint_steps_outside_the_segment_are_refused(steps, message):
    meta = {"command": "run", "schedule": "async", "stages": 3, "first_step": 10, "steps": 50, "batch_size": 64,
            "micro_batches": 1, "checkpoint_steps": steps}
    with pytest.raises(ProtocolError, match=message):
        Segment.from_envelope(Envelope(kind="control", run_id="r1", meta=meta))


def segments_of(plan: list[Batch], schedule: str) -> list[tuple[int, int, bool]]:
    """(first step, steps, ends an epoch) of each segment the coordinator sends for ``plan``; each a worker takes."""
    segments, position = [], 0
    while position < len(plan):
        chunk, ends_epoch = next_segment(plan[position:], schedule, forced=set())
        segment = Segment(schedule, 3, chunk[0].step, len(chunk), batch_size=8, micro_batches=2)
        assert wire(segment) == segment
        segments.append((chunk[0].step, len(chunk), ends_epoch))
        position += len(chunk)
    return segments


def plan_of(epochs: int, per_epoch: int) -> list[Batch]:
    no_samples = np.empty(0, dtype=np.int64)
    return [Batch(step // per_epoch, step, no_samples) for step in range(epochs * per_epoch)]


def test_an_async_segment_runs_on_across_epoch_ends():
    assert segments_of(plan_of(3, 10), "async") == [(0, 30, True)]
    assert segments_of(plan_of(3, 10), "1f1b") == [(0, 10, True), (10, 10, True), (20, 10, True)]


@pytest.mark.parametrize("schedule", ["async", "gpipe"])
def test_a_run_longer_than_one_segment_is_cut_into_segments_a_worker_takes(schedule):
    """Two epochs of 1.5 segments each: cut after MAX_SEGMENT_STEPS steps (a worker refuses more), and at
    every epoch's end (under async only where a cut falls anyway)."""
    cap, half = MAX_SEGMENT_STEPS, MAX_SEGMENT_STEPS // 2
    expected = [(0, cap, False), (cap, half, True), (cap + half, cap, False), (2 * cap + half, half, True)]
    if schedule == "async":  # the second segment runs on into the second epoch
        expected = [(0, cap, False), (cap, cap, False), (2 * cap, cap, True)]
    assert segments_of(plan_of(2, cap + half), schedule) == expected
