"""A worker's sends in flight: handed from the compute thread to the transport loop, not waited for.

The compute thread submits each send (activations, gradients, step reports, state copies)
and goes on (:meth:`TensorClient.submit`: the frame is built in the compute thread and written
by one loop callback, with no task); at most :data:`MAX_IN_FLIGHT` are outstanding. Sends belong to a *generation*,
one per stage assignment: a send of the current generation that had to arrive and failed
is raised in the compute thread at its next submit (the stage has lost a peer). Sends of
earlier generations (before a recovery or a re-plan) and those that need not arrive
(reports, copies) fail quietly. On shutdown every send is cancelled and awaited, so none
fails after the loop is gone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading

from edgert.transport import Envelope, PieceOptions, TensorClient

log = logging.getLogger("edgert.worker.outbox")
MAX_IN_FLIGHT = 16


class Outbox:
    """The sends a worker has in flight, and what their failures mean."""

    def __init__(self, client: TensorClient, name: str):
        self._client = client
        self._name = name
        self._pending: collections.deque[tuple[concurrent.futures.Future, int, bool]] = collections.deque()
        self._lock = threading.Lock()
        self._generation = 0
        self.closed = False  # shutting down: nothing more is sent

    def new_generation(self) -> None:
        """The sends so far are history (a new stage, a failed one): their failures raise no more."""
        with self._lock:
            self._generation += 1

    def forget(self) -> None:
        """Cancel the sends in flight: their peers or coordinator may be gone for good."""
        with self._lock:
            for future, _, _ in self._pending:
                future.cancel()
            self._pending.clear()

    def close(self) -> None:
        """Send nothing more and cancel what is in flight (wakes a compute thread waiting for a send)."""
        self.closed = True
        self.forget()

    async def wait_closed(self) -> None:
        """Wait until every cancelled send has ended (on the transport loop)."""
        await self._client.cancel_submissions()

    def submit(self, url: str, path: str, envelope: Envelope, codec, method: str = "POST",
               must_arrive: bool = True, pieces: PieceOptions | None = None) -> None:
        """Hand a send to the transport loop without waiting for it; raise an earlier failure that matters.

        Called from the compute thread. Waits only while :data:`MAX_IN_FLIGHT` sends are
        outstanding. Once closed, sends nothing.
        """
        if self.closed:
            return
        while True:
            with self._lock:
                if not self._pending or not (self._pending[0][0].done() or len(self._pending) >= MAX_IN_FLIGHT):
                    break
                future, generation, fatal = self._pending.popleft()
            try:
                future.result()
            except Exception as error:  # noqa: BLE001 - cancelled or failed
                if fatal and generation == self._generation:
                    raise  # a failed send of this assignment fails the stage, in the compute thread
                log.info("%s: a send failed: %s", self._name, error)
        future = self._client.submit(method, url, path, envelope, codec=codec, pieces=pieces)
        with self._lock:
            self._pending.append((future, self._generation, must_arrive))
