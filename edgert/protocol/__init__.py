"""The runtime's messages on top of the transport: resources, kinds and their ``meta``.

One place defines what the coordinator and the workers say to each other
(docs/PROTOCOL.md, "Runtime resources"). Every message is a transport
:class:`~edgert.transport.Envelope`; structured fields travel in ``meta`` (JSON-like),
tensors in ``tensors``.

Worker resources: ``/health`` (GET, observable), ``/stage`` (PUT: take a stage),
``/run`` (POST: run a segment of steps under a schedule), ``/batch`` (POST: a step's
inputs or labels from the coordinator), ``/act`` ``/grad`` (POST: tensors of a micro-batch
from a neighbour, or of a neighbouring group member's rows of it), ``/groupgrad`` (POST: a group member's
gradients for the others), ``/weights`` (GET/PUT: state by name), ``/stop`` (POST: abandon the
current run). Coordinator resources: ``/report`` (POST: step reports, :class:`StageReports`),
``/replica`` (PUT: central copies), ``/join`` (POST: :class:`JoinRequest`), ``/weights``
(FETCH: :class:`WeightsQuery` with ``copy_step``).

Each request body a worker or the coordinator takes is read into one of the dataclasses here by its
``from_envelope`` (or :func:`stop_reason`): :func:`~edgert.protocol.resources.load_meta`
(:mod:`edgert.typed_data`, each field's rule in its metadata), then the message's cross-field
checks; anything malformed raises :class:`ProtocolError` (a 4.00 naming the field); handlers
only see typed messages.

Map of the package (every name is also importable from ``edgert.protocol``):

- ``resources.py``         resource names, message kinds, limits, field rules; :func:`load_meta`, :func:`read_request`
  (a malformed body is a 4.00)
- ``stage_assignment.py``  :class:`StageAssignment` (``PUT /stage``, ``POST /profile``), :class:`Peers`,
  :class:`ProfileOptions`
- ``run_commands.py``      :class:`Segment` (``POST /run``), hold and truncate, :func:`stop_reason` (``POST /stop``)
- ``state_transfer.py``    :class:`WeightsQuery` (``FETCH /weights``), :class:`MigrateRequest` (``POST /migrate``)
- ``reports.py``           :class:`StepReport`, :class:`StageReports` (``POST /report``), :class:`JoinRequest`,
  :class:`Health`, failure reports
"""

from __future__ import annotations

from edgert.protocol.reports import Health, JoinRequest, StageReports, StepReport, failure_envelope, reports_to_envelope
from edgert.protocol.resources import (
    ACT,
    BATCH,
    CRL,
    DATA_KINDS,
    ECHO,
    GRAD,
    GROUP_GRAD,
    GROUP_GRAD_KIND,
    HEALTH,
    INBOX_CAPACITY,
    JOIN,
    LABELS,
    MAX_PROFILE_MICRO_BATCH,
    MAX_PROFILE_REPEATS,
    MAX_REASON_BYTES,
    MAX_SEGMENT_STEPS,
    MAX_STAGE_BYTES,
    MIGRATE,
    PROBE,
    PROFILE,
    REPLICA,
    REPORT,
    RUN,
    SELF,
    SIGNATURE,
    STAGE,
    STOP,
    WEIGHTS,
    is_url,
    read_request,
)
from edgert.protocol.run_commands import (
    Hold,
    Segment,
    Truncate,
    hold_envelope,
    run_command,
    stop_reason,
    truncate_envelope,
)
from edgert.protocol.stage_assignment import ASSIGNMENT_PIECES, Peers, ProfileOptions, StageAssignment, probe_target
from edgert.protocol.state_transfer import MigrateRequest, MigrationSource, WeightsQuery

__all__ = [
    "ACT",
    "ASSIGNMENT_PIECES",
    "BATCH",
    "CRL",
    "DATA_KINDS",
    "ECHO",
    "GRAD",
    "GROUP_GRAD",
    "GROUP_GRAD_KIND",
    "HEALTH",
    "Health",
    "Hold",
    "INBOX_CAPACITY",
    "JOIN",
    "JoinRequest",
    "LABELS",
    "MAX_PROFILE_MICRO_BATCH",
    "MAX_PROFILE_REPEATS",
    "MAX_REASON_BYTES",
    "MAX_SEGMENT_STEPS",
    "MAX_STAGE_BYTES",
    "MIGRATE",
    "MigrateRequest",
    "MigrationSource",
    "PROBE",
    "PROFILE",
    "Peers",
    "ProfileOptions",
    "REPLICA",
    "REPORT",
    "RUN",
    "SELF",
    "SIGNATURE",
    "STAGE",
    "STOP",
    "Segment",
    "StageAssignment",
    "StageReports",
    "StepReport",
    "Truncate",
    "WEIGHTS",
    "WeightsQuery",
    "failure_envelope",
    "hold_envelope",
    "is_url",
    "probe_target",
    "read_request",
    "reports_to_envelope",
    "run_command",
    "stop_reason",
    "truncate_envelope",
]
