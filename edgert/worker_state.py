"""The worker's state resources: its stage's weights by name, and taking over another's.

``GET``/``PUT /weights`` read and write the stage's parameters and optimizer state;
``FETCH /weights`` serves part of it, or of the state held before the latest assignment,
to a worker that takes those blocks over (re-partitioning); ``POST /migrate`` makes this
worker pull what it now owns from the workers that held it.
"""

from __future__ import annotations

import asyncio
import time

from edgert.assignment import SELF
from edgert.errors import EdgertError
from edgert.protocol import WEIGHTS
from edgert.replica import ReplicaStoreFull, holdings_to_meta
from edgert.transport import BadRequest, Envelope, Request, ServiceUnavailable, TooLarge, TransportError
from edgert.weights import StageState


class StateResources:
    """Mixin of :class:`edgert.worker.Worker`: the handlers of /weights and /migrate."""

    async def _on_weights_get(self, request: Request) -> Envelope:
        session = self._require_session()
        state = StageState(parameters=session.parameters(), optimizer=session.optimizer_state(),
                           step=max(self.health.step, 0), stage=session.entry.index)
        return state.to_envelope(self.assignment.run_id)

    async def _on_weights_put(self, request: Request) -> None:
        session = self._require_session()
        if self.health.state == "running":
            raise ServiceUnavailable("weights cannot be written while the stage is running a window")
        state = StageState.from_envelope(request.envelope)
        try:
            session.load_parameters(state.parameters)
            session.load_optimizer_state(state.optimizer)
        except EdgertError as error:
            raise BadRequest(str(error)) from None

    async def _on_replica_put(self, request: Request) -> None:
        """A peer's snapshot of its stage, kept for recovery."""
        envelope = request.envelope
        self._check_run(envelope)
        try:
            self.copies.put(StageState.from_envelope(envelope), str(envelope.meta.get("origin", request.peer)))
        except ReplicaStoreFull as error:
            raise TooLarge(str(error)) from None
        except EdgertError as error:
            raise BadRequest(str(error)) from None

    async def _on_replica_get(self, request: Request) -> Envelope:
        """Which copies this worker holds: step, stage, origin, parameter names, bytes."""
        run_id = self.assignment.run_id if self.assignment else ""
        return Envelope(kind="control", run_id=run_id, meta={"holdings": holdings_to_meta(self.copies.holdings())})

    async def _on_weights_fetch(self, request: Request) -> Envelope:
        """Some of the state, by name: ``meta.names``; ``meta.previous`` for the stage held before the
        latest assignment (what re-partitioning moves between workers)."""
        self._check_run(request.envelope)  # never another run's state
        meta = request.envelope.meta
        names = meta.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("FETCH /weights needs meta.names, a list of parameter names")
        if isinstance(meta.get("copy_step"), int):
            try:
                state = self.copies.get(meta["copy_step"], names)
            except EdgertError as error:
                raise BadRequest(str(error)) from None
        elif meta.get("previous") and self._previous is not None:
            state = self._previous
        else:  # also "previous" on a worker the re-partition left out: its current stage is what it held
            session = self._require_session()
            state = StageState(parameters=session.parameters(), optimizer=session.optimizer_state(),
                               stage=session.entry.index)
        return _subset(state, names).to_envelope(self.assignment.run_id if self.assignment else "")

    async def _on_migrate(self, request: Request) -> Envelope:
        """Fetch the named state from the workers that held it, straight into this stage."""
        session = self._require_session()
        self._check_run(request.envelope)
        sources = request.envelope.meta.get("sources", [])
        started = time.perf_counter()
        self._activity = "migrating"

        async def fetch(source: dict) -> StageState:
            names = list(source["names"])
            copy_step = source.get("copy_step")
            if source["url"] == SELF:
                return self.copies.get(copy_step, names) if copy_step is not None else _subset(self._previous, names)
            query = Envelope(kind="control", run_id=self.assignment.run_id,
                             meta={"names": names, "previous": bool(source.get("previous", True)),
                                   **({"copy_step": copy_step} if copy_step is not None else {})})
            response = await self.client.request("FETCH", source["url"], WEIGHTS, query, timeout=120.0)
            return StageState.from_envelope(response.envelope(self.config.limits))

        try:
            states = await asyncio.gather(*(fetch(s) for s in sources))
        except (TransportError, KeyError, TypeError, EdgertError) as error:
            self._activity = ""
            raise BadRequest(f"migration failed: {error}") from None
        moved = 0
        for state in states:
            try:
                session.load_parameters(state.parameters)
                session.load_optimizer_state(state.optimizer)
            except EdgertError as error:
                raise BadRequest(f"migration failed: {error}") from None
            moved += state.bytes
        self._activity = ""
        return Envelope(kind="control", run_id=self.assignment.run_id,
                        meta={"bytes": moved, "ms": (time.perf_counter() - started) * 1000})

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
