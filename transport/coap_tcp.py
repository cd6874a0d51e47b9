"""CoAP over TCP (RFC 8323) for tensors: aiocoap's TCP transport with large messages.

aiocoap's own TCP transport caps messages at 1 MiB, reassembles them with a
quadratic ``bytes +=`` spool, copies the payload once per option while parsing,
cannot bind port 0 and binds with SO_REUSEPORT. This module subclasses it to:

- advertise a configurable Max-Message-Size in the CSM, so a whole tensor
  message travels as one CoAP message (peers with a smaller limit still get
  BERT blocks from aiocoap's blockwise layer, which reads the peer's CSM);
- receive each payload straight into its own ``bytearray``: the connection is an
  :class:`asyncio.BufferedProtocol`, so the socket writes a large payload into it
  (``recv_into``); an unverified peer's payload arrives in chunks that grow with the bytes
  (joined once complete), a request is screened from its head before its payload is stored,
  and a server bounds what peers without a verified credential can hold
  (:mod:`~edgert.transport.frame_reader`, :mod:`~edgert.transport.guard`);
- send the head and each large payload piece as separate writes (no join copy);
  an envelope's tensor data goes to the socket from the arrays themselves;
- answer an over-size request with 4.13 (and Size1) and skip its bytes instead of
  aborting the connection;
- honour a peer's Max-Message-Size below 1152 bytes: responses are split into Block2 blocks
  that fit it (aiocoap assumes at least 1152);
- bind port 0 and wait for the server's CSM before the first request (the listening and
  connecting sides: :mod:`~edgert.transport.coap_tcp_pool`);
- offer a fast path for plain request/response exchanges (no Observe, no block
  options): :meth:`LargeTcpConnection.request` on the client and a ``fast_server``
  hook on the server bypass aiocoap's token manager, pipes and per-request tasks,
  which cost about three quarters of a small round trip; such messages are read
  without aiocoap's ``Message`` (:mod:`~edgert.transport.incoming`) and the server's
  responses are written from pre-encoded options (:meth:`LargeTcpConnection.send_frame`). Fast-path tokens are 8
  bytes starting with 0xED, disjoint from aiocoap's short counter tokens, so both
  paths share one connection. :meth:`LargeTcpConnection.send_request` is that path
  without a future: a frame built elsewhere (another thread, see
  :mod:`~edgert.transport.submission`) and a callback for its response, and
  :meth:`LargeTcpConnection.write_from_thread` writes such a frame from the thread that
  built it, without waking the loop (plaintext only; every write holds the connection's
  write lock, so frames never interleave). Everything else (observations, BERT, UDP)
  still goes through aiocoap.

aiocoap internals this package relies on (pin aiocoap to ``>=0.4.17,<0.5``; the
tests in ``tests/transport/test_coap_tcp_framing.py`` and ``test_coap_endpoints.py``
exercise each of them):

- ``transports.tcp``: ``TcpConnection``, ``TCPServer``, ``TCPClient`` (``_pool``,
  ``_spawn_protocol``, ``_dispatch_incoming``, ``_dispatch_error``; the last two in coap_tcp_pool.py),
  ``_encode_length`` (framing.py);
- ``transports.rfc8323common``: ``_remote_settings``, ``_process_signaling``,
  ``_send_initial_csm``, ``_my_max_message_size``, ``abort``; ``maximum_payload_size`` and
  ``maximum_block_size_exp`` (overridden here, read by aiocoap's blockwise layer);
- ``TokenManager`` / ``MessageManager`` wiring and ``Context.request_interfaces``
  (here, in ``server.py`` and ``client.py``);
- ``MessageInterfaceUDP6._create_transport_endpoint`` (server.py: a UDP socket
  without SO_REUSEPORT) and ``BlockwiseRequest._complete_by_requesting_block2``
  (client.py: Block2 responses on the fast path).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import socket
import threading
from collections.abc import Callable, Sequence

from aiocoap import Message
from aiocoap import error as coap_error
from aiocoap.transports import rfc8323common
from aiocoap.transports.tcp import TcpConnection

from edgert.transport.frame_reader import FrameReader
from edgert.transport.framing import Buffer, frame_head, serialize_head
from edgert.transport.guard import ConnectionGuard
from edgert.transport.incoming import IncomingMessage
from edgert.transport.message import Response
from edgert.transport.tls import PeerIdentity, peer_identity

#: Payloads at or above this size are written separately from their head.
_SPLIT_WRITE = 64 * 1024

#: Large payloads go to a TLS transport in slices of this size (encryption overlaps sending).
_TLS_SLICE = 256 * 1024

#: Frames up to this size may be written from the thread that built them (larger ones go through the loop).
THREAD_WRITE_BYTES = 64 * 1024

#: The port edgert servers listen on, and what a URL without a port means, for every scheme.
#: (Not CoAP's registered 5683/5684, which other CoAP stacks assume: give them the port.)
DEFAULT_PORT = 5701

#: Scheme of CoAP over TLS (RFC 8323).
TLS_SCHEME = "coaps+tcp"

#: Bytes kept beside a block for a response's head, when blocks must fit a peer's Max-Message-Size
#: (RFC 8323's default of 1152 is one 1024-byte block and this).
BLOCK_HEAD_ROOM = 128

#: Seconds a new client connection waits for the server's CSM.
CSM_TIMEOUT = 5.0

#: First byte of fast-path tokens (aiocoap's own tokens are 1-3 bytes long in practice).
FAST_TOKEN_PREFIX = 0xED

_fast_tokens = itertools.count(1)


def fast_token() -> bytes:
    """A new fast-path token (any thread may ask: ``next`` on a count is atomic)."""
    return bytes((FAST_TOKEN_PREFIX,)) + next(_fast_tokens).to_bytes(7, "big")


FastServer = Callable[["LargeTcpConnection", "Message | IncomingMessage"], bool]
"""``hook(connection, request) -> handled``: a server's fast path; False hands the request to aiocoap."""

Screen = Callable[["LargeTcpConnection", IncomingMessage], "Message | None"]
"""``screen(connection, request_head) -> refusal``: a server's check of a request before its payload is stored."""

Trust = Callable[[PeerIdentity], bool]
"""``trust(identity) -> bool``: whether a TLS peer's verified identity counts as a cluster member."""

Settle = Callable[["Message | Response | Exception"], None]
"""``settle(outcome)``: what becomes of a fast-path request: its response (a plain one read without aiocoap,
:mod:`~edgert.transport.incoming`), or the network error that ended it."""


class LargeTcpConnection(TcpConnection, asyncio.BufferedProtocol):
    """One RFC 8323 connection with a configurable Max-Message-Size and a linear receive path.

    As a :class:`asyncio.BufferedProtocol` it receives a large payload straight into
    the payload's own buffer (``recv_into``); heads and small frames land in a reused
    scratch buffer (:class:`~edgert.transport.frame_reader.FrameReader`).
    """

    def __init__(self, ctx, log, loop, *, is_server: bool, max_message_size: int,
                 fast_server: FastServer | None = None, screen: Screen | None = None,
                 guard: ConnectionGuard | None = None, trust: Trust | None = None) -> None:
        super().__init__(ctx, log, loop, is_server=is_server)
        self._my_max_message_size = max_message_size
        self._fast_server = fast_server
        self._screen = screen
        self._guard = guard
        self._trust = trust
        self._pending: dict[bytes, Settle] = {}
        self.reader = FrameReader(self)
        self.csm_received: asyncio.Future = loop.create_future()
        self.peer: PeerIdentity | None = None  # the verified certificate's identity (TLS only)
        self.verified = False
        """Whether the peer presented a cluster credential this side trusts (TLS only; a client trusts the chain)."""
        self.last_heard = loop.time()
        """Loop time of the last byte received."""
        self.pinged_at = 0.0
        """Loop time of the last Ping sent for silence (see :class:`~edgert.transport.guard.ConnectionGuard`)."""
        self._tls = False
        self._write_lock = threading.Lock()  # held by every write: the loop's and other threads'
        self._socket: socket.socket | None = None  # a duplicate of the plaintext socket, for write_from_thread
        self._handoff: list[bytes | memoryview] | None = None  # what the loop must write before anything else

    def connection_made(self, transport) -> None:
        self.peer = peer_identity(transport)
        self._tls = transport.get_extra_info("ssl_object") is not None
        raw = transport.get_extra_info("socket")
        if not self._tls and not self._local_is_server and raw is not None:  # requests leave from clients only
            self._socket = raw.dup()  # the same stream (a duplicate descriptor), usable outside asyncio
            self._socket.setblocking(False)
        self.verified = self.peer is not None and (self._trust is None or self._trust(self.peer))
        self.reader.trusted = self.verified
        refusal = None
        if self._guard is not None:
            refusal = self._guard.admit(self)
            if refusal is None and not self.verified:
                self.reader.budget = self._guard.budget
        if self._local_is_server and refusal is None:
            self._ctx._pool.add(self)
        super().connection_made(transport)  # sends our CSM
        if refusal is not None:
            self.log.info("refused a connection from %s: %s", self.hostinfo, refusal)
            self.abort(refusal)

    def _abort_with(self, abort_msg: Message) -> None:
        """Send Abort if the connection can still carry it, and close; never raises."""
        if self._transport is None:
            super()._abort_with(abort_msg)  # aiocoap poisons a connection that never started
            return
        if not self._transport.is_closing():
            self._send_message(abort_msg)
        self._transport.close()

    # -- what the frame reader needs ------------------------------------------------------

    @property
    def max_message_size(self) -> int:
        """The Max-Message-Size this side announced."""
        return self._my_max_message_size

    @property
    def csm_seen(self) -> bool:
        """Whether the peer's CSM arrived."""
        return self._remote_settings is not None

    @property
    def mid_frame(self) -> bool:
        """Whether the peer owes bytes: its CSM, or the rest of a frame it began."""
        return self._remote_settings is None or self.reader.mid_frame

    def screen(self, request: Message | IncomingMessage) -> Message | None:
        """The server's refusal of ``request`` from its head (None: receive the payload)."""
        if self._screen is None:
            return None
        return self._screen(self, request if isinstance(request, IncomingMessage) else IncomingMessage.of(request))

    def send_signal(self, message: Message) -> None:
        """Send ``message`` now if the connection is open (refusals, Ping, fast-path responses); a message
        larger than the peer takes (a diagnostic: larger successes go blockwise) is cut to fit."""
        if self.is_open:
            if not self.fits(message):
                message.payload = bytes(message.payload[:self.maximum_payload_size])
            self._send_message(message)

    def send_frame(self, code: int, token: bytes, options: bytes, payload: Buffer | Sequence[Buffer]) -> None:
        """Send a message whose ``options`` are already encoded now, if the connection is open (the server's
        fast-path responses; ``payload``, one buffer or consecutive parts, must fit the peer's
        Max-Message-Size)."""
        if self.is_open:
            parts = tuple(payload) if isinstance(payload, (list, tuple)) else ((payload,) if payload else ())
            size = sum(map(len, parts))
            self._write_frame(frame_head(code, token, options, size), parts, size)

    # -- the peer's limits ------------------------------------------------------------------

    @property
    def peer_max_message_size(self) -> int:
        """The Max-Message-Size the peer announced in its CSM (1152 before it arrived)."""
        return (self._remote_settings or {}).get("max-message-size", 1152)

    @property
    def maximum_payload_size(self) -> int:
        """The largest payload sent unsplit to this peer (aiocoap's blockwise reads it)."""
        return max(16, self.peer_max_message_size - BLOCK_HEAD_ROOM)

    @property
    def maximum_block_size_exp(self) -> int:
        """SZX of the blocks sent to this peer: BERT (7) if it takes it, else the largest block that fits."""
        room = self.maximum_payload_size
        if room >= 1024:
            bert = self.peer_max_message_size > 1152 and (self._remote_settings or {}).get("block-wise-transfer")
            return 7 if bert else 6
        return max(0, room.bit_length() - 5)  # 16 << szx <= room

    def fits(self, message: Message) -> bool:
        """Whether ``message`` travels as one message to this peer (by its Max-Message-Size, BERT or not)."""
        size = len(message.payload)
        if size <= self.maximum_payload_size:
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

    async def request(self, message: Message, parts: Sequence[Buffer] | None = None) -> Message | Response:
        """Fast path: send ``message`` (a request fitting the peer's Max-Message-Size) and await its response.

        ``parts``, if given, is the payload in pieces (see :meth:`_send_message`).
        """
        token = message.token = fast_token()
        future = self.loop.create_future()
        self._pending[token] = functools.partial(_settle_future, future)
        try:
            self._send_message(message, parts)
            return await future
        finally:
            self._pending.pop(token, None)

    def send_request(self, token: bytes, head: bytes, parts: Sequence[Buffer], settle: Settle) -> None:
        """Fast path without a future (loop thread only): write a request frame whose ``head`` (with
        ``token``, from :func:`fast_token`) was built elsewhere; ``settle`` gets its response or the
        connection's loss. Raises :class:`aiocoap.error.NetworkError` if the connection is closed."""
        self._write_frame(head, parts, sum(map(len, parts)))
        self._pending[token] = settle  # the response is parsed on this loop: it cannot come before this

    def write_from_thread(self, token: bytes, head: bytes, parts: Sequence[Buffer], settle: Settle) -> bool:
        """:meth:`send_request` from any thread, without waking the loop: the frame goes to the socket now.

        False (nothing written, nothing registered): the loop must write it (TLS, a large frame, a
        closing connection, bytes already queued). A frame the socket takes only in part is finished
        by the loop before any other write.
        """
        size = len(head) + sum(map(len, parts))
        if self._socket is None or size > THREAD_WRITE_BYTES:
            return False
        with self._write_lock:
            transport = self._transport
            if (transport is None or transport.is_closing() or self._socket is None or self._handoff is not None
                    or transport.get_write_buffer_size()):
                return False
            data = b"".join((head, *parts))
            self._pending[token] = settle  # before the write: the response may be parsed at once
            try:
                sent = self._socket.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._pending.pop(token, None)
                return False  # the loop's own write meets the error and closes the connection
            if sent < len(data):
                self._handoff = [memoryview(data)[sent:]]
                self.loop.call_soon_threadsafe(self._write_handoff)
        return True

    def awaits(self, token: bytes) -> bool:
        """Whether the response to ``token`` is still awaited (loop thread)."""
        return token in self._pending

    def forget_request(self, token: bytes) -> None:
        """Stop waiting for the response to ``token`` (its sender gave up)."""
        self._pending.pop(token, None)

    # -- sending ---------------------------------------------------------

    def _send_message(self, msg: Message, parts: Sequence[Buffer] | None = None) -> None:
        """Write ``msg`` as one frame; ``parts`` (1-D byte buffers), if given, replace ``msg.payload``.

        Small pieces are joined; each large one is written by reference, so the only
        copy is the socket's (or asyncio's write buffer's, for what the socket does not take at once).
        """
        if parts is None:
            parts = (msg.payload,) if msg.payload else ()
        size = sum(map(len, parts))
        self._write_frame(serialize_head(msg, size), parts, size)

    def _write_frame(self, head: bytes, parts: Sequence[Buffer], size: int) -> None:
        """Write a frame's ``head`` and payload ``parts``; raises NetworkError if the connection is closed."""
        if self._transport is None or self._transport.is_closing():
            raise coap_error.NetworkError(f"connection to {self.hostinfo} is closed")
        with self._write_lock:
            if self._handoff is not None:  # the rest of a frame written from a thread goes first
                self._handoff.append(b"".join((head, *parts)))
                return
            self._write_pieces(head, parts, size)

    def _write_handoff(self) -> None:
        """Write what a thread's partial write left, and the frames queued behind it (loop thread)."""
        with self._write_lock:
            handoff, self._handoff = self._handoff, None
            if handoff and self._transport is not None and not self._transport.is_closing():
                for piece in handoff:
                    self._transport.write(piece)

    def _write_pieces(self, head: bytes, parts: Sequence[Buffer], size: int) -> None:
        write = self._transport.write
        if size < _SPLIT_WRITE:
            write(b"".join((head, *parts)))
            return
        small: list[Buffer] = [head]
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
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_heard = self.loop.time()
        self.reader.buffer_updated(nbytes)

    def data_received(self, data: bytes | memoryview) -> None:
        self.last_heard = self.loop.time()
        self.reader.feed(data)

    def deliver(self, msg: Message | IncomingMessage) -> bool:
        """Hand one complete message to signalling, a waiting request, the server's fast path or aiocoap (the
        token manager); False if the connection ended."""
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
            settle = self._pending.pop(msg.token, None)
            if settle is not None:
                settle(msg.response() if isinstance(msg, IncomingMessage) else msg)
                return True
        elif self._fast_server is not None and self._fast_server(self, msg):
            return True
        if isinstance(msg, IncomingMessage):
            msg = msg.to_message()
        try:
            self._ctx._dispatch_incoming(self, msg)
        except AttributeError:  # the context was shut down under this connection: nobody is listening
            return False
        return True

    def connection_lost(self, exc) -> None:
        with self._write_lock:
            duplicate, self._socket = self._socket, None
            self._handoff = None
        if duplicate is not None:
            duplicate.close()
        pending, self._pending = self._pending, {}
        for settle in pending.values():
            settle(coap_error.NetworkError(f"connection to {self.hostinfo} lost: {exc}"))
        if not self.csm_received.done():
            self.csm_received.set_exception(coap_error.NetworkError(f"connection lost before CSM: {exc}"))
            self.csm_received.exception()  # mark retrieved
        self.reader.close()  # the buffers go now, whoever still refers to this connection
        if self._guard is not None:
            self._guard.forget(self)
        if self._ctx is not None:
            super().connection_lost(exc)


def _settle_future(future: asyncio.Future, outcome: Message | Response | Exception) -> None:
    if future.done():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
