"""What the coordinator lets in: reports, central copies and copy queries of this run, from its workers.

The coordinator's own resources are checked here before its ledger or its copy store sees
them (docs/SECURITY.md, "Requests the coordinator refuses"):

- *which run*: every report, copy and copy query carries this run's id (4.00 otherwise);
- *which stage, from whom*: a report or a copy is of a stage of the current plan (4.00
  otherwise) and, over TLS, comes from the credential of the worker that stage is assigned
  to (4.03 otherwise); on plaintext (``--insecure``) nobody is authenticated and the origin
  recorded is the sender's address, never ``meta.origin``;
- *when*: a copy is taken after a step this run has sent to its workers (4.00 otherwise);
- *how much*: a copy larger than its stage's whole state (parameters, running statistics,
  optimizer state: :func:`edgert.weights.state_bytes_bound` of the plan's stage) is refused
  from its size, before a byte of it is kept (4.13), so a refusal keeps nothing.
"""

from __future__ import annotations

from edgert.manifest import Manifest
from edgert.optimizer import make_optimizer
from edgert.protocol import StageReports, WeightsQuery, read_request
from edgert.transport import BadRequest, Envelope, Request, TooLarge
from edgert.transport.errors import Forbidden
from edgert.weights import state_bytes_bound


def check_run(envelope: Envelope, run_id: str, what: str) -> None:
    """Refuse (4.00) a message of another run."""
    if envelope.run_id != run_id:
        raise BadRequest(f"{what} of run {envelope.run_id!r}; this is run {run_id!r}")


def sender(request: Request, stage: int, names: list[str], what: str,
           members: list[tuple[str, ...]] | None = None) -> str:
    """Who sent ``what`` about ``stage``: the credential's name over TLS, which must be the name of the
    worker the stage is assigned to, or of a member of its group where ``members`` (each stage's workers'
    names) is given (4.03 otherwise); on plaintext, the sender's address."""
    if not 0 <= stage < len(names):
        raise BadRequest(f"{what} of stage {stage}; the plan has stages 0 to {len(names) - 1}")
    if request.identity is None:
        return request.peer
    if members is not None and stage < len(members) and len(members[stage]) > 1:
        if request.identity.name not in members[stage]:
            raise Forbidden(f"{what} of stage {stage} comes only from its group's workers {list(members[stage])}, "
                            f"not {request.identity}")
        return request.identity.name
    if request.identity.name != names[stage]:
        raise Forbidden(f"{what} of stage {stage} comes only from its worker {names[stage]!r}, "
                        f"not {request.identity}")
    return request.identity.name


def read_report(request: Request, run_id: str, names: list[str],
                members: list[tuple[str, ...]] | None = None) -> StageReports:
    """A ``POST /report`` of this run, of a stage of the plan, from its worker or a member of its group (see
    :func:`sender`)."""
    check_run(request.envelope, run_id, "a report")
    message = read_request(StageReports.from_envelope, request.envelope)
    sender(request, message.stage, names, "a report", members)
    return message


def central_copy_origin(request: Request, envelope: Envelope, size: int, run_id: str, names: list[str],
                        announced_through: int, manifest: Manifest) -> str:
    """Check a ``PUT /replica`` (``envelope``: the copy's header, or its first piece's; ``size``: its bytes)
    before anything of it is kept; returns the origin to record it under."""
    check_run(envelope, run_id, "a copy")
    origin = sender(request, envelope.stage, names, "a copy")
    bound = stage_state_bound(manifest, envelope.stage)
    if size > bound:
        raise TooLarge(f"a copy of {size} bytes of stage {envelope.stage}, whose whole state takes at most "
                       f"{bound} bytes", size1=bound)
    if not 0 <= envelope.step <= announced_through:
        raise BadRequest(f"a copy after step {envelope.step}; this run has sent steps up to {announced_through}")
    return origin


def stage_state_bound(manifest: Manifest, stage: int) -> int:
    """The most bytes stage ``stage``'s state takes encoded (what a copy or a fetch of it may be)."""
    return state_bytes_bound(manifest.stages[stage].parameters, make_optimizer(manifest.training).buffer_names)


def read_copy_query(envelope: Envelope, run_id: str) -> WeightsQuery:
    """A ``FETCH /weights`` of this run: parameter names and the step of the copy (``copy_step``)."""
    check_run(envelope, run_id, "a copy query")
    query = read_request(WeightsQuery.from_envelope, envelope)
    if query.copy_step is None or query.previous:
        raise BadRequest("FETCH /weights on the coordinator needs meta.copy_step: it serves only its copies")
    return query

