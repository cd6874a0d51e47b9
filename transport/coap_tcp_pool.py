"""The listening and connecting sides of CoAP over TCP: aiocoap's TCP server and client pool, for
:class:`~edgert.transport.coap_tcp.LargeTcpConnection`.

- :class:`LargeTCPServer` binds port 0 (the OS picks) without SO_REUSEPORT, over TLS where given, and
  hands each connection the server's limits, guard, screen and fast path;
- :class:`LargeTCPClient` keeps one connection per peer, connects once however many requests wait,
  checks a TLS server's identity and waits for its CSM before the first request (so that request is
  not split against the 1152-byte default);
- :func:`add_tcp_server` and :func:`add_tcp_client` attach them to an aiocoap ``Context``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable

from aiocoap import error as coap_error
from aiocoap import util
from aiocoap.tokenmanager import TokenManager
from aiocoap.transports.tcp import TCPClient, TCPServer

from edgert.transport.coap_tcp import (
    CSM_TIMEOUT,
    DEFAULT_PORT,
    TLS_SCHEME,
    FastServer,
    LargeTcpConnection,
    Screen,
    Trust,
)
from edgert.transport.guard import ConnectionGuard
from edgert.transport.limits import Limits
from edgert.transport.tls import PeerIdentity


class LargeTCPServer(TCPServer):
    """aiocoap's TCP server with port 0, no SO_REUSEPORT, :class:`LargeTcpConnection` and a connection guard."""

    _default_port = DEFAULT_PORT

    @classmethod
    async def create_large_server(cls, host: str, port: int, tman, log, loop, *, limits: Limits,
                                  guard: ConnectionGuard, fast_server: FastServer | None = None,
                                  screen: Screen | None = None, trust: Trust | None = None,
                                  ssl_context: ssl.SSLContext | None = None):
        self = cls()
        if ssl_context is not None:
            self._scheme = TLS_SCHEME
        self._tokenmanager = tman
        self.log = log
        max_message_size = limits.tcp_max_message_size

        def new_connection():
            # joins self._pool in connection_made: a failed TLS handshake never gets there, so never leaks
            return LargeTcpConnection(self, log, loop, is_server=True, max_message_size=max_message_size,
                                      fast_server=fast_server, screen=screen, guard=guard, trust=trust)

        tls = {} if ssl_context is None else {"ssl": ssl_context, "ssl_handshake_timeout": limits.frame_timeout}
        try:
            self.server = await loop.create_server(new_connection, host, port, **tls)
        except socket.gaierror as exc:
            raise coap_error.ResolutionError(f"no local bindable address for {host!r}") from exc
        return self

    @property
    def port(self) -> int:
        """The TCP port the server listens on (useful after binding port 0)."""
        return self.server.sockets[0].getsockname()[1]


class LargeTCPClient(TCPClient):
    """aiocoap's TCP client pool using :class:`LargeTcpConnection` and waiting for the peer's CSM."""

    _default_port = DEFAULT_PORT
    max_message_size: int = 1024 * 1024
    csm_timeout: float = CSM_TIMEOUT
    ssl_context: ssl.SSLContext | None = None
    check_peer: Callable[[PeerIdentity | None], str | None] | None = None
    """TLS only: why a server's identity is not acceptable (None: it is), checked before the first request."""

    async def _spawn_protocol(self, message):
        if message.unresolved_remote is None:
            host = message.opt.uri_host
            port = message.opt.uri_port or self._default_port
            if host is None:
                raise ValueError("no host to send the message to (neither Uri-Host nor remote)")
        else:
            host, port = util.hostportsplit(message.unresolved_remote)
            port = port or self._default_port
        return await self.connection(host, port)

    async def connection(self, host: str, port: int) -> LargeTcpConnection:
        """The pooled connection to (host, port), connecting (and awaiting the CSM) if needed."""
        key = (host, port)
        conn = self._pool.get(key)
        if conn is not None:
            return conn
        pending = self._connecting.get(key)
        if pending is None:
            pending = self._connecting[key] = asyncio.ensure_future(self._connect(host, port))
            pending.add_done_callback(lambda done, key=key: self._connected(key, done))
        return await asyncio.shield(pending)

    def _connected(self, key: tuple[str, int], attempt: asyncio.Future) -> None:
        """A connection attempt ended: the next request tries afresh.

        Each waiter sees a failure through its shield; when every waiter has given up (a
        request timed out, a worker shut down) nobody would, and asyncio would log "Task
        exception was never retrieved".
        """
        self._connecting.pop(key, None)
        if not attempt.cancelled():
            attempt.exception()

    async def _connect(self, host: str, port: int) -> LargeTcpConnection:
        try:
            _, conn = await self.loop.create_connection(
                lambda: LargeTcpConnection(
                    self, self.log, self.loop, is_server=False, max_message_size=self.max_message_size
                ),
                host,
                port,
                ssl=self.ssl_context,
                server_hostname="" if self.ssl_context is not None else None,
            )
        except socket.gaierror as exc:
            raise coap_error.ResolutionError(f"no address found for {host!r}") from exc
        except ssl.SSLError as exc:
            raise coap_error.NetworkError(f"TLS handshake with {host}:{port} failed: {exc.reason or exc}") from exc
        except OSError as exc:
            raise coap_error.NetworkError(f"connection to {host}:{port} failed: {exc}") from exc
        if self.check_peer is not None:
            refusal = self.check_peer(conn.peer)
            if refusal is not None:
                conn.abort("peer refused")
                raise coap_error.NetworkError(f"{host}:{port} refused: {refusal}")
        try:
            await asyncio.wait_for(asyncio.shield(conn.csm_received), self.csm_timeout)
        except asyncio.TimeoutError:
            conn.abort("No CSM received in time")
            raise coap_error.NetworkError(f"{host}:{port} sent no CSM within {self.csm_timeout} s") from None
        self._pool[(host, port)] = conn
        return conn

    @classmethod
    async def create_large_client(cls, tman, log, loop, *, max_message_size: int,
                                  ssl_context: ssl.SSLContext | None = None):
        self = await cls.create_client_transport(tman, log, loop)
        self.max_message_size = max_message_size
        if ssl_context is not None:
            self._scheme, self.ssl_context = TLS_SCHEME, ssl_context
        self._connecting = {}
        return self


async def add_tcp_server(ctx, host: str, port: int, *, limits: Limits, guard: ConnectionGuard,
                         fast_server: FastServer | None = None, screen: Screen | None = None,
                         trust: Trust | None = None,
                         ssl_context: ssl.SSLContext | None = None) -> LargeTCPServer:
    """Attach a listening :class:`LargeTCPServer` to an aiocoap ``Context``; returns it.

    With ``ssl_context`` it serves ``coaps+tcp`` (TLS) instead of ``coap+tcp``. ``guard`` applies
    ``limits``' connection limits (share one between the listeners of one server); ``screen``
    checks each request's head before its payload is received; ``trust`` says which TLS peers
    count as verified.
    """
    tman = TokenManager(ctx)
    server = await LargeTCPServer.create_large_server(
        host, port, tman, ctx.log, ctx.loop, limits=limits, guard=guard, fast_server=fast_server,
        screen=screen, trust=trust, ssl_context=ssl_context,
    )
    tman.token_interface = server
    ctx.request_interfaces.append(tman)
    return server


async def add_tcp_client(ctx, *, max_message_size: int,
                         ssl_context: ssl.SSLContext | None = None) -> LargeTCPClient:
    """Attach a :class:`LargeTCPClient` (outgoing ``coap+tcp://``, or ``coaps+tcp://`` with ``ssl_context``)."""
    tman = TokenManager(ctx)
    client = await LargeTCPClient.create_large_client(
        tman, ctx.log, ctx.loop, max_message_size=max_message_size, ssl_context=ssl_context
    )
    tman.token_interface = client
    ctx.request_interfaces.append(tman)
    return client

