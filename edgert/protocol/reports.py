"""What workers tell the coordinator: step reports (``POST /report``), failures, ``/join``, ``/health``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from edgert.errors import ProtocolError
from edgert.protocol.resources import URL, load_meta
from edgert.transport import Envelope
from edgert.typed_data import at_least, non_finite, to_data

COUNT = at_least(0)  # a step, a stage, a number of samples or bytes


@dataclass
class StepReport:
    """What one stage did in one optimizer step (the loss may be NaN or infinite: a diverging run is reported,
    not refused)."""

    step: int = field(metadata=COUNT)
    stage: int = field(metadata=COUNT)
    samples: int = field(default=0, metadata=COUNT)
    loss_sum: float = field(default=0.0, metadata=non_finite())
    correct: int | None = field(default=None, metadata=COUNT)
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    idle_ms: float = 0.0
    send_ms: float = 0.0
    slowdown_ms: float = 0.0
    replication_ms: float = 0.0
    replicated_bytes: int = field(default=0, metadata=COUNT)
    started: float = 0.0
    finished: float = 0.0
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # [name, start, seconds]

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms + self.optimizer_ms


def reports_to_envelope(run_id: str, stage: int, worker: str, reports: list[StepReport]) -> Envelope:
    """``POST /report`` (to the coordinator): what one stage did in one or more steps."""
    return Envelope(kind="report", run_id=run_id, step=reports[-1].step if reports else 0, stage=stage,
                    meta={"worker": worker, "reports": to_data(reports)})


@dataclass(frozen=True)
class StageReports:
    """``POST /report`` (to the coordinator): what one stage did in some steps, or (``failed``) the error
    that stopped it. ``worker`` is the name the sender gives (informative)."""

    stage: int = field(metadata=COUNT)
    worker: str = ""
    reports: tuple[StepReport, ...] = ()
    failed: str | None = None

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> StageReports:
        message = load_meta(cls, envelope.meta, "POST /report", stage=envelope.stage)
        if message.failed is not None:
            return replace(message, reports=())
        if "reports" not in envelope.meta:
            raise ProtocolError("POST /report is malformed: meta.reports or meta.failed: missing")
        for k, report in enumerate(message.reports):
            if report.stage != message.stage:
                raise ProtocolError(f"POST /report: meta.reports[{k}] is of stage {report.stage} in a message of "
                                    f"stage {message.stage}")
        return message


@dataclass(frozen=True)
class JoinRequest:
    """``POST /join`` (to the coordinator): a worker offers itself, reachable at ``url``."""

    url: str = field(metadata=URL)
    name: str = ""

    def to_envelope(self) -> Envelope:
        return Envelope(kind="control", meta=to_data(self))

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> JoinRequest:
        return load_meta(cls, envelope.meta, "POST /join")


def failure_envelope(run_id: str, stage: int, worker: str, message: str) -> Envelope:
    """``POST /report`` with ``meta.failed``: the stage stopped with an error."""
    return Envelope(kind="report", run_id=run_id, stage=stage, meta={"failed": message, "worker": worker})


@dataclass
class Health:
    """``GET /health``: what a worker is doing."""

    name: str
    state: str  # idle | loaded | running | failed
    run_id: str = ""
    stage: int = -1
    step: int = -1
    detail: str = ""
    slowdown: str = "0:1"
    activity: str = "idle"  # forward N, backward N, step N, replicating, migrating...
    extra: dict[str, Any] = field(default_factory=dict)

    def to_envelope(self) -> Envelope:
        return Envelope(kind="health", run_id=self.run_id, meta=to_data(self))

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> Health:
        return load_meta(cls, envelope.meta, "health message")
