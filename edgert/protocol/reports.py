"""What workers tell the coordinator: step reports (``POST /report``), failures, ``/join``, ``/health``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

from edgert import meta_fields as fields
from edgert.errors import ProtocolError
from edgert.transport import Envelope


@dataclass
class StepReport:
    """What one stage did in one optimizer step."""

    step: int
    stage: int
    samples: int = 0
    loss_sum: float = 0.0
    correct: int | None = None
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    idle_ms: float = 0.0
    send_ms: float = 0.0
    slowdown_ms: float = 0.0
    replication_ms: float = 0.0
    replicated_bytes: int = 0
    started: float = 0.0
    finished: float = 0.0
    spans: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms + self.optimizer_ms


def reports_to_envelope(run_id: str, stage: int, worker: str, reports: list[StepReport]) -> Envelope:
    """``POST /report`` (to the coordinator): what one stage did in one or more steps."""
    rows = []
    for report in reports:
        row: dict[str, Any] = {k: v for k, v in asdict(report).items() if k != "spans"}
        row["spans"] = [[name, start, duration] for name, start, duration in report.spans]
        rows.append(row)
    return Envelope(kind="report", run_id=run_id, step=reports[-1].step if reports else 0, stage=stage,
                    meta={"worker": worker, "reports": rows})


@dataclass(frozen=True)
class StageReports:
    """``POST /report`` (to the coordinator): what one stage did in some steps, or (``failed``) the error
    that stopped it. ``worker`` is the name the sender gives (informative)."""

    stage: int
    worker: str
    reports: tuple[StepReport, ...] = ()
    failed: str | None = None

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> StageReports:
        meta = envelope.meta
        try:
            stage = fields.integer({"stage": envelope.stage}, "stage")
            worker = fields.text(meta, "worker", "")
            if "failed" in meta:
                return cls(stage, worker, failed=fields.text(meta, "failed"))
            return cls(stage, worker, tuple(_step_report(row, stage) for row in fields.listed(meta, "reports")))
        except fields.MALFORMED as error:
            raise ProtocolError(f"POST /report needs stage, meta.worker and meta.reports (a list of step reports) "
                                f"or meta.failed (text): {fields.why(error)}") from None


def _step_report(row: Any, stage: int) -> StepReport:
    """One entry of ``meta.reports``: every field of :class:`StepReport` with its own type; the loss may be
    NaN or infinite (a diverging run is reported, not refused)."""
    if not isinstance(row, dict):
        raise TypeError(f"a step report must be a map, got {type(row).__name__}")
    known = {f.name: f for f in dataclass_fields(StepReport)}
    unknown = set(row) - set(known)
    if unknown:
        raise ValueError(f"a step report has unknown field(s) {sorted(map(str, unknown))}")
    if fields.integer(row, "stage") != stage:
        raise ValueError(f"a step report of stage {row['stage']} in a message of stage {stage}")
    values: dict[str, Any] = {}
    for name, spec in known.items():
        if isinstance(spec.default, float):
            values[name] = fields.real(row, name, spec.default, finite=name != "loss_sum")
        elif isinstance(spec.default, int):
            values[name] = fields.integer(row, name, spec.default)
    correct = None if row.get("correct") is None else fields.integer(row, "correct")
    spans = [_span(span) for span in fields.listed(row, "spans", [])]
    return StepReport(step=fields.integer(row, "step"), stage=stage, correct=correct, spans=spans, **values)


def _span(span: Any) -> tuple[str, float, float]:
    if not isinstance(span, list) or len(span) != 3:
        raise TypeError(f"a span must be [name, start, seconds], got {span!r}")
    timing = {"start": span[1], "seconds": span[2]}
    return fields.text({"name": span[0]}, "name"), fields.real(timing, "start"), fields.real(timing, "seconds")


@dataclass(frozen=True)
class JoinRequest:
    """``POST /join`` (to the coordinator): a worker offers itself, reachable at ``url``."""

    url: str
    name: str = ""

    def to_envelope(self) -> Envelope:
        return Envelope(kind="control", meta={"url": self.url, "name": self.name})

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> JoinRequest:
        try:
            return cls(fields.url(envelope.meta.get("url"), "meta.url"), fields.text(envelope.meta, "name", ""))
        except fields.MALFORMED as error:
            raise ProtocolError(f"POST /join needs meta.url, the worker's URL, and optionally meta.name (text): "
                                f"{fields.why(error)}") from None


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
        return Envelope(kind="health", run_id=self.run_id, meta={k: v for k, v in asdict(self).items()})

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> Health:
        try:
            return cls(**envelope.meta)
        except TypeError as error:
            raise ProtocolError(f"health message is malformed: {error}") from None
