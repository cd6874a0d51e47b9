"""CoAP over TCP (RFC 8323) for tensors: aiocoap's TCP transport with large messages.

aiocoap's own TCP transport caps messages at 1 MiB, reassembles them with a
quadratic ``bytes +=`` spool, copies the payload once per option while parsing,
cannot bind port 0 and binds with SO_REUSEPORT. This module subclasses it to:

- advertise a configurable Max-Message-Size in the CSM, so a whole tensor
  message travels as one CoAP message (peers with a smaller limit still get
  BERT blocks from aiocoap's blockwise layer, which reads the peer's CSM);
- receive each payload straight into its own ``bytearray``: the connection is an
  :class:`asyncio.BufferedProtocol`, so the socket writes a large payload into it
  (``recv_into``) and nothing copies it afterwards;
- send the head and each large payload piece as separate writes (no join copy);
  an envelope's tensor data goes to the socket from the arrays themselves;
- answer an over-size request with 4.13 (and Size1) and skip its bytes instead of
  aborting the connection;
- bind port 0 (the OS picks) without SO_REUSEPORT, and wait for the server's CSM
  before the first request so that request is not split against the 1152-byte
  default;
- offer a fast path for plain request/response exchanges (no Observe, no block
  options): :meth:`LargeTcpConnection.request` on the client and a ``fast_server``
  hook on the server bypass aiocoap's token manager, pipes and per-request tasks,
  which cost about three quarters of a small round trip. Fast-path tokens are 8
  bytes starting with 0xED, disjoint from aiocoap's short counter tokens, so both
  paths share one connection. Everything else (observations, BERT, UDP) still goes
  through aiocoap.

aiocoap internals this package relies on (pin aiocoap to ``>=0.4.17,<0.5``; the
tests in ``tests/transport/test_coap_tcp_framing.py`` and ``test_coap_endpoints.py``
exercise each of them):

- ``transports.tcp``: ``TcpConnection``, ``TCPServer``, ``TCPClient`` (``_pool``,
  ``_spawn_protocol``, ``_dispatch_incoming``, ``_dispatch_error``), ``_encode_length`` (framing.py);
- ``transports.rfc8323common``: ``_remote_settings``, ``_process_signaling``,
  ``_send_initial_csm``, ``_my_max_message_size``, ``maximum_payload_size``;
- ``TokenManager`` / ``MessageManager`` wiring and ``Context.request_interfaces``
  (here, in ``server.py`` and ``client.py``);
- ``MessageInterfaceUDP6._create_transport_endpoint`` (server.py: a UDP socket
  without SO_REUSEPORT) and ``BlockwiseRequest._complete_by_requesting_block2``
  (client.py: Block2 responses on the fast path).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
from collections.abc import Callable, Sequence

from aiocoap import Message, util
from aiocoap import error as coap_error
from aiocoap.message import Direction
from aiocoap.numbers.codes import Code
from aiocoap.tokenmanager import TokenManager
from aiocoap.transports import rfc8323common
from aiocoap.transports.tcp import TCPClient, TcpConnection, TCPServer

from edgert.transport.framing import Buffer, _frame_length, _options_end, serialize_head
from edgert.transport.limits import HEAD_SLACK
from edgert.transport.tls import PeerIdentity, peer_identity

#: Payloads at or above this size are written separately from their head.
_SPLIT_WRITE = 64 * 1024

#: Large payloads go to a TLS transport in slices of this size (encryption overlaps sending).
_TLS_SLICE = 256 * 1024

#: Size of the reused buffer that frame heads (and small frames) are received into.
_SCRATCH = 64 * 1024

#: Scheme and default port of CoAP over TLS (RFC 8323).
TLS_SCHEME, COAPS_PORT = "coaps+tcp", 5684

#: Seconds a new client connection waits for the server's CSM.
CSM_TIMEOUT = 5.0

#: First byte of fast-path tokens (aiocoap's own tokens are 1-3 bytes long in practice).
FAST_TOKEN_PREFIX = 0xED

_fast_tokens = itertools.count(1)

FastServer = Callable[["LargeTcpConnection", Message], bool]
"""``hook(connection, request) -> handled``: a server's fast path; False hands the request to aiocoap."""


class LargeTcpConnection(TcpConnection, asyncio.BufferedProtocol):
    """One RFC 8323 connection with a configurable Max-Message-Size and a linear receive path.

    As a :class:`asyncio.BufferedProtocol` it receives a large payload straight into
    the payload's own buffer (``recv_into``); heads and small frames land in a reused scratch buffer.
    """

    def __init__(self, ctx, log, loop, *, is_server: bool, max_message_size: int,
                 fast_server: FastServer | None = None) -> None:
        super().__init__(ctx, log, loop, is_server=is_server)
        self._my_max_message_size = max_message_size
        self._fast_server = fast_server
        self._pending: dict[bytes, asyncio.Future] = {}
        self._head = bytearray()
        self._fill: tuple[Message, bytearray] | None = None
        self._filled = 0
        self._discard = 0
        self._scratch = memoryview(bytearray(_SCRATCH))
        self.csm_received: asyncio.Future = loop.create_future()
        self.peer: PeerIdentity | None = None  # the verified certificate's identity (TLS only)
        self._tls = False

    def connection_made(self, transport) -> None:
        self.peer = peer_identity(transport)
        self._tls = transport.get_extra_info("ssl_object") is not None
        if self._local_is_server:
            self._ctx._pool.add(self)
        super().connection_made(transport)

    @property
    def peer_max_message_size(self) -> int:
        """The Max-Message-Size the peer announced in its CSM (1152 before it arrived)."""
        return (self._remote_settings or {}).get("max-message-size", 1152)

    def fits(self, message: Message) -> bool:
        """Whether ``message`` travels as one message to this peer (by its Max-Message-Size, BERT or not)."""
        size = len(message.payload)
        if size + 64 <= min(self.peer_max_message_size, 1152):
            return True
        return len(serialize_head(message)) + size <= self.peer_max_message_size

    @property
    def is_open(self) -> bool:
        """Whether messages can still be sent on this connection."""
        return self._transport is not None and not self._transport.is_closing() and self._ctx is not None

    async def release(self) -> None:
        """Send Release (RFC 8323 section 5.5) unless the connection is closing already.

        aiocoap releases every pooled connection on shutdown in tasks it never asks for a
        result: a Release on a closing connection (a TLS peer that said goodbye) would fail
        there, logged as "Task exception was never retrieved".
        """
        if self.is_open:
            await super().release()

    async def request(self, message: Message, parts: Sequence[Buffer] | None = None) -> Message:
        """Fast path: send ``message`` (a request fitting the peer's Max-Message-Size) and await its response.

        ``parts``, if given, is the payload in pieces (see :meth:`_send_message`).
        """
        token = bytes((FAST_TOKEN_PREFIX,)) + next(_fast_tokens).to_bytes(7, "big")
        message.token = token
        future = self.loop.create_future()
        self._pending[token] = future
        try:
            self._send_message(message, parts)
            return await future
        finally:
            self._pending.pop(token, None)

    # -- sending ---------------------------------------------------------

    def _send_message(self, msg: Message, parts: Sequence[Buffer] | None = None) -> None:
        """Write ``msg`` as one frame; ``parts`` (1-D byte buffers), if given, replace ``msg.payload``.

        Small pieces are joined; each large one is written by reference, so the only
        copy is the socket's (or asyncio's write buffer's, for what the socket does not take at once).
        """
        if self._transport is None or self._transport.is_closing():
            raise coap_error.NetworkError(f"connection to {self.hostinfo} is closed")
        if parts is None:
            parts = (msg.payload,) if msg.payload else ()
        size = sum(map(len, parts))
        write = self._transport.write
        if size < _SPLIT_WRITE:
            write(b"".join((serialize_head(msg, size), *parts)))
            return
        small: list[Buffer] = [serialize_head(msg, size)]
        for part in parts:
            if len(part) < _SPLIT_WRITE:
                small.append(part)
                continue
            if small:
                write(b"".join(small))
                small = []
            # a memoryview keeps asyncio's partial-send path from slicing (copying) the rest
            view = memoryview(part).cast("B")
            if self._tls:
                # TLS encrypts each write whole before sending it: slices let the peer decrypt
                # one while this side encrypts the next
                for start in range(0, len(view), _TLS_SLICE):
                    write(view[start:start + _TLS_SLICE])
            else:
                write(view)
        if small:
            write(b"".join(small))

    # -- receiving -------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._fill is not None:
            return memoryview(self._fill[1])[self._filled:]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._fill is None:
            self.data_received(self._scratch[:nbytes])
            return
        self._filled += nbytes
        msg, payload = self._fill
        if self._filled == len(payload):
            self._fill = None
            self._deliver(msg)

    def data_received(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            if self._discard:
                step = min(self._discard, len(view))
                self._discard -= step
                view = view[step:]
                continue
            if self._fill is not None:
                msg, payload = self._fill
                step = min(len(payload) - self._filled, len(view))
                payload[self._filled : self._filled + step] = view[:step]
                self._filled += step
                view = view[step:]
                if self._filled == len(payload):
                    self._fill = None
                    if not self._deliver(msg):
                        return
                continue
            self._head += view
            view = view[len(view) :]
            if not self._parse_head():
                return

    def _parse_head(self) -> bool:
        """Consume complete frames (or start a payload fill) from ``self._head``; False if aborted."""
        while self._head:
            frame = _frame_length(self._head)
            if frame is None:
                return True
            token_at, tkl, rest = frame
            total = token_at + tkl + rest
            if tkl > 8:
                self.abort("Overly long token")
                return False
            if total > self._my_max_message_size:
                if len(self._head) < token_at + tkl:
                    return True
                if not self._refuse_oversize(token_at, tkl, total):
                    return False
                continue
            opt_at = token_at + tkl
            try:
                opt_end = _options_end(self._head, opt_at, total)
            except coap_error.UnparsableMessage as exc:
                self.abort(f"Failed to parse message: {exc}")
                return False
            if opt_end is None:
                return True
            msg = Message(code=self._head[token_at - 1], _token=bytes(self._head[token_at:opt_at]))
            try:
                msg.opt.decode(bytes(self._head[opt_at:opt_end]))
            except (coap_error.UnparsableMessage, ValueError) as exc:
                self.abort(f"Failed to parse options: {exc}")
                return False
            msg.direction = Direction.INCOMING
            msg.remote = self
            if opt_end == total:
                msg.payload = b""
                del self._head[:total]
                if not self._deliver(msg):
                    return False
                continue
            start = opt_end + 1
            payload = bytearray(total - start)
            have = min(len(self._head), total) - start
            payload[:have] = memoryview(self._head)[start : start + have]
            msg.payload = payload
            del self._head[: start + have]
            if have == len(payload):
                if not self._deliver(msg):
                    return False
                continue
            self._fill = (msg, payload)
            self._filled = have
            return True
        return True

    def _refuse_oversize(self, token_at: int, tkl: int, total: int) -> bool:
        """Answer an over-size request with 4.13 and skip its bytes; abort (False) on anything else."""
        code = Code(self._head[token_at - 1])
        if not code.is_request() or self._remote_settings is None:
            self.abort(f"Overly large message announced ({total} bytes)")
            return False
        token = bytes(self._head[token_at : token_at + tkl])
        answer = Message(
            code=Code.REQUEST_ENTITY_TOO_LARGE,
            payload=(
                f"message of {total} bytes exceeds this endpoint's Max-Message-Size of "
                f"{self._my_max_message_size} bytes"
            ).encode(),
        )
        answer.token = token
        answer.opt.size1 = max(0, self._my_max_message_size - HEAD_SLACK)
        self._send_message(answer)
        skip = min(total, len(self._head))
        del self._head[:skip]
        self._discard = total - skip
        self.log.warning("Refused over-size request of %d bytes from %s", total, self.hostinfo)
        return True

    def _deliver(self, msg: Message) -> bool:
        """Hand one complete message to signalling or the token manager; False if the connection ended."""
        if msg.code.is_signalling():
            try:
                self._process_signaling(msg)
            except rfc8323common.CloseConnection as exc:
                self._ctx._dispatch_error(self, exc.args[0])
                if self._transport is not None:
                    self._transport.close()
                return False
            if self._remote_settings is not None and not self.csm_received.done():
                self.csm_received.set_result(None)
            return self._transport is not None and not self._transport.is_closing()
        if self._remote_settings is None:
            self.abort("No CSM received")
            return False
        if self._ctx is None:
            return False
        if msg.code.is_response():
            future = self._pending.pop(msg.token, None)
            if future is not None:
                if not future.done():
                    future.set_result(msg)
                return True
        elif self._fast_server is not None and self._fast_server(self, msg):
            return True
        try:
            self._ctx._dispatch_incoming(self, msg)
        except AttributeError:  # the context was shut down under this connection: nobody is listening
            return False
        return True

    def connection_lost(self, exc) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(coap_error.NetworkError(f"connection to {self.hostinfo} lost: {exc}"))
        if not self.csm_received.done():
            self.csm_received.set_exception(coap_error.NetworkError(f"connection lost before CSM: {exc}"))
            self.csm_received.exception()  # mark retrieved
        if self._ctx is not None:
            super().connection_lost(exc)


class LargeTCPServer(TCPServer):
    """aiocoap's TCP server with port 0, no SO_REUSEPORT and :class:`LargeTcpConnection`."""

    @classmethod
    async def create_large_server(cls, host: str, port: int, tman, log, loop, *, max_message_size: int,
                                  fast_server: FastServer | None = None, ssl_context: ssl.SSLContext | None = None):
        self = cls()
        if ssl_context is not None:
            self._scheme, self._default_port = TLS_SCHEME, COAPS_PORT
        self._tokenmanager = tman
        self.log = log

        def new_connection():
            # joins self._pool in connection_made: a failed TLS handshake never gets there, so never leaks
            return LargeTcpConnection(self, log, loop, is_server=True, max_message_size=max_message_size,
                                      fast_server=fast_server)

        try:
            self.server = await loop.create_server(new_connection, host, port, ssl=ssl_context)
        except socket.gaierror as exc:
            raise coap_error.ResolutionError(f"no local bindable address for {host!r}") from exc
        return self

    @property
    def port(self) -> int:
        """The TCP port the server listens on (useful after binding port 0)."""
        return self.server.sockets[0].getsockname()[1]


class LargeTCPClient(TCPClient):
    """aiocoap's TCP client pool using :class:`LargeTcpConnection` and waiting for the peer's CSM."""

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
            self._scheme, self._default_port, self.ssl_context = TLS_SCHEME, COAPS_PORT, ssl_context
        self._connecting = {}
        return self


async def add_tcp_server(ctx, host: str, port: int, *, max_message_size: int,
                         fast_server: FastServer | None = None,
                         ssl_context: ssl.SSLContext | None = None) -> LargeTCPServer:
    """Attach a listening :class:`LargeTCPServer` to an aiocoap ``Context``; returns it.

    With ``ssl_context`` it serves ``coaps+tcp`` (TLS) instead of ``coap+tcp``.
    """
    tman = TokenManager(ctx)
    server = await LargeTCPServer.create_large_server(
        host, port, tman, ctx.log, ctx.loop, max_message_size=max_message_size, fast_server=fast_server,
        ssl_context=ssl_context,
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

