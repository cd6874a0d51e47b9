"""The runtime's messages on top of the transport: resources, kinds and their ``meta``.

One place defines what the coordinator and the workers say to each other
(docs/PROTOCOL.md, "Runtime resources"). Every message is a transport
:class:`~edgert.transport.Envelope`; structured fields travel in ``meta`` (JSON-like),
tensors in ``tensors``.

Worker resources: ``/health`` (GET, observable), ``/stage`` (PUT: take a stage),
``/run`` (POST: run a segment of steps under a schedule), ``/batch`` (POST: a step's
inputs or labels from the coordinator), ``/act`` ``/grad`` (POST: tensors of a micro-batch
from a neighbour), ``/weights`` (GET/PUT: state by name), ``/stop`` (POST: abandon the
current run). Coordinator resources: ``/report`` (POST: step reports, :class:`StageReports`),
``/replica`` (PUT: central copies), ``/join`` (POST: :class:`JoinRequest`), ``/weights``
(FETCH: :class:`WeightsQuery` with ``copy_step``).

Each request body a worker or the coordinator takes is read into one of the dataclasses here by its
``from_envelope`` (or :func:`stop_reason`), which raises :class:`ProtocolError` (a 4.00
naming the field) for anything malformed; handlers only see typed messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edgert import meta_fields as fields
from edgert.errors import ProtocolError
from edgert.manifest import ArtifactFile, StageEntry, needed_roles
from edgert.run_settings import RunSettings
from edgert.schedule import SCHEDULES, MicroBatch, Schedule, Window, split_batch
from edgert.transport import BadRequest, Envelope
from edgert.transport.urls import parse_url
from edgert.typed_data import at_least, load_dataclass, satisfies, to_data

HEALTH, STAGE, RUN, STOP, WEIGHTS, REPORT, BATCH = "health", "stage", "run", "stop", "weights", "report", "batch"
MIGRATE, PROFILE, PROBE, ECHO, REPLICA, JOIN = "migrate", "profile", "probe", "echo", "replica", "join"
ACT, GRAD, LABELS = "act", "grad", "labels"
DATA_KINDS = {ACT: "activations", GRAD: "gradients"}
SELF = "self"  # a migration source meaning "the state this worker held itself"
SIGNATURE, CRL = "signature", "crl"  # a stage's meta fields set by its signer (edgert.security.admission)
MAX_REASON_BYTES = 1024  # a /stop reason
INBOX_CAPACITY = 256  # messages a worker's inbox holds; the coordinator feeds no further ahead than fits
MAX_SEGMENT_STEPS = 100_000  # steps of one /run segment (a worker queues one window per step)


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


T = TypeVar("T")


def read_request(parse: Callable[[Any], T], body: Any) -> T:
    """``parse(body)`` (a ``from_envelope``, or a reader of a request's payload) in a handler: a malformed
    message is answered 4.00."""
    try:
        return parse(body)
    except ProtocolError as error:
        raise BadRequest(str(error)) from None


def _url(value: str) -> bool:
    """A worker or coordinator URL (raises ValueError with the reason otherwise)."""
    parse_url(value)
    return True


OPTIONAL_URL = satisfies(lambda value: value == "" or _url(value), "must be a worker URL or \"\"")


@dataclass(frozen=True)
class Peers:
    """Where a stage sends activations, gradients and reports; over TLS the neighbours' credential names
    are the only senders of its activations (``previous_name``) and gradients (``next_name``)."""

    previous: str | None = field(metadata=OPTIONAL_URL)  # None (or ""): the first stage
    next: str | None = field(metadata=OPTIONAL_URL)  # None (or ""): the last stage
    coordinator: str = field(metadata=OPTIONAL_URL)  # "": none (a stage sent to be profiled)
    previous_name: str | None = None
    next_name: str | None = None


@dataclass(frozen=True)
class StageAssignment:
    """``PUT /stage`` (and ``POST /profile``): which stage a worker trains, under the run's settings.

    ``meta`` is every field but ``run_id`` (the envelope's), written and read by
    :mod:`edgert.typed_data` (docs/PROTOCOL.md, "The stage assignment"); the artifact files
    travel as uint8 tensors named by role.
    """

    run_id: str
    entry: StageEntry
    stages: int = field(metadata=at_least(1))
    peers: Peers
    settings: RunSettings
    replica_targets: tuple[str, ...] = field(default=(), metadata=satisfies(
        lambda urls: all(_url(u) for u in urls), "must be worker URLs"))

    @property
    def roles(self) -> tuple[str, ...]:
        """The artifact roles this stage needs (its memory mode decides the stash files)."""
        return needed_roles(self.entry, self.settings.memory_mode)

    @property
    def artifacts(self) -> tuple[ArtifactFile, ...]:
        """The entry's artifact files the worker gets: those of :attr:`roles`."""
        return tuple(a for a in self.entry.artifacts if a.role in self.roles)

    def read_files(self, plan_dir: Path) -> dict[str, bytes]:
        """The files to send with this assignment, by role, read from the plan folder."""
        return {a.role: (plan_dir / a.path).read_bytes() for a in self.artifacts}

    def to_envelope(self, files: dict[str, bytes]) -> Envelope:
        meta = to_data(self)
        del meta["run_id"]
        tensors = {role: np.frombuffer(data, dtype=np.uint8) for role, data in files.items()}
        return Envelope(kind="stage", run_id=self.run_id, stage=self.entry.index, tensors=tensors, meta=meta)

    @classmethod
    def from_envelope(cls, envelope: Envelope,
                      beside: tuple[str, ...] = ()) -> tuple[StageAssignment, dict[str, bytes]]:
        """The assignment and its files; ``meta`` may hold nothing else but the signature fields and
        ``beside`` (another message's fields sharing the meta: ``POST /profile``'s options)."""
        meta = {key: value for key, value in envelope.meta.items() if key not in (SIGNATURE, CRL, *beside)}
        if "run_id" in meta:
            raise ProtocolError("stage assignment is malformed: unknown field 'run_id' (the envelope's run_id "
                                "names the run)")
        try:
            assignment = load_dataclass(cls, {**meta, "run_id": envelope.run_id}, "meta", ProtocolError)
        except ProtocolError as error:
            raise ProtocolError(f"stage assignment is malformed: {error}") from None
        entry = assignment.entry
        if not assignment.run_id:
            raise ProtocolError("stage assignment has no run_id")
        if envelope.stage != entry.index or entry.index >= assignment.stages:
            raise ProtocolError(f"stage assignment: envelope stage {envelope.stage}, entry index {entry.index} and "
                                f"{assignment.stages} stages do not agree")
        files = {}
        for role, array in envelope.tensors.items():
            if array.dtype != np.uint8 or array.ndim != 1:
                raise ProtocolError(f"stage assignment: file {role!r} must be a 1-D uint8 tensor")
            files[role] = array.tobytes()
        return assignment, files


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

    schedule: str
    stages: int
    first_step: int
    steps: int
    batch_size: int
    micro_batches: int
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
                        meta={"command": "run", **asdict(self), "checkpoint_steps": list(self.checkpoint_steps)})

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> Segment:
        meta = envelope.meta
        try:
            segment = cls(schedule=fields.text(meta, "schedule"), stages=fields.integer(meta, "stages", minimum=1),
                          first_step=fields.integer(meta, "first_step"), steps=fields.integer(meta, "steps", minimum=1),
                          batch_size=fields.integer(meta, "batch_size", minimum=1),
                          micro_batches=fields.integer(meta, "micro_batches", minimum=1),
                          checkpoint_steps=tuple(fields.integer({"step": s}, "step")
                                                 for s in fields.listed(meta, "checkpoint_steps", [])))
        except fields.MALFORMED as error:
            raise ProtocolError(f"run command is malformed: {fields.why(error)}") from None
        if segment.schedule not in SCHEDULES or segment.micro_batches > segment.batch_size \
                or segment.steps > MAX_SEGMENT_STEPS:
            raise ProtocolError(f"run command is out of range (schedule one of {', '.join(SCHEDULES)}, "
                                f"micro_batches <= batch_size, steps <= {MAX_SEGMENT_STEPS}): {segment}")
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
                    meta={"command": "truncate", "last_step": last_step})


@dataclass(frozen=True)
class Hold:
    """``POST /run`` ``hold`` (see :func:`hold_envelope`)."""


@dataclass(frozen=True)
class Truncate:
    """``POST /run`` ``truncate`` (see :func:`truncate_envelope`)."""

    last_step: int


def run_command(envelope: Envelope) -> Segment | Hold | Truncate:
    """What a ``POST /run`` asks: ``meta.command`` hold, truncate, or anything else a segment."""
    command = envelope.meta.get("command")
    if command == "hold":
        return Hold()
    if command == "truncate":
        try:
            return Truncate(fields.integer(envelope.meta, "last_step"))
        except fields.MALFORMED as error:
            raise ProtocolError(f"truncate needs meta.last_step, a step number: {fields.why(error)}") from None
    return Segment.from_envelope(envelope)


@dataclass(frozen=True)
class WeightsQuery:
    """``FETCH /weights``: these parameters, from the copy after ``copy_step``, or from the stage held before
    the latest assignment (``previous``), else from the current stage."""

    names: tuple[str, ...]
    copy_step: int | None = None
    previous: bool = False

    def to_envelope(self, run_id: str) -> Envelope:
        meta: dict[str, Any] = {"names": list(self.names), "previous": self.previous}
        if self.copy_step is not None:
            meta["copy_step"] = self.copy_step
        return Envelope(kind="control", run_id=run_id, meta=meta)

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> WeightsQuery:
        meta = envelope.meta
        if envelope.kind != "control":
            raise ProtocolError(f"FETCH /weights takes a 'control' envelope, got {envelope.kind!r}")
        try:
            return cls(names=fields.names(meta), copy_step=fields.integer(meta, "copy_step", None),
                       previous=fields.flag(meta, "previous", False))
        except fields.MALFORMED as error:
            raise ProtocolError(f"FETCH /weights needs meta.names, a list of parameter names, and optionally "
                                f"copy_step (a step) or previous (a bool): {fields.why(error)}") from None


@dataclass(frozen=True)
class MigrationSource:
    """Where part of a stage's state comes from: a worker URL (or :data:`SELF`) and the names it gives."""

    url: str
    names: tuple[str, ...]
    previous: bool = True
    copy_step: int | None = None

    def query(self) -> WeightsQuery:
        return WeightsQuery(self.names, self.copy_step, self.previous)


@dataclass(frozen=True)
class MigrateRequest:
    """``POST /migrate``: fetch these sources' state into the stage."""

    sources: tuple[MigrationSource, ...]

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> MigrateRequest:
        try:
            sources = []
            for item in fields.listed(envelope.meta, "sources"):
                if not isinstance(item, dict):
                    raise TypeError(f"a source must be a map, got {type(item).__name__}")
                where = item["url"] if item.get("url") == SELF else fields.url(item.get("url"), "url")
                sources.append(MigrationSource(where, fields.names(item), fields.flag(item, "previous", True),
                                               fields.integer(item, "copy_step", None)))
        except fields.MALFORMED as error:
            raise ProtocolError(f"POST /migrate needs meta.sources, a list of {{url, names, previous?, "
                                f"copy_step?}}: {fields.why(error)}") from None
        return cls(tuple(sources))


MAX_PROFILE_MICRO_BATCH, MAX_PROFILE_REPEATS = 4096, 100


@dataclass(frozen=True)
class ProfileOptions:
    """``POST /profile``'s own fields (beside the stage assignment): micro-batch size and repetitions.

    The defaults are also ``edgert profile``'s and :func:`edgert.coordinator.profiling.profile_devices`'.
    """

    micro_batch: int = 16
    repeats: int = 5

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> ProfileOptions:
        try:
            meta = envelope.meta
            options = cls(fields.integer(meta, "micro_batch", cls.micro_batch, 1),
                          fields.integer(meta, "repeats", cls.repeats, 1))
        except fields.MALFORMED as error:
            raise ProtocolError(f"POST /profile: {fields.why(error)}") from None
        if options.micro_batch > MAX_PROFILE_MICRO_BATCH or options.repeats > MAX_PROFILE_REPEATS:
            raise ProtocolError(f"POST /profile: micro_batch {options.micro_batch} or repeats {options.repeats} "
                                f"beyond {MAX_PROFILE_MICRO_BATCH} and {MAX_PROFILE_REPEATS}")
        return options


def probe_target(envelope: Envelope) -> str:
    """``POST /probe``'s ``meta.target``: the worker URL to time the link to."""
    try:
        return fields.url(envelope.meta.get("target"), "meta.target")
    except fields.MALFORMED as error:
        raise ProtocolError(f"POST /probe needs meta.target, a worker URL: {error}") from None


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
