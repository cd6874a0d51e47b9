"""The runtime's messages on top of the transport: resources, kinds and their ``meta``.

One place defines what the coordinator and the workers say to each other
(docs/PROTOCOL.md, "Runtime resources"). Every message is a transport
:class:`~edgert.transport.Envelope`; structured fields travel in ``meta`` (JSON-like),
tensors in ``tensors``.

Worker resources: ``/health`` (GET, observable), ``/stage`` (PUT: take a stage),
``/run`` (POST: run a segment of steps under a schedule), ``/batch`` (POST: a step's
inputs or labels from the coordinator), ``/act`` ``/grad`` (POST: tensors of a micro-batch
from a neighbour), ``/weights`` (GET/PUT: state by name), ``/stop`` (POST: abandon the
current run). Coordinator resource: ``/report`` (POST: step reports).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from edgert.errors import EdgertError
from edgert.executor import MicroBatch, StepReport, Window, split_batch
from edgert.manifest import StageEntry, TrainingConfig, stage_from_json, stage_to_json
from edgert.schedule import SCHEDULES
from edgert.transport import Envelope

HEALTH, STAGE, RUN, STOP, WEIGHTS, REPORT, BATCH = "health", "stage", "run", "stop", "weights", "report", "batch"
MIGRATE, PROFILE, PROBE, ECHO, REPLICA, JOIN = "migrate", "profile", "probe", "echo", "replica", "join"
ACT, GRAD, LABELS = "act", "grad", "labels"
DATA_KINDS = {ACT: "activations", GRAD: "gradients"}


class ProtocolError(EdgertError):
    """A message is well-formed CBOR but not what this resource expects."""


@dataclass(frozen=True)
class Peers:
    """Where a stage sends activations, gradients and reports."""

    previous: str | None
    next: str | None
    coordinator: str


@dataclass(frozen=True)
class StageAssignment:
    """``PUT /stage``: which stage a worker trains, with its artifact files."""

    run_id: str
    entry: StageEntry
    training: TrainingConfig
    stages: int
    peers: Peers
    forward_codec: str = "none"
    backward_codec: str = "none"
    forward_threads: int = 1
    backward_threads: int = 1
    wait_timeout: float = 120.0
    memory_mode: str = "recompute"
    replicate_every: int = 0  # steps between replicas to the next workers (0: never)
    central_every: int = 0  # steps between copies to the coordinator (0: never)
    replica_targets: tuple[str, ...] = ()

    def to_envelope(self, files: dict[str, bytes]) -> Envelope:
        meta = {
            "entry": json.dumps(stage_to_json(self.entry)),
            "training": json.dumps(asdict(self.training)),
            "stages": self.stages,
            "peers": asdict(self.peers),
            "forward_codec": self.forward_codec,
            "backward_codec": self.backward_codec,
            "forward_threads": self.forward_threads,
            "backward_threads": self.backward_threads,
            "wait_timeout": self.wait_timeout,
            "memory_mode": self.memory_mode,
            "replicate_every": self.replicate_every,
            "central_every": self.central_every,
            "replica_targets": list(self.replica_targets),
        }
        tensors = {role: np.frombuffer(data, dtype=np.uint8) for role, data in files.items()}
        return Envelope(kind="stage", run_id=self.run_id, stage=self.entry.index, tensors=tensors, meta=meta)

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> tuple[StageAssignment, dict[str, bytes]]:
        meta = envelope.meta
        try:
            training = json.loads(meta["training"])
            assignment = cls(
                run_id=envelope.run_id,
                entry=stage_from_json(json.loads(meta["entry"])),
                training=TrainingConfig(**{**training, "betas": tuple(training["betas"])}),
                stages=int(meta["stages"]),
                peers=Peers(**meta["peers"]),
                forward_codec=str(meta.get("forward_codec", "none")),
                backward_codec=str(meta.get("backward_codec", "none")),
                forward_threads=int(meta.get("forward_threads", 1)),
                backward_threads=int(meta.get("backward_threads", 1)),
                wait_timeout=float(meta.get("wait_timeout", 120.0)),
                memory_mode=str(meta.get("memory_mode", "recompute")),
                replicate_every=int(meta.get("replicate_every", 0)),
                central_every=int(meta.get("central_every", 0)),
                replica_targets=tuple(str(u) for u in meta.get("replica_targets", [])),
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as error:
            raise ProtocolError(f"stage assignment is malformed: {type(error).__name__}: {error}") from None
        files = {role: np.asarray(array, dtype=np.uint8).tobytes() for role, array in envelope.tensors.items()}
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
        if self.schedule == "async":
            batches = tuple(MicroBatch(self.first_step + k, 0, self.batch_size, 1.0) for k in range(self.steps))
            return [Window("async", self.stages, batches)]
        return [Window(self.schedule, self.stages, tuple(split_batch(step, self.batch_size, self.micro_batches)))
                for step in range(self.first_step, self.first_step + self.steps)]

    def microbatches(self, step: int) -> list[MicroBatch]:
        """The micro-batches of one step (how a /batch message is split)."""
        if self.schedule == "async":
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
            segment = cls(schedule=str(meta["schedule"]), stages=int(meta["stages"]),
                          first_step=int(meta["first_step"]), steps=int(meta["steps"]),
                          batch_size=int(meta["batch_size"]), micro_batches=int(meta["micro_batches"]),
                          checkpoint_steps=tuple(int(s) for s in meta.get("checkpoint_steps", ())))
        except (KeyError, TypeError, ValueError) as error:
            raise ProtocolError(f"run command is malformed: {type(error).__name__}: {error}") from None
        if segment.schedule not in SCHEDULES or min(segment.steps, segment.batch_size, segment.micro_batches) < 1:
            raise ProtocolError(f"run command is out of range: {segment}")
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


def reports_to_envelope(run_id: str, stage: int, worker: str, reports: list[StepReport]) -> Envelope:
    """``POST /report`` (to the coordinator): what one stage did in one or more steps."""
    rows = []
    for report in reports:
        row: dict[str, Any] = {k: v for k, v in asdict(report).items() if k != "spans"}
        row["spans"] = [[name, start, duration] for name, start, duration in report.spans]
        rows.append(row)
    return Envelope(kind="report", run_id=run_id, step=reports[-1].step if reports else 0, stage=stage,
                    meta={"worker": worker, "reports": rows})


def reports_from_envelope(envelope: Envelope) -> tuple[list[StepReport], str]:
    meta = envelope.meta
    worker = str(meta.get("worker", ""))
    reports = []
    try:
        for row in meta.get("reports", []):
            row = dict(row)
            spans = [(str(n), float(s), float(d)) for n, s, d in row.pop("spans", [])]
            reports.append(StepReport(**row, spans=spans))
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"step report is malformed: {error}") from None
    return reports, worker


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
