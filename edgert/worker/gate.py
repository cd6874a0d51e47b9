"""The stage's step gate: holding a running pipeline at a step boundary chosen after the fact.

Re-planning must stop every stage after the same step. Draining every step already sent
would take as long as the coordinator's lookahead; instead the coordinator asks each stage
to *hold*: begin no action for a step later than it has begun already, and no backward or
optimizer step (a *commit*: it changes what is learned) for a step later than it has
committed already, and say both. The coordinator then truncates the run after the latest
step any stage has committed, and the gate opens again. Steps that only ran forwards
somewhere (a fast first stage runs ahead under ``async``) are dropped and sent again: a
forward changes nothing that the new placement keeps.
"""

from __future__ import annotations

import threading


class StepGate:
    """Admits the compute thread's actions step by step, except past a hold."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._begun = -1
        self._committed = -1
        self._held_after: int | None = None
        self._commits_held_after: int | None = None

    @property
    def begun(self) -> int:
        """The latest step an action has begun for (-1 before any)."""
        return self._begun

    @property
    def committed(self) -> int:
        """The latest step a backward or optimizer step has begun for (-1 before any)."""
        return self._committed

    def enter(self, step: int, commits: bool = False) -> None:
        """Called before each action for ``step`` (``commits``: a backward or an optimizer step);
        waits while the gate is held before it."""
        with self._condition:
            while (self._held_after is not None and step > self._held_after) or \
                    (commits and self._commits_held_after is not None and step > self._commits_held_after):
                self._condition.wait()
            self._begun = max(self._begun, step)
            if commits:
                self._committed = max(self._committed, step)

    def hold(self) -> tuple[int, int]:
        """Begin nothing later than the latest begun, commit nothing later than the latest committed,
        until :meth:`open`; returns (begun, committed)."""
        with self._condition:
            self._held_after, self._commits_held_after = self._begun, self._committed
            return self._begun, self._committed

    def open(self) -> None:
        """Let actions for any step begin again (after a truncation, or when the run stops)."""
        with self._condition:
            self._held_after = self._commits_held_after = None
            self._condition.notify_all()
