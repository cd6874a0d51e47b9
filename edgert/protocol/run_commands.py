"""``POST /run`` and ``POST /stop``: segments of steps under a schedule, hold and truncate, a stop's reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgert.errors import ProtocolError
from edgert.protocol.resources import MAX_REASON_BYTES, MAX_SEGMENT_STEPS, load_meta
from edgert.schedule import SCHEDULES, MicroBatch, Schedule, Window, split_batch
from edgert.transport import Envelope
from edgert.typed_data import at_least, one_of, satisfies, to_data


@dataclass(frozen=True)
class Segment:
    """``POST /run``: run steps ``first_step .. first_step + steps - 1`` under a schedule.

    Every step is one batch of ``batch_size`` samples. Synchronous schedules split it into
    ``micro_batches`` and step the optimizer once per batch; ``async`` sends each batch
    through the pipeline as one micro-batch with its own optimizer step, and drains only at
    the end of the segment. After each of ``checkpoint_steps`` every stage sends its state to
    the coordinator, which evaluates from those copies without draining (an epoch's end
    inside an ``async`` segment).
    """

    schedule: str = field(metadata=one_of(SCHEDULES))
    stages: int = field(metadata=at_least(1))
    first_step: int = field(metadata=at_least(0))
    steps: int = field(metadata=satisfies(lambda steps: 1 <= steps <= MAX_SEGMENT_STEPS,
                                          f"must be 1 to {MAX_SEGMENT_STEPS} (MAX_SEGMENT_STEPS)"))
    batch_size: int = field(metadata=at_least(1))
    micro_batches: int = field(metadata=at_least(1))
    checkpoint_steps: tuple[int, ...] = ()

    def windows(self) -> list[Window]:
        """The windows the stage executes for this segment, in order."""
        if self.schedule == Schedule.ASYNC:
            batches = tuple(MicroBatch(self.first_step + k, 0, self.batch_size, 1.0) for k in range(self.steps))
            return [Window(self.schedule, self.stages, batches)]
        return [Window(self.schedule, self.stages, tuple(split_batch(step, self.batch_size, self.micro_batches)))
                for step in range(self.first_step, self.first_step + self.steps)]

    def microbatches(self, step: int) -> list[MicroBatch]:
        """The micro-batches of one step (how a /batch message is split)."""
        if self.schedule == Schedule.ASYNC:
            return [MicroBatch(step, 0, self.batch_size, 1.0)]
        return split_batch(step, self.batch_size, self.micro_batches)

    @property
    def last_step(self) -> int:
        return self.first_step + self.steps - 1

    def to_envelope(self, run_id: str) -> Envelope:
        return Envelope(kind="control", run_id=run_id, step=self.first_step,
                        meta={"command": "run", **to_data(self)})

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> Segment:
        meta = {key: value for key, value in envelope.meta.items() if key != "command"}
        segment = load_meta(cls, meta, "run command")
        if segment.micro_batches > segment.batch_size:
            raise ProtocolError(f"run command is out of range: micro_batches {segment.micro_batches} above "
                                f"batch_size {segment.batch_size}")
        if any(not segment.first_step <= s <= segment.last_step for s in segment.checkpoint_steps):
            raise ProtocolError(f"run command's checkpoint_steps {list(segment.checkpoint_steps)} are not all in "
                                f"steps {segment.first_step}..{segment.last_step}")
        return segment


def hold_envelope(run_id: str) -> Envelope:
    """``POST /run`` with ``meta.command = "hold"``: begin no new step and commit (backward, optimizer
    step) no later step; the reply's ``meta.begun`` and ``meta.committed`` are the latest step this
    stage has begun and committed (-1: none). A truncation releases the hold."""
    return Envelope(kind="control", run_id=run_id, meta={"command": "hold"})


def truncate_envelope(run_id: str, last_step: int) -> Envelope:
    """``POST /run`` with ``meta.command = "truncate"``: no step after ``last_step`` runs."""
    return Envelope(kind="control", run_id=run_id, step=last_step,
                    meta={"command": "truncate", **to_data(Truncate(last_step))})


@dataclass(frozen=True)
class Hold:
    """``POST /run`` ``hold`` (see :func:`hold_envelope`)."""


@dataclass(frozen=True)
class Truncate:
    """``POST /run`` ``truncate`` (see :func:`truncate_envelope`)."""

    last_step: int = field(metadata=at_least(0))


def run_command(envelope: Envelope) -> Segment | Hold | Truncate:
    """What a ``POST /run`` asks: ``meta.command`` hold, truncate, or anything else a segment."""
    command = envelope.meta.get("command")
    if command == "hold":
        return Hold()
    if command == "truncate":
        return load_meta(Truncate, {key: value for key, value in envelope.meta.items() if key != "command"},
                         "truncate")
    return Segment.from_envelope(envelope)


def stop_reason(payload: bytes | bytearray) -> str:
    """``POST /stop``'s body: why, as UTF-8 text of at most :data:`MAX_REASON_BYTES` without control characters."""
    if len(payload) > MAX_REASON_BYTES:
        raise ProtocolError(f"POST /stop: the reason is {len(payload)} bytes; at most {MAX_REASON_BYTES}")
    try:
        reason = bytes(payload).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ProtocolError(f"POST /stop: the reason is not UTF-8 text ({error.reason} at byte {error.start})") \
            from None
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in reason):
        raise ProtocolError("POST /stop: the reason holds control characters")
    return reason or "stopped by the coordinator"
