"""What a worker lets into its stage's inbox: tensors from the named peer, for a step it expects, as specified.

``/act`` and ``/grad`` (and the coordinator's ``/batch``) are checked here before the inbox
or the running stage sees them (docs/SECURITY.md, "Requests a worker refuses"):

- *who*: activations come only from the previous stage, gradients only from the next one;
  over TLS the sender's credential name must be the one the assignment names (on
  plaintext, ``--insecure``, nobody is authenticated and this check does not apply);
- *when*: the step lies in a segment the coordinator sent (``POST /run``) and the micro-batch
  is one of that step's;
- *what*: tensor names, dtypes and dimensions are the manifest's, and the batch dimension
  is that micro-batch's size (in a group: this member's rows of it; on a link to or from a group,
  the row piece ``meta.row`` starts, one this member takes).

``/groupgrad`` takes another member's gradients for a step (group_exchange.py): from a member of this
stage's group, as many as the stage has.

A message that passes, but for a step already done (a retried delivery whose first answer
was lost) or after a truncation, is dropped with 2.04: nothing is kept.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from edgert.manifest import BoundaryTensor
from edgert.protocol import ACT, BATCH, DATA_KINDS, GROUP_GRAD, GROUP_GRAD_KIND, LABELS, Peers, Segment
from edgert.schedule import MicroBatch
from edgert.transport import BadRequest, Envelope, Request, ServiceUnavailable, TensorServer
from edgert.transport.errors import Forbidden
from edgert.transport.tls import COORDINATOR_ROLE, PeerIdentity
from edgert.worker.current_stage import CurrentStage
from edgert.worker.errors import InboxFull
from edgert.worker.group_exchange import expected_tensors
from edgert.worker.inbox import Inbox


class StageInputs:
    """The stage's inbox and the resources that fill it (/batch, /act, /grad), each request checked first."""

    def __init__(self, current: CurrentStage):
        self._current = current
        self.inbox = Inbox()  # what the stage's executor waits on

    def register(self, server: TensorServer) -> None:
        """Serve /batch (the coordinator's only, over TLS) and the neighbours' /act and /grad."""
        server.add_resource(BATCH, post=self._on_batch, rt="edgert.batch", kinds=("batch",),
                            roles=(COORDINATOR_ROLE,))
        for path, kind in DATA_KINDS.items():
            server.add_resource(path, post=self._data_handler(path), rt=f"edgert.{kind}", kinds=(kind,))
        server.add_resource(GROUP_GRAD, post=self._on_group_gradients, rt="edgert.group_gradients",
                            kinds=(GROUP_GRAD_KIND,))

    def _on_batch(self, request: Request) -> None:
        """A whole step's inputs (first stage) and/or labels (last stage), split into micro-batches here."""
        envelope, current = request.envelope, self._current
        current.check_run(envelope)
        entry = current.session.entry
        expected = (list(entry.inputs) if entry.index == 0 else []) + list(entry.labels)
        if not expected:
            raise BadRequest(f"stage {entry.index} is neither the first nor the last: it takes no /{BATCH}")
        microbatches = self._announced(envelope.step, BATCH)
        if microbatches is None:
            return  # a late duplicate: nothing kept
        routing = current.assignment.routing
        rows = [routing.own(m.size)[1] - routing.own(m.size)[0] for m in microbatches]  # a group member's share
        check_tensors(envelope, expected, BATCH, batch=sum(rows))
        if is_late(envelope.step, current.health.step, self.inbox.last_step):
            return
        inputs = {t.name for t in entry.inputs} if entry.index == 0 else set()
        start = 0
        try:
            for micro, count in zip(microbatches, rows):
                part = slice(start, start + count)
                start += count
                values = {name: value[part] for name, value in envelope.tensors.items()}
                if inputs:
                    self.inbox.put((ACT, micro.step, micro.index), {n: v for n, v in values.items() if n in inputs})
                if entry.is_last:
                    self.inbox.put((LABELS, micro.step, micro.index),
                                   {n: v for n, v in values.items() if n not in inputs})
        except InboxFull as error:
            raise ServiceUnavailable(str(error)) from None

    def _data_handler(self, path: str):
        def handle(request: Request) -> None:
            """Tensors from a neighbour on ``path`` (/act or /grad), checked before the inbox sees them."""
            envelope, current = request.envelope, self._current
            current.check_run(envelope)
            entry, assignment = current.session.entry, current.assignment
            if envelope.stage != entry.index:
                raise BadRequest(f"message for stage {envelope.stage} reached stage {entry.index}")
            check_sender(path, entry.index, assignment.peers, request.identity)
            microbatches = self._announced(envelope.step, path)
            if microbatches is None:
                return  # a late duplicate: nothing kept
            micro = nth_microbatch(microbatches, envelope.step, envelope.microbatch, path)
            link = "previous" if path == ACT else "next"
            key, rows = (path, envelope.step, envelope.microbatch), micro.size
            if assignment.routing.split(link):
                row, rows = piece_rows(envelope, assignment.routing.pieces(link, micro.size), path)
                key = (*key, row)
            check_tensors(envelope, self._expected(path), path, batch=rows)
            if is_late(envelope.step, current.health.step, self.inbox.last_step):
                return
            try:
                self.inbox.put(key, dict(envelope.tensors))
            except InboxFull as error:
                raise ServiceUnavailable(str(error)) from None
        return handle

    def _on_group_gradients(self, request: Request) -> None:
        """Another member's gradients (and running statistics) of a step, for this stage's group."""
        envelope, current = request.envelope, self._current
        current.check_run(envelope)
        assignment = current.assignment
        group, member = assignment.group, envelope.meta.get("member")
        if group is None or group.size < 2:
            raise Forbidden(f"stage {assignment.entry.index} is held by one worker: it takes no /{GROUP_GRAD}")
        if envelope.stage != assignment.entry.index:
            raise BadRequest(f"/{GROUP_GRAD} for stage {envelope.stage} reached stage {assignment.entry.index}")
        if type(member) is not int or not 0 <= member < group.size or member == assignment.member:
            raise BadRequest(f"/{GROUP_GRAD}: meta.member {member!r} is not another member of a group of {group.size}")
        if request.identity is not None and group.names and request.identity.name != group.names[member]:
            raise Forbidden(f"/{GROUP_GRAD} of member {member} comes only from {group.names[member]!r}")
        if self._announced(envelope.step, GROUP_GRAD) is None:
            return
        expected = expected_tensors(current.session)
        shapes = {name: tuple(value.shape) for name, value in envelope.tensors.items()}
        if shapes != expected or any(value.dtype != np.float32 for value in envelope.tensors.values()):
            raise BadRequest(f"/{GROUP_GRAD} expects float32 tensors {expected}, got {shapes}")
        if is_late(envelope.step, current.health.step, self.inbox.last_step):
            return
        try:
            self.inbox.put((GROUP_GRAD, envelope.step, member), dict(envelope.tensors))
        except InboxFull as error:
            raise ServiceUnavailable(str(error)) from None

    def _announced(self, step: int, path: str) -> list[MicroBatch] | None:
        return announced_microbatches(self._current.announced(), step, self._current.health.step, path,
                                      stopped=self.inbox.aborted)

    def _expected(self, path: str) -> list[BoundaryTensor]:
        entry = self._current.session.entry
        if path == ACT:
            return list(entry.inputs)
        return [t for t in entry.outputs if t.name in entry.output_gradients]


def piece_rows(envelope: Envelope, pieces: list[tuple[str, int, int]], path: str) -> tuple[int, int]:
    """The first row (``meta.row``) and the rows of a row piece on a link to or from a group; 4.00 unless it is
    one of the ``pieces`` this member takes."""
    row = envelope.meta.get("row")
    sizes = {start: end - start for _, start, end in pieces}
    if type(row) is not int or row not in sizes:
        raise BadRequest(f"/{path}: meta.row {row!r} is not the first row of a piece this member takes "
                         f"(rows {sorted(sizes)})")
    return row, sizes[row]


def check_sender(path: str, stage: int, peers: Peers, identity: PeerIdentity | None) -> None:
    """Refuse (4.03) ``/act`` or ``/grad`` from anyone but the neighbour (a member of the neighbouring group)
    the assignment names."""
    if path == ACT:
        url, name, role, group = peers.previous, peers.previous_name, "previous", peers.previous_group
    else:
        url, name, role, group = peers.next, peers.next_name, "next", peers.next_group
    if url is None:
        why = "its inputs come in the coordinator's /batch" if path == ACT else "it is the last stage"
        raise Forbidden(f"stage {stage} takes no /{path} from a peer: {why}")
    if identity is not None and group is not None and group.names:
        if identity.name not in group.names:
            raise Forbidden(f"stage {stage} takes /{path} only from its {role} stage's workers "
                            f"{list(group.names)}, not {identity}")
        return
    if identity is not None and identity.name != name:
        raise Forbidden(f"stage {stage} takes /{path} only from its {role} stage's worker {name!r}, not {identity}")


def announced_microbatches(segments: Iterable[Segment], step: int, done_through: int, path: str,
                           stopped: str | None = None) -> list[MicroBatch] | None:
    """The micro-batches of ``step`` as a run command announced them (None: a step done so long ago that its
    segment is forgotten; a late duplicate, to drop); 5.03 for a step of a run this worker stopped
    (``stopped``: why), 4.00 for a step no run command announced."""
    segment = next((s for s in segments if s.first_step <= step <= s.last_step), None)
    if segment is not None:
        return segment.microbatches(step)
    if step <= done_through:
        return None
    if stopped is not None:
        raise ServiceUnavailable(f"/{path} for step {step}: this worker stopped its run ({stopped})")
    raise BadRequest(f"/{path} for step {step}, which no run command covers")


def nth_microbatch(microbatches: list[MicroBatch], step: int, index: int, path: str) -> MicroBatch:
    """Micro-batch ``index`` of the announced ``microbatches`` of ``step``; 4.00 past their count."""
    if index >= len(microbatches):
        raise BadRequest(f"/{path} for micro-batch {index} of step {step}, which has {len(microbatches)}")
    return microbatches[index]


def is_late(step: int, done_through: int, truncated_after: int | None) -> bool:
    """A message for a step already done (a retried delivery) or truncated away: dropped, nothing kept."""
    return step <= done_through or (truncated_after is not None and step > truncated_after)


def check_tensors(envelope: Envelope, expected: list[BoundaryTensor], path: str, batch: int | None = None) -> None:
    """Names, dtypes and non-batch dimensions must be exactly the manifest's, with one batch size
    (``batch`` when given)."""
    names = sorted(envelope.tensors)
    wanted = sorted(t.name for t in expected)
    if names != wanted:
        raise BadRequest(f"/{path} expects tensors {wanted}, got {names}")
    batches: set[int] = set()
    for spec in expected:
        array = envelope.tensors[spec.name]
        problem = spec.mismatch(array)
        if problem is not None:
            raise BadRequest(f"/{path}: tensor {spec.name!r} {problem}")
        batches.update(spec.batch_sizes(array))
    if len(batches) > 1 or 0 in batches:
        raise BadRequest(f"/{path}: tensors have batch sizes {sorted(batches)}; expected one, at least 1")
    if batch is not None and batches and batches != {batch}:
        what = "the batch" if path == BATCH else f"micro-batch {envelope.microbatch} of step {envelope.step}"
        raise BadRequest(f"/{path}: batch size {batches.pop()}; {what} has {batch} samples")
