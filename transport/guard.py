"""What peers can make one CoAP-over-TCP server hold: connections, buffered bytes, time.

A :class:`ConnectionGuard` belongs to one listening server (both listeners of a
:class:`~edgert.transport.server.TensorServer` share one). It applies the connection limits
of :class:`~edgert.transport.limits.Limits` (docs/SECURITY.md, "Bounded resources"):

- ``max_connections``: connections of peers without a verified cluster credential (every
  ``coap+tcp`` peer, a ``coaps+tcp`` peer without a certificate); the next one is aborted as soon
  as it is made. Enrolled peers over TLS are not counted, so strangers cannot lock them out.
- ``max_unverified_bytes``: the :class:`Budget` that payload buffers of those peers' incomplete
  frames are charged to (:mod:`~edgert.transport.frame_reader`).
- ``frame_timeout`` and ``idle_timeout``: a sweep aborts a connection whose frame (or CSM) stays
  incomplete without a byte for ``frame_timeout`` seconds, and sends a Ping after ``idle_timeout``
  seconds of silence; a peer that answers nothing within ``frame_timeout`` more is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from aiocoap import Message
from aiocoap.numbers.codes import PING

from edgert.transport.limits import Limits

if TYPE_CHECKING:
    from edgert.transport.coap_tcp import LargeTcpConnection

log = logging.getLogger("edgert.transport.guard")

#: Bounds on how often the sweep runs (seconds).
_SWEEP_MIN, _SWEEP_MAX = 0.05, 5.0


class Budget:
    """Bytes that may be held at once by several holders together; :meth:`charge` refuses rather than exceed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def charge(self, size: int) -> bool:
        """Take ``size`` bytes of the budget; False (nothing taken) if that would pass the limit."""
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def release(self, size: int) -> None:
        """Give back ``size`` bytes taken by :meth:`charge`."""
        self.used -= size


class ConnectionGuard:
    """One server's connection limits: admission, the unverified-bytes budget, and the timeout sweep."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.budget = Budget(limits.max_unverified_bytes)
        self._unverified: set[LargeTcpConnection] = set()
        self._watched: set[LargeTcpConnection] = set()
        self._sweeper: asyncio.Task | None = None

    def admit(self, connection: LargeTcpConnection) -> str | None:
        """Start watching a new server connection; returns why it must be aborted instead (None: admitted)."""
        if not connection.verified:
            if len(self._unverified) >= self.limits.max_connections:
                return (f"too many connections: this server keeps at most {self.limits.max_connections} "
                        f"from peers without a cluster credential")
            self._unverified.add(connection)
        self._watched.add(connection)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return None

    def forget(self, connection: LargeTcpConnection) -> None:
        """Stop watching a connection that closed."""
        self._unverified.discard(connection)
        self._watched.discard(connection)

    @property
    def unverified_connections(self) -> int:
        """How many connections of peers without a verified credential are open."""
        return len(self._unverified)

    async def close(self) -> None:
        """Stop the sweep."""
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper

    async def _sweep(self) -> None:
        limits = self.limits
        interval = min(max(min(limits.frame_timeout, limits.idle_timeout) / 4, _SWEEP_MIN), _SWEEP_MAX)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            for connection in list(self._watched):
                try:
                    self._check(connection, now)
                except Exception:  # noqa: BLE001  (one connection's trouble must not end the sweep)
                    log.exception("checking the connection of %s failed", connection.hostinfo)
                    self.forget(connection)

    def _check(self, connection: LargeTcpConnection, now: float) -> None:
        limits = self.limits
        quiet = now - connection.last_heard
        if connection.mid_frame:
            if quiet > limits.frame_timeout:
                self._abort(connection, f"incomplete message: nothing received for {limits.frame_timeout:g} s")
        elif quiet > limits.idle_timeout + limits.frame_timeout:
            self._abort(connection, f"idle for {quiet:.0f} s and no answer to Ping")
        elif quiet > limits.idle_timeout and connection.pinged_at <= connection.last_heard:
            connection.pinged_at = now
            connection.send_signal(Message(code=PING))

    def _abort(self, connection: LargeTcpConnection, reason: str) -> None:
        log.info("closing the connection of %s: %s", connection.hostinfo, reason)
        self.forget(connection)
        connection.abort(reason)
