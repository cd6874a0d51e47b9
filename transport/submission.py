"""Requests sent with no task or per-request objects over an open connection: the tensor path.

:meth:`TensorClient.submit <edgert.transport.client.TensorClient.submit>` builds a request's frame in
the calling thread (a worker's compute thread) and writes it on the pooled connection from there
(plaintext TCP, frames up to 64 KiB: :meth:`~edgert.transport.coap_tcp.LargeTcpConnection.write_from_thread`;
the loop arms the wait's timer later, in rounds over what was written meanwhile: :class:`WrittenRequests`,
so the write wakes nothing), or hands it to the transport loop in one callback,
which writes it; the response settles a ``concurrent.futures.Future``
straight from the protocol callback that parsed it. No coroutine, task or timeout context per
request: a timer bounds the wait. :meth:`TensorClient.request` sends the same way from its own loop,
awaiting an asyncio future instead. Only that first attempt is lean. A 5.03, a lost connection, a
timeout or a first contact go on as :meth:`TensorClient.request`'s attempts, with the same timeouts,
retries and errors; a response with more Block2 blocks is completed the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiocoap import Message
from aiocoap import error as coap_error
from aiocoap.numbers.codes import Code

from edgert.transport.errors import RETRIED_CODES, PeerUnreachable, ResponseError
from edgert.transport.framing import Buffer
from edgert.transport.message import Response

if TYPE_CHECKING:
    from edgert.transport.client import TensorClient
    from edgert.transport.coap_tcp import LargeTcpConnection


@dataclass(frozen=True)
class Attempts:
    """What every attempt of one request sends, and how long and how often it may try."""

    code: Code
    url: str
    path: str
    body: tuple[Buffer, ...]
    content_format: int | None
    timeout: float
    retries: int
    raise_for_status: bool = True
    """Whether an error code is raised (else returned as the response)."""


class Submission:
    """One request: its future, and on the loop its lean attempt or the task that goes on.

    The future is a ``concurrent.futures.Future`` (submitted from another thread) or, given one, an
    asyncio future of the client's loop (awaited there by :meth:`TensorClient.request`).
    """

    __slots__ = ("_client", "_attempts", "future", "_connection", "_token", "_timer", "_task")

    def __init__(self, client: TensorClient, attempts: Attempts, future: asyncio.Future | None = None) -> None:
        self._client = client
        self._attempts = attempts
        self.future: concurrent.futures.Future[Response] | asyncio.Future[Response] = (
            concurrent.futures.Future() if future is None else future)
        if future is not None:  # its awaiting task was cancelled: stop waiting for the response too
            future.add_done_callback(self._abandoned)
        self._connection: LargeTcpConnection | None = None
        self._token = b""
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None

    # -- on the loop ---------------------------------------------------------------------

    def go_lean(self, connection: LargeTcpConnection, token: bytes, head: bytes) -> None:
        """Write the frame on ``connection`` and wait for its response with a timer (attempt 0)."""
        if self.future.cancelled():
            return
        try:
            connection.send_request(token, head, self._attempts.body, self.settle)
        except coap_error.NetworkError as error:  # closed since the frame was built
            self._next_attempt(self._client.unreachable(*self._names, error, 0, self._attempts.retries))
            return
        self._await_response(connection, token, connection.loop.time())

    def went_out(self, connection: LargeTcpConnection, token: bytes, written_at: float) -> None:
        """The frame was written from another thread at loop time ``written_at`` (attempt 0): wait for its
        response until the attempt's timeout, counted from then."""
        if not self.future.done() and connection.awaits(token):  # else settled already (answered, or lost)
            self._await_response(connection, token, written_at)

    def _await_response(self, connection: LargeTcpConnection, token: bytes, since: float) -> None:
        self._connection, self._token = connection, token
        loop = connection.loop
        self._timer = loop.call_later(max(0.0, since + self._attempts.timeout - loop.time()), self._timed_out)
        self._client.submissions.add(self)

    def go_slow(self) -> None:
        """No open connection that takes the frame whole: every attempt as :meth:`TensorClient.request`'s."""
        if not self.future.cancelled():
            self._go_on(0)

    def cancel(self) -> asyncio.Task | None:
        """Stop: no response is waited for, no attempt follows; returns the task still to await, if any.

        A submitted future ends cancelled; an awaited one raises PeerUnreachable (its client is closing).
        """
        self._stop_waiting()
        if isinstance(self.future, asyncio.Future):
            _set(self.future, exception=PeerUnreachable(
                f"{self._attempts.code.name} {self._attempts.url}/{self._attempts.path.strip('/')}: "
                f"the client is closing"))
        else:
            self.future.cancel()
        if self._task is not None:
            self._task.cancel()
        return self._task

    def _abandoned(self, future: asyncio.Future) -> None:
        if future.cancelled():
            self._stop_waiting()
            if self._task is not None:
                self._task.cancel()

    def settle(self, outcome: Message | Response | Exception) -> None:
        """The lean attempt's response, or the network error that ended it (loop thread)."""
        self._stop_waiting()
        if isinstance(outcome, Exception):
            self._next_attempt(self._client.unreachable(*self._names, outcome, 0, self._attempts.retries))
        elif outcome.code in RETRIED_CODES and self._attempts.retries:
            self._next_attempt(None)
        elif isinstance(outcome, Response):  # a plain response: no Block2
            self._resolve(outcome)
        elif outcome.opt.block2 is not None and outcome.opt.block2.more:
            request = self._client.request_message(self._attempts.code, self._attempts.url, self._attempts.path,
                                                   self._attempts.content_format, self._connection)
            self._run(self._client.rest_of_blocks(request, outcome), checked=False)
        else:
            self._resolve(Response.from_message(outcome))

    def _timed_out(self) -> None:
        self._timer = None
        self._stop_waiting()
        self._next_attempt(self._client.timed_out(*self._names, self._attempts.timeout, 0, self._attempts.retries))

    def _stop_waiting(self) -> None:
        self._client.submissions.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._connection is not None:
            self._connection.forget_request(self._token)

    def _next_attempt(self, failure: Exception | None) -> None:
        """Attempt 0 failed with ``failure`` (None: 5.03): the next, or ``failure`` if none is left."""
        if not self._attempts.retries:
            _set(self.future, exception=failure)
        elif not self.future.cancelled():
            self._go_on(1)

    def _go_on(self, first: int) -> None:
        a = self._attempts
        self._run(self._client._attempts(a.code, a.url, a.path, a.body, a.content_format, (), a.timeout,
                                         a.retries, a.raise_for_status, first=first), checked=True)

    def _run(self, attempts: Coroutine[Any, Any, Response], checked: bool) -> None:
        """Settle the future from a task running ``attempts`` (``checked``: it raises error codes itself)."""
        loop = asyncio.get_running_loop()
        task = self._task = loop.create_task(attempts)
        self._client.submissions.add(self)
        self.future.add_done_callback(lambda future: future.cancelled() and _cancel_soon(loop, task))

        def done(finished: asyncio.Task) -> None:
            self._client.submissions.discard(self)
            if finished.cancelled():
                self.future.cancel()
            elif finished.exception() is not None:
                _set(self.future, exception=finished.exception())
            elif checked:
                _set(self.future, result=finished.result())
            else:
                self._resolve(finished.result())

        task.add_done_callback(done)

    def _resolve(self, response: Response) -> None:
        if not self._attempts.raise_for_status:
            _set(self.future, result=response)
            return
        try:
            _set(self.future, result=response.raise_for_status())
        except ResponseError as error:
            _set(self.future, exception=error)

    @property
    def _names(self) -> tuple[Code, str, str]:
        return self._attempts.code, self._attempts.url, self._attempts.path


#: Seconds between the rounds in which a client's loop arms the response timers of requests written from
#: other threads. A timer counts from the write, so this bounds how late it is armed, not when it fires;
#: rounds spare the loop a wake per request, which under a pipeline's load costs as much as the request.
ARM_INTERVAL = 0.05


class WrittenRequests:
    """Requests written from other threads whose response timers the client's loop has yet to arm: a round
    every :data:`ARM_INTERVAL` while requests come, none while none do."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._written: list[tuple[Submission, LargeTcpConnection, bytes, float]] = []
        self._scheduled = False  # a round is due (or the loop was asked for one)
        self._round: asyncio.TimerHandle | None = None

    def add(self, submission: Submission, connection: LargeTcpConnection, token: bytes) -> None:
        """(Any thread.) ``submission``'s frame went out on ``connection`` just now: its timer is armed in the
        next round (the loop is woken only if no round is due)."""
        with self._lock:
            self._written.append((submission, connection, token, self._loop.time()))
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._next_round)

    def _next_round(self) -> None:
        self._round = self._loop.call_later(ARM_INTERVAL, self._arm)

    def _arm(self) -> None:
        """(Loop thread.) Arm the timers of the requests written since the last round; another round follows
        if there were any."""
        with self._lock:
            written, self._written = self._written, []
            self._scheduled = bool(written)
        _went_out(written)
        if written:
            self._next_round()

    def stop(self) -> None:
        """(Loop thread.) Arm the timers of what was written and stop the rounds (the client is closing)."""
        if self._round is not None:
            self._round.cancel()
            self._round = None
        with self._lock:
            written, self._written = self._written, []
            self._scheduled = False
        _went_out(written)


def _went_out(written: list[tuple[Submission, LargeTcpConnection, bytes, float]]) -> None:
    for submission, connection, token, written_at in written:
        submission.went_out(connection, token, written_at)


def _cancel_soon(loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
    """The owner cancelled the future (from its own thread): the attempts stop too."""
    try:
        loop.call_soon_threadsafe(task.cancel)
    except RuntimeError:  # the loop is closed: nothing runs any more
        pass


def _set(future: concurrent.futures.Future | asyncio.Future, *, result: Any = None,
         exception: BaseException | None = None) -> None:
    """Settle ``future`` unless its owner cancelled it meanwhile (from another thread, or its task)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except (concurrent.futures.InvalidStateError, asyncio.InvalidStateError):
        pass
