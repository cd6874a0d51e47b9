"""Observe (RFC 7641) on both sides: :class:`Observation` for a client, :class:`Observable` for a server.

``TensorClient.observe`` returns an :class:`Observation`; ``TensorServer.add_observable``
returns the :class:`Observable` whose :meth:`~Observable.notify` informs every observer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiocoap import Message
from aiocoap import error as coap_error
from aiocoap.numbers.codes import Code

from edgert.transport import coap_tcp
from edgert.transport.errors import PeerUnreachable, RequestTimeout
from edgert.transport.message import Request, Response

if TYPE_CHECKING:
    from edgert.transport.client import TensorClient
    from edgert.transport.endpoint import HandlerResult, ObservableEndpoint


class Observation:
    """An observation in progress; iterate it for notifications, :meth:`cancel` to stop."""

    def __init__(self, client: TensorClient, url: str, path: str, timeout: float) -> None:
        self._client = client
        self._url = url
        self._path = path
        self._timeout = timeout
        self._request = None
        self._iterator: AsyncIterator | None = None
        self._registration: Message | None = None
        self.cancelled = False

    def __aiter__(self) -> Observation:
        return self

    async def __anext__(self) -> Response:
        if self.cancelled:
            raise StopAsyncIteration
        if self._request is None:
            return await self._register()
        try:
            message = await self._iterator.__anext__()
        except StopAsyncIteration:
            self.cancelled = True
            raise
        except coap_error.NetworkError as exc:
            self.cancelled = True
            raise PeerUnreachable(f"observation of {self._url}/{self._path} ended: {exc}") from exc
        return Response.from_message(message).raise_for_status()

    async def _register(self) -> Response:
        client = self._client
        await client.start()
        scheme, hostinfo, base = client._target(self._url)
        uri_path = base + tuple(p for p in self._path.strip("/").split("/") if p)
        message = client._message(Code.GET, scheme, hostinfo, uri_path, (), b"", None, observe=0)
        self._request = client._context.request(message)
        try:
            first = await asyncio.wait_for(asyncio.shield(self._request.response), self._timeout)
        except asyncio.TimeoutError:
            self.cancel()
            raise RequestTimeout(f"observe {self._url}/{self._path}: no response within {self._timeout} s") from None
        except coap_error.NetworkError as exc:
            self.cancel()
            raise PeerUnreachable(f"observe {self._url}/{self._path}: {exc}") from exc
        response = Response.from_message(first)
        if not response.ok or first.opt.observe is None:
            self.cancel()
        else:
            self._registration = first
            self._iterator = self._request.observation.__aiter__()
        return response.raise_for_status()

    def cancel(self) -> None:
        """Stop receiving notifications and deregister (RFC 7641 section 3.6).

        Over TCP this sends GET with Observe: 1 under the observation's token; over
        UDP the next notification is answered with RST, which ends it as well.
        """
        if self.cancelled:
            return
        self.cancelled = True
        self._deregister()
        request, self._request = self._request, None
        if request is None:
            return
        if not request.response.done():
            request.response.cancel()
        observation = request.observation
        if observation is not None and not observation.cancelled:
            observation.cancel()

    def _deregister(self) -> None:
        first, self._registration = self._registration, None
        connection = None if first is None else first.remote
        if not isinstance(connection, coap_tcp.LargeTcpConnection) or not connection.is_open:
            return
        message = Message(code=Code.GET)
        message.opt.uri_path = first.request.opt.uri_path
        message.opt.observe = 1
        message.token = first.token
        try:
            connection._send_message(message)
        except coap_error.NetworkError:
            pass  # the connection is gone, and with it the observation


class Observable:
    """Handle of an observable resource: :meth:`notify` sets its value and informs every observer."""

    def __init__(self, endpoint: ObservableEndpoint, initial: HandlerResult) -> None:
        self._endpoint = endpoint
        self._value = initial

    async def _latest_value(self, request: Request) -> HandlerResult:
        return self._value

    def notify(self, value: HandlerResult = None) -> None:
        """Replace the value (if given) and notify each observer; callable from any thread."""
        loop = self._endpoint.server._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is not loop:
            loop.call_soon_threadsafe(self._notify_here, value)
        else:
            self._notify_here(value)

    def _notify_here(self, value: HandlerResult) -> None:
        if value is not None:
            self._value = value
        self._endpoint.updated_state()

    @property
    def observers(self) -> int:
        """How many observations are registered right now."""
        return len(self._endpoint._observations)
