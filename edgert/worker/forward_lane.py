"""A stage's forward lane: the forward of one micro-batch beside the backward of another.

With ``side_by_side`` (docs/RUNTIME.md, "Forward and backward side by side") the executor hands
each forward to this lane's thread, in schedule order, and goes on to the next backward: the two
run at once, each in its own ORT session with its own thread count (``InferenceSession.run``
releases the GIL). The order that matters is kept: a micro-batch's backward waits for its forward,
and the optimizer step waits until the lane is idle (the weights change under no forward). The
lane's first failure ends the window: every later forward is skipped, and the executor's thread
raises it the next time it waits for the lane or for a tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from edgert.worker.errors import InboxSkipped


class ForwardLane:
    """One thread running forwards in the order they were handed over."""

    def __init__(self, name: str, on_failure: Callable[[Exception], None]):
        self._name = name
        self._on_failure = on_failure  # wakes the executor's thread if it waits for a tensor
        self._jobs: list[tuple[Hashable, Callable[[], None]]] = []
        self._finished: set[Hashable] = set()  # keys whose forward ran (or was skipped) and not yet waited for
        self._busy = False
        self._closed = False
        self.failure: Exception | None = None
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, key: Hashable, forward: Callable[[], None]) -> None:
        """Run ``forward`` (``key``'s) after the forwards handed over before it."""
        with self._condition:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"edgert-forward-{self._name}", daemon=True)
                self._thread.start()
            self._jobs.append((key, forward))
            self._condition.notify_all()

    def wait_for(self, key: Hashable, before_wait: Callable[[], None] | None) -> None:
        """Wait until ``key``'s forward has run; raise the lane's failure if it failed."""
        self._wait(lambda: key in self._finished, before_wait)
        with self._condition:
            self._finished.discard(key)

    def wait_idle(self, before_wait: Callable[[], None] | None) -> None:
        """Wait until every forward handed over has run; raise the lane's failure if one failed."""
        self._wait(lambda: not self._jobs and not self._busy, before_wait)
        with self._condition:
            self._finished.clear()

    def _wait(self, done: Callable[[], bool], before_wait: Callable[[], None] | None) -> None:
        with self._condition:
            if done() or self.failure is not None:
                self._raise_failure()
                return
        if before_wait is not None:
            before_wait()  # what the lane waits for may be sent only once these reports arrive
        with self._condition:
            self._condition.wait_for(lambda: done() or self.failure is not None)
            self._raise_failure()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def reset(self) -> None:
        """Forget the forwards not run yet and the failure (the window was abandoned)."""
        with self._condition:
            self._condition.wait_for(lambda: not self._busy)
            self._jobs.clear()
            self._finished.clear()
            self.failure = None

    def close(self) -> None:
        """End the thread once its current forward is done (the stage is replaced)."""
        with self._condition:
            self._closed = True
            self._jobs.clear()
            self._condition.notify_all()

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._jobs or self._closed)
                if self._closed:
                    return
                key, forward = self._jobs.pop(0)
                self._busy = True
            failure = None
            if self.failure is None:
                try:
                    forward()
                except InboxSkipped:
                    pass  # a truncation: the backward of this micro-batch is skipped too
                except Exception as error:  # noqa: BLE001 - raised in the executor's thread
                    failure = error
            with self._condition:
                if failure is not None and self.failure is None:
                    self.failure = failure
                    # under the lock: a reset waiting for the lane to go idle then clears what this sets
                    self._on_failure(failure)
                self._busy = False
                self._finished.add(key)
                self._condition.notify_all()
