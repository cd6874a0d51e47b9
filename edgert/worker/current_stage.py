"""The stage a worker runs now and how far its run has got: the one object its parts share.

Installing a stage (:meth:`CurrentStage.install`) writes the assignment, session, executor and
a fresh health; ``POST /run`` announces segments and ``/stop`` forgets them; the compute thread
moves the health on (step, loaded, failed). The inputs, the stage's weights and the compute
thread read them here rather than from one another.
"""

from __future__ import annotations

import collections

from edgert.protocol import Health, Segment, StageAssignment
from edgert.stage import StageSession
from edgert.transport import BadRequest, Envelope
from edgert.worker.executor import StageExecutor
from edgert.worker.slowdown import SlowdownSchedule

KEPT_SEGMENTS = 8  # run commands remembered to check what arrives for their steps


class CurrentStage:
    """The current assignment, its session and executor, the announced segments and the worker's health."""

    def __init__(self, name: str, slowdown: SlowdownSchedule):
        self._name = name
        self._slowdown = str(slowdown)
        self.assignment: StageAssignment | None = None
        self.session: StageSession | None = None
        self.executor: StageExecutor | None = None
        self._segments: collections.deque[Segment] = collections.deque(maxlen=KEPT_SEGMENTS)
        self.health = Health(name=name, state="idle", slowdown=self._slowdown)
        self.activity = ""  # overrides the executor's while loading, replicating or migrating

    def install(self, assignment: StageAssignment, session: StageSession, executor: StageExecutor) -> None:
        """``assignment``'s stage is the current one now, loaded, no step of it done yet."""
        if self.executor is not None:
            self.executor.close()
        self.assignment, self.session, self.executor = assignment, session, executor
        self.health = Health(name=self._name, state="loaded", run_id=assignment.run_id,
                             stage=assignment.entry.index, slowdown=self._slowdown)

    def announce(self, segment: Segment) -> None:
        """A run command's segment: what arrives for its steps is let in; the stage is running."""
        self._segments.append(segment)
        self.health.state = "running"

    def forget_segments(self) -> None:
        """The run was stopped: no step is expected any more; a running stage is only loaded now."""
        self._segments.clear()
        if self.health.state == "running":
            self.health.state = "loaded"

    @property
    def run_id(self) -> str:
        """The current run's id ("" before any stage)."""
        return self.assignment.run_id if self.assignment else ""

    def health_now(self) -> Health:
        """The health with what the worker is doing at this moment."""
        self.health.activity = self.activity or (self.executor.activity if self.executor else "idle")
        return self.health

    def require_session(self) -> StageSession:
        """The stage's session; 4.00 before any stage was assigned."""
        if self.session is None:
            raise BadRequest("no stage assigned to this worker yet (PUT /stage first)")
        return self.session

    def check_run(self, envelope: Envelope) -> None:
        """Refuse (4.00) a message for another run, or any before a stage was assigned."""
        self.require_session()
        if envelope.run_id != self.assignment.run_id:
            raise BadRequest(f"message for run {envelope.run_id!r}; this worker is in run {self.assignment.run_id!r}")

    def announced(self) -> tuple[Segment, ...]:
        """The segments the coordinator sent and this worker still remembers (a copy: safe from any thread)."""
        return tuple(self._segments)
