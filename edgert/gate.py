"""The stage's step gate: holding a running pipeline at a step boundary chosen after the fact.

Re-planning must stop every stage after the same step. Draining every step already sent
would take as long as the coordinator's lookahead; instead the coordinator asks each stage
to *hold* (begin nothing for a step later than what it has begun already, and say which
step that is), then truncates the run after the latest step any stage has begun, and the
gate opens again. Only the steps some stage has begun are finished.
"""

from __future__ import annotations

import threading


class StepGate:
    """Admits the compute thread's actions step by step, except past a hold."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._begun = -1
        self._held_after: int | None = None

    @property
    def begun(self) -> int:
        """The latest step an action has begun for (-1 before any)."""
        return self._begun

    def enter(self, step: int) -> None:
        """Called before each action for ``step``: waits while the gate is held before it."""
        with self._condition:
            while self._held_after is not None and step > self._held_after:
                self._condition.wait()
            self._begun = max(self._begun, step)

    def hold(self) -> int:
        """Begin no later step than the latest begun (returned) until :meth:`open`."""
        with self._condition:
            self._held_after = self._begun
            return self._begun

    def open(self) -> None:
        """Let actions for any step begin again (after a truncation, or when the run stops)."""
        with self._condition:
            self._held_after = None
            self._condition.notify_all()
