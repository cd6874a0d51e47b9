"""``POST /run``'s segment: its windows, its checkpoint steps, and a malformed command refused."""

import pytest

from edgert.protocol import ProtocolError, Segment
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
