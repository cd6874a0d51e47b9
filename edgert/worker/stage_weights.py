"""The stage's weights on a worker: by name, copied to peers, copies of theirs, and taken over from others.

``GET``/``PUT /weights`` read and write the stage's parameters and optimizer state;
``FETCH /weights`` serves part of it, or of the state held before the latest assignment,
to a worker that takes those blocks over (re-partitioning); ``POST /migrate`` makes this
worker pull what it now owns from the workers that held it. After every ``replicate_every``
steps the compute thread has a snapshot sent to the workers that keep copies of this stage;
``PUT /replica`` receives theirs, ``GET /replica`` lists what is held. A state larger than a piece moves
in pieces (docs/PROTOCOL.md §12), never more of it than this stage's state (``PUT``/``FETCH /weights``)
or the room left for peers' copies (``PUT /replica``, room that scales with the stage: :func:`copy_budget`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from edgert.errors import EdgertError, ReplicaStoreFull
from edgert.optimizer import make_optimizer
from edgert.protocol import (
    MIGRATE,
    REPLICA,
    SELF,
    WEIGHTS,
    MigrateRequest,
    MigrationSource,
    StageAssignment,
    StepReport,
    WeightsQuery,
    read_request,
)
from edgert.replica import (
    DEFAULT_MAX_PEER_BYTES,
    KEEP_VERSIONS,
    SELF_ORIGIN,
    CopyStore,
    held_stages,
    holdings_to_meta,
)
from edgert.stage import StageSession
from edgert.transport import (
    BadRequest,
    Envelope,
    Request,
    TensorClient,
    TensorServer,
    TooLarge,
    TransportError,
)
from edgert.transport.errors import Forbidden
from edgert.transport.limits import Limits
from edgert.transport.pieces import MemorySink, Piece, Sink
from edgert.transport.tls import COORDINATOR_ROLE
from edgert.weights import KIND, StageState, state_bytes_bound, state_pieces
from edgert.worker.current_stage import CurrentStage
from edgert.worker.errors import Busy
from edgert.worker.outbox import Outbox
from edgert.worker.slowdown import SlowdownEmulator, SlowdownSchedule


class StageWeights:
    """The stage's state as other devices see it: read and written by name, copied to the workers that
    keep copies of it, copies of theirs kept here, and taken over from the workers that held it."""

    def __init__(self, current: CurrentStage, client: TensorClient, outbox: Outbox, slowdown: SlowdownSchedule,
                 limits: Limits, own_url: Callable[[], str]):
        self._current = current
        self._client = client
        self._outbox = outbox
        self._limits = limits
        self._own_url = own_url  # where peers reach this worker (known once it serves)
        self._emulator = SlowdownEmulator(slowdown)  # for state copies; each stage's executor has its own
        self._copies = CopyStore()
        self._previous: StageState | None = None  # the state held before the latest assignment

    def register(self, server: TensorServer) -> None:
        """Serve /weights, /replica and /migrate; over TLS only the coordinator reads or writes state."""
        boss = (COORDINATOR_ROLE,)
        server.add_resource(WEIGHTS, get=self._on_weights_get, put=self._on_weights_put,
                            fetch=self._on_weights_fetch, rt="edgert.weights", kinds=("weights", "control"),
                            roles={"GET": boss, "PUT": boss}, pieces=self._admit_state, piece_answers=True)
        server.add_resource(MIGRATE, post=self._on_migrate, rt="edgert.migrate", kinds=("control",), roles=boss)
        server.add_resource(REPLICA, put=self._on_replica_put, get=self._on_replica_get,
                            rt="edgert.replica", kinds=("weights",), roles={"GET": boss}, pieces=self._admit_copy)

    def new_assignment(self, assignment: StageAssignment) -> None:
        """Before ``assignment`` replaces the current stage: keep the current state for the workers that take
        over its blocks (re-partitioning, same run); forget every copy when the run changes."""
        current = self._current
        if current.session is not None and current.assignment.run_id == assignment.run_id:
            self._previous = _state_of(current.session)
        else:
            self._previous = None
        if current.assignment is None or current.assignment.run_id != assignment.run_id:
            self._copies.clear()
        self._copies.max_peer_bytes = copy_budget(assignment)

    def training_resumed(self) -> None:
        """A segment of the current stage starts: the state held before its assignment has been taken over (a
        re-partition migrates before training resumes). Forgotten, so that a later re-partition that leaves
        this worker out serves what it holds now, not the stage it held two placements ago."""
        self._previous = None

    # -- on the compute thread, after each step --------------------------------------------

    def replicate(self, report: StepReport) -> None:
        """Every ``replicate_every`` steps: keep a snapshot, send it to the next workers (and the coordinator,
        every ``central_every`` steps and after the segment's ``checkpoint_steps``); in a group, only its first
        member does."""
        if not self._current.assignment.holder:
            return  # a group's holder of record keeps the copies for all its members
        to_peers, to_coordinator = self._copies_due(report.step)
        if not (to_peers or to_coordinator):
            return
        started, cpu = time.perf_counter(), time.thread_time()
        self._current.activity = f"replicating {report.step}"
        state = _state_of(self._current.session, report.step)
        # an emulated slower device also copies its state more slowly
        self._emulator.emulate(report.step, "replicate", time.perf_counter() - started, time.thread_time() - cpu)
        self._copies.put(state, SELF_ORIGIN)
        sent = self._send_copy(state, to_peers, to_coordinator)
        report.replication_ms += (time.perf_counter() - started) * 1000
        report.replicated_bytes += state.bytes * sent
        self._current.activity = ""

    def _copies_due(self, step: int) -> tuple[bool, bool]:
        """Whether a copy after ``step`` goes to the peers, and whether to the coordinator."""
        assignment = self._current.assignment
        every, central = assignment.settings.replicate_every, assignment.settings.central_every
        to_peers = bool(every and (step + 1) % every == 0)
        to_coordinator = bool((central and (step + 1) % central == 0) or any(
            step in segment.checkpoint_steps for segment in self._current.announced()))
        return to_peers, to_coordinator

    def _send_copy(self, state: StageState, to_peers: bool, to_coordinator: bool) -> int:
        """Send ``state`` (not waited for, need not arrive) to the peers and/or the coordinator; how many."""
        assignment = self._current.assignment
        envelope = state.to_envelope(assignment.run_id)
        envelope = Envelope(kind=envelope.kind, run_id=envelope.run_id, step=envelope.step, stage=envelope.stage,
                            tensors=envelope.tensors, meta={"origin": self._own_url()})
        targets = list(assignment.replica_targets) if to_peers else []
        if to_coordinator:
            targets.append(assignment.peers.coordinator)
        for target in targets:
            self._outbox.submit(target, REPLICA, envelope, None, method="PUT", must_arrive=False,
                                pieces=state_pieces(0))
        return len(targets)

    # -- resources -------------------------------------------------------------------------

    async def _on_weights_get(self, request: Request) -> Envelope:
        session = self._current.require_session()
        return _state_of(session, max(self._current.health.step, 0)).to_envelope(self._current.run_id)

    async def _on_weights_put(self, request: Request) -> None:
        session = self._current.require_session()
        state = _stage_state(request.envelope)
        if self._current.health.state == "running":
            raise Busy("weights cannot be written while the stage is running a segment")
        _check_state(session, state)
        session.load_parameters(state.parameters)
        session.load_optimizer_state(state.optimizer)

    def _admit_state(self, request: Request, piece: Piece) -> Sink:
        """``PUT /weights`` in pieces: at most this stage's state."""
        session = self._current.require_session()
        self._current.check_run(piece.header)
        bound = state_bytes_bound(session.entry.parameters, session.optimizer.buffer_names)
        if piece.size > bound:
            raise TooLarge(f"a state of {piece.size} bytes for stage {session.entry.index}, whose whole state takes "
                           f"at most {bound}", size1=bound)
        return MemorySink(piece.size)

    def _admit_copy(self, request: Request, piece: Piece) -> Sink:
        """``PUT /replica`` in pieces: a copy this worker keeps, within the room left for copies (reserved until
        the copy is kept or dropped)."""
        self._check_copy(piece.header, piece.size)
        return MemorySink(piece.size, on_close=self._copies.reserve(piece.size))

    def _check_copy(self, envelope: Envelope, size: int | None) -> None:
        """A copy of a stage this worker keeps, of this run, after an announced step; ``size``: its bytes, to
        check against the room left (None: a body that arrived in pieces, its room reserved already)."""
        current, copies = self._current, self._copies
        current.check_run(envelope)
        if size is not None and size > copies.room():
            raise TooLarge(f"a copy of {size} bytes does not fit: copies from peers may take "
                           f"{copies.max_peer_bytes} bytes here, {copies.room()} are left")
        assignment = current.assignment
        held = held_stages(assignment.entry.index, assignment.stages, len(assignment.replica_targets))
        if envelope.stage not in held:
            raise Forbidden(f"stage {assignment.entry.index} keeps copies of stage(s) {sorted(held)} of "
                            f"{assignment.stages}, not of stage {envelope.stage}")
        if not any(s.first_step <= envelope.step <= s.last_step for s in current.announced()):
            raise BadRequest(f"a copy after step {envelope.step}, which no run command of this worker covers")

    async def _on_replica_put(self, request: Request) -> None:
        """A peer's snapshot of a stage this worker keeps copies of, taken after a step of the run."""
        self._check_copy(request.envelope, None if request.sink is not None else len(request.payload))
        try:
            self._copies.put(_stage_state(request.envelope), _origin(request))
        except ReplicaStoreFull as error:
            raise TooLarge(str(error)) from None

    async def _on_replica_get(self, request: Request) -> Envelope:
        """Which copies this worker holds: step, stage, origin, parameter names, bytes."""
        return Envelope(kind="control", run_id=self._current.run_id,
                        meta={"holdings": holdings_to_meta(self._copies.holdings())})

    async def _on_weights_fetch(self, request: Request) -> Envelope:
        """Some of the state, by name (:class:`WeightsQuery`): from a copy, from the stage held before the
        latest assignment (what re-partitioning moves between workers), or from the current stage."""
        self._current.check_run(request.envelope)  # never another run's state
        query = read_request(WeightsQuery.from_envelope, request.envelope)
        if query.copy_step is not None:
            try:
                state = self._copies.get(query.copy_step, list(query.names))
            except EdgertError as error:
                raise BadRequest(str(error)) from None
        elif query.previous and self._previous is not None:
            state = self._previous
        else:  # also "previous" on a worker the re-partition left out: its current stage is what it held
            state = _state_of(self._current.require_session())
        return _subset(state, list(query.names)).to_envelope(self._current.run_id)

    async def _on_migrate(self, request: Request) -> Envelope:
        """Fetch the named state from the workers that held it, check all of it, then load it into this stage."""
        current = self._current
        session = current.require_session()
        current.check_run(request.envelope)
        migration = read_request(MigrateRequest.from_envelope, request.envelope)
        started = time.perf_counter()
        current.activity = "migrating"
        try:
            states = await asyncio.gather(*(self._fetch_source(source) for source in migration.sources))
            for state in states:
                _check_state(session, state)
        except (TransportError, EdgertError) as error:
            raise BadRequest(f"migration failed: {error}") from None
        finally:
            current.activity = ""
        for state in states:
            session.load_parameters(state.parameters)
            session.load_optimizer_state(state.optimizer)
        return Envelope(kind="control", run_id=current.run_id,
                        meta={"bytes": sum(state.bytes for state in states),
                              "ms": (time.perf_counter() - started) * 1000})

    async def _fetch_source(self, source: MigrationSource) -> StageState:
        names = list(source.names)
        if source.url == SELF:
            return self._copies.get(source.copy_step, names) if source.copy_step is not None \
                else _subset(self._previous, names)
        session = self._current.require_session()
        wanted = [p for p in session.entry.parameters if p.name in set(names)]
        response = await self._client.request("FETCH", source.url, WEIGHTS,
                                              source.query().to_envelope(self._current.run_id), timeout=120.0,
                                              pieces=state_pieces(state_bytes_bound(
                                                  wanted, session.optimizer.buffer_names)))
        return _subset(_stage_state(response.envelope(self._limits)), names)


def copy_budget(assignment: StageAssignment) -> int:
    """Bytes of peers' copies a worker of ``assignment`` takes: for each stage it keeps copies of, the versions
    kept and one arriving, each up to twice this stage's state (stages of one plan differ in size); at least
    :data:`~edgert.replica.DEFAULT_MAX_PEER_BYTES`."""
    held = held_stages(assignment.entry.index, assignment.stages, len(assignment.replica_targets))
    own = state_bytes_bound(assignment.entry.parameters, make_optimizer(assignment.settings.training).buffer_names)
    return max(DEFAULT_MAX_PEER_BYTES, len(held) * (KEEP_VERSIONS + 1) * 2 * own)


def _state_of(session: StageSession, step: int = 0) -> StageState:
    """The stage's parameters and optimizer state as they are now (after ``step``)."""
    return StageState(parameters=session.parameters(), optimizer=session.optimizer_state(), step=step,
                      stage=session.entry.index)


def _stage_state(envelope: Envelope) -> StageState:
    if envelope.kind != KIND:
        raise BadRequest(f"expected a {KIND!r} envelope (the stage state), got {envelope.kind!r}")
    return StageState.from_envelope(envelope)


def _origin(request: Request) -> str:
    """Who sent a copy: the name its credential proves (TLS, OSCORE); on plaintext, its address."""
    return request.identity.name if request.identity is not None else request.peer


def _check_state(session: StageSession, state: StageState) -> None:
    """Refuse (4.00), before anything is loaded, state that does not fit the stage: unknown names, other
    shapes or dtypes, optimizer buffers other than the optimizer's, or disagreeing step counts."""
    specs = {p.name: p for p in session.entry.parameters}
    for name, value in state.parameters.items():
        spec = specs.get(name)
        if spec is None:
            raise BadRequest(f"stage {session.entry.index} has no parameter {name!r}")
        if value.dtype != np.dtype(spec.dtype) or tuple(value.shape) != tuple(spec.shape):
            raise BadRequest(f"parameter {name!r}: {value.dtype}{list(value.shape)} does not match "
                             f"{spec.dtype}{list(spec.shape)}")
    buffers = set(session.optimizer.buffer_names) | {"step"}
    steps = set()
    for name, entry in state.optimizer.items():
        spec = specs.get(name)
        if spec is None or not spec.trainable:
            raise BadRequest(f"stage {session.entry.index} has no trainable parameter {name!r}")
        if set(entry) != buffers:
            raise BadRequest(f"optimizer state of {name!r} holds {sorted(entry)}; expected {sorted(buffers)}")
        for buffer in buffers - {"step"}:
            value = np.asarray(entry[buffer])
            if value.dtype != np.float32 or tuple(value.shape) != tuple(spec.shape):
                raise BadRequest(f"optimizer state {name}#{buffer}: {value.dtype}{list(value.shape)}, "
                                 f"expected float32{list(spec.shape)}")
        step = np.asarray(entry["step"])
        if step.size != 1 or step.dtype.kind not in "iuf" or not float(step.flat[0]).is_integer() \
                or step.flat[0] < 0:
            raise BadRequest(f"optimizer state {name}#step must be one whole number >= 0")
        steps.add(int(step.flat[0]))
    if len(steps) > 1:
        raise BadRequest(f"optimizer states disagree on the step count: {sorted(steps)}")


def _subset(state: StageState | None, names: list[str]) -> StageState:
    """The named part of a stage state; every name must be there."""
    if state is None:
        raise BadRequest("this worker holds no previous stage state")
    missing = [n for n in names if n not in state.parameters]
    if missing:
        raise BadRequest(f"no state for {', '.join(missing[:5])} here")
    return StageState(parameters={n: state.parameters[n] for n in names},
                      optimizer={n: state.optimizer[n] for n in names if n in state.optimizer},
                      step=state.step, stage=state.stage)
