"""The worker's state resources: its stage's weights by name, and taking over another's.

``GET``/``PUT /weights`` read and write the stage's parameters and optimizer state;
``FETCH /weights`` serves part of it, or of the state held before the latest assignment,
to a worker that takes those blocks over (re-partitioning); ``POST /migrate`` makes this
worker pull what it now owns from the workers that held it.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from edgert.errors import EdgertError, ReplicaStoreFull
from edgert.protocol import SELF, WEIGHTS, MigrateRequest, MigrationSource, WeightsQuery, read_request
from edgert.replica import held_stages, holdings_to_meta
from edgert.stage import StageSession
from edgert.transport import BadRequest, Envelope, Request, TooLarge, TransportError
from edgert.transport.errors import Forbidden
from edgert.weights import KIND, StageState
from edgert.worker.errors import Busy


class StateResources:
    """Mixin of :class:`edgert.worker.worker.Worker`: the handlers of /weights, /replica and /migrate."""

    async def _on_weights_get(self, request: Request) -> Envelope:
        session = self._require_session()
        state = StageState(parameters=session.parameters(), optimizer=session.optimizer_state(),
                           step=max(self.health.step, 0), stage=session.entry.index)
        return state.to_envelope(self.assignment.run_id)

    async def _on_weights_put(self, request: Request) -> None:
        session = self._require_session()
        state = _stage_state(request.envelope)
        if self.health.state == "running":
            raise Busy("weights cannot be written while the stage is running a segment")
        _check_state(session, state)
        session.load_parameters(state.parameters)
        session.load_optimizer_state(state.optimizer)

    async def _on_replica_put(self, request: Request) -> None:
        """A peer's snapshot of a stage this worker keeps copies of, taken after a step of the run."""
        self._check_run(request.envelope)
        origin = _origin(request)
        if len(request.payload) > self.copies.room():
            raise TooLarge(f"a copy of {len(request.payload)} bytes does not fit: copies from peers may take "
                           f"{self.copies.max_peer_bytes} bytes here, {self.copies.room()} are left")
        envelope, assignment = request.envelope, self.assignment
        held = held_stages(assignment.entry.index, assignment.stages, len(assignment.replica_targets))
        if envelope.stage not in held:
            raise Forbidden(f"stage {assignment.entry.index} keeps copies of stage(s) {sorted(held)} of "
                            f"{assignment.stages}, not of stage {envelope.stage}")
        if not any(s.first_step <= envelope.step <= s.last_step for s in tuple(self._segments)):
            raise BadRequest(f"a copy after step {envelope.step}, which no run command of this worker covers")
        try:
            self.copies.put(_stage_state(envelope), origin)
        except ReplicaStoreFull as error:
            raise TooLarge(str(error)) from None

    async def _on_replica_get(self, request: Request) -> Envelope:
        """Which copies this worker holds: step, stage, origin, parameter names, bytes."""
        run_id = self.assignment.run_id if self.assignment else ""
        return Envelope(kind="control", run_id=run_id, meta={"holdings": holdings_to_meta(self.copies.holdings())})

    async def _on_weights_fetch(self, request: Request) -> Envelope:
        """Some of the state, by name (:class:`WeightsQuery`): from a copy, from the stage held before the
        latest assignment (what re-partitioning moves between workers), or from the current stage."""
        self._check_run(request.envelope)  # never another run's state
        query = read_request(WeightsQuery.from_envelope, request.envelope)
        if query.copy_step is not None:
            try:
                state = self.copies.get(query.copy_step, list(query.names))
            except EdgertError as error:
                raise BadRequest(str(error)) from None
        elif query.previous and self._previous is not None:
            state = self._previous
        else:  # also "previous" on a worker the re-partition left out: its current stage is what it held
            session = self._require_session()
            state = StageState(parameters=session.parameters(), optimizer=session.optimizer_state(),
                               stage=session.entry.index)
        return _subset(state, list(query.names)).to_envelope(self.assignment.run_id if self.assignment else "")

    async def _on_migrate(self, request: Request) -> Envelope:
        """Fetch the named state from the workers that held it, check all of it, then load it into this stage."""
        session = self._require_session()
        self._check_run(request.envelope)
        migration = read_request(MigrateRequest.from_envelope, request.envelope)
        started = time.perf_counter()
        self._activity = "migrating"
        try:
            states = await asyncio.gather(*(self._fetch_source(source) for source in migration.sources))
            for state in states:
                _check_state(session, state)
        except (TransportError, EdgertError) as error:
            raise BadRequest(f"migration failed: {error}") from None
        finally:
            self._activity = ""
        for state in states:
            session.load_parameters(state.parameters)
            session.load_optimizer_state(state.optimizer)
        return Envelope(kind="control", run_id=self.assignment.run_id,
                        meta={"bytes": sum(state.bytes for state in states),
                              "ms": (time.perf_counter() - started) * 1000})

    async def _fetch_source(self, source: MigrationSource) -> StageState:
        names = list(source.names)
        if source.url == SELF:
            return self.copies.get(source.copy_step, names) if source.copy_step is not None \
                else _subset(self._previous, names)
        response = await self.client.request("FETCH", source.url, WEIGHTS,
                                             source.query().to_envelope(self.assignment.run_id), timeout=120.0)
        return _subset(_stage_state(response.envelope(self.config.limits)), names)


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
