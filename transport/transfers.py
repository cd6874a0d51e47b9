"""Moving bodies in pieces (transport/pieces.py): what a server holds of them, and a client's send and fetch.

:class:`Transfers` is a server's: the bodies it is receiving (pushed in pieces to a resource that takes
them) and answering (a response too large for one piece, fetched piece by piece from ``FETCH /piece``),
at most :attr:`Limits.max_transfers` of each at once, each dropped with what it held after
:attr:`Limits.frame_timeout` seconds without a piece (an abandoned transfer). A peer reaches only its own
transfers (keyed by its credential's name, or on plaintext by its address).

:func:`request_in_pieces` is the client's: it sends an envelope larger than a piece as pieces, with
:data:`IN_FLIGHT` on the way, and fetches a response that comes in pieces the same way, into memory
or a file, never taking more than the request's ``max_body``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiocoap.numbers.codes import Code

from edgert.transport.envelope import CONTENT_FORMAT, Envelope, encode_envelope_parts
from edgert.transport.errors import Incomplete, MalformedMessage, ResponseError, ServiceUnavailable, TooLarge
from edgert.transport.limits import Limits
from edgert.transport.message import Response
from edgert.transport.pieces import (
    IN_FLIGHT,
    PIECE_BYTES,
    PIECE_KIND,
    PIECE_PATH,
    Incoming,
    MemorySink,
    Outgoing,
    Piece,
    Sink,
    new_transfer_id,
    piece_envelope,
    piece_request,
    read_piece,
    stream_limits,
)

if TYPE_CHECKING:
    from edgert.transport.client import TensorClient

Admission = Callable[[Any, Piece], Sink]
"""A resource's admission of a body in pieces: given the request that brought the first piece (who sent it)
and that piece (the body's header and declared size), where the body goes, or a :class:`ResponseError`
refusing it."""


@dataclass(frozen=True)
class PieceOptions:
    """How one request moves a large body: a request envelope over ``piece_bytes`` goes in pieces, and a
    response in pieces is taken up to ``max_body`` bytes into ``sink(size)`` (default: memory)."""

    max_body: int
    sink: Callable[[int], Sink] | None = None
    piece_bytes: int = PIECE_BYTES


class Transfers:
    """The bodies a server is receiving and answering in pieces, bounded in number and in idle time."""

    def __init__(self, limits: Limits):
        self._limits = limits
        self._incoming: dict[tuple[str, int], tuple[Incoming, asyncio.TimerHandle | None]] = {}
        self._outgoing: dict[tuple[str, int], tuple[Outgoing, Envelope, asyncio.TimerHandle | None]] = {}

    @property
    def receiving(self) -> int:
        return len(self._incoming)

    @property
    def answering(self) -> int:
        return len(self._outgoing)

    # -- bodies arriving -----------------------------------------------------------------------------

    def receive(self, peer: str, piece: Piece, admit: Callable[[Piece], Sink]) -> Incoming | None:
        """Take ``piece`` of a body ``peer`` pushes: the transfer once its body is complete and verified (its
        sink finished: commit or abort it), else None. A refused piece ends its transfer (nothing kept)."""
        key = (peer, piece.transfer)
        entry = self._incoming.get(key)
        if entry is None:
            if piece.offset != 0:
                raise Incomplete(f"no transfer {piece.transfer} of yours is arriving here (it ended, or was "
                                 f"dropped after {self._limits.frame_timeout:g} s without a piece): send the "
                                 f"body again from its first piece")
            if len(self._incoming) >= self._limits.max_transfers:
                raise ServiceUnavailable(f"busy: {len(self._incoming)} bodies are arriving in pieces already; "
                                         f"retry")
            incoming = Incoming(piece.transfer, piece.size, piece.of, admit(piece))
        else:
            incoming = entry[0]
            _cancel(entry[1])
        self._incoming[key] = (incoming, None)
        try:
            done = incoming.accept(piece)
        except BaseException:
            self._drop_incoming(key)
            raise
        if done:
            del self._incoming[key]
            return incoming
        self._incoming[key] = (incoming, _timer(self._limits.frame_timeout, self._drop_incoming, key))
        return None

    def drop(self, peer: str, transfer: Any) -> None:
        """End ``peer``'s transfer ``transfer`` arriving here, if there is one (one of its pieces was refused)."""
        if isinstance(transfer, int):
            self._drop_incoming((peer, transfer))

    def _drop_incoming(self, key: tuple[str, int]) -> None:
        entry = self._incoming.pop(key, None)
        if entry is not None:
            _cancel(entry[1])
            entry[0].sink.abort()

    # -- bodies answered -----------------------------------------------------------------------------

    def answer(self, peer: str, body: Envelope, parts: list, piece_bytes: int = PIECE_BYTES) -> Envelope:
        """Answer ``body`` (encoded as ``parts``) in pieces to ``peer``: its first piece; the rest wait for
        ``FETCH /piece``."""
        if len(self._outgoing) >= self._limits.max_transfers:
            raise ServiceUnavailable(f"busy: {len(self._outgoing)} bodies are being fetched in pieces already; "
                                     f"retry")
        transfer = new_transfer_id()
        self._outgoing[(peer, transfer)] = (Outgoing(parts, piece_bytes), body, None)
        return self.next_piece(peer, transfer, 0)

    def next_piece(self, peer: str, transfer: int, offset: int) -> Envelope:
        """The piece of ``peer``'s transfer at ``offset`` (the next, or the last again)."""
        key = (peer, transfer)
        entry = self._outgoing.get(key)
        if entry is None:
            raise Incomplete(f"no transfer {transfer} of yours is being answered here (it ended, or was dropped "
                             f"after {self._limits.frame_timeout:g} s without a request): ask for the body again")
        outgoing, body, timer = entry
        _cancel(timer)
        try:
            data, digest = outgoing.piece(offset)
        except BaseException:
            self._drop_outgoing(key)
            raise
        piece = piece_envelope(body, transfer, offset, outgoing.size, data, digest)
        if digest is not None:  # the last piece: the transfer is over
            del self._outgoing[key]
        else:
            self._outgoing[key] = (outgoing, body, _timer(self._limits.frame_timeout, self._drop_outgoing, key))
        return piece

    def _drop_outgoing(self, key: tuple[str, int]) -> None:
        entry = self._outgoing.pop(key, None)
        if entry is not None:
            _cancel(entry[2])

    def close(self) -> None:
        """Drop every transfer (the server stops)."""
        for key in list(self._incoming):
            self._drop_incoming(key)
        for key in list(self._outgoing):
            self._drop_outgoing(key)


def _timer(seconds: float, callback: Callable[[Any], None], key: Any) -> asyncio.TimerHandle | None:
    try:
        return asyncio.get_running_loop().call_later(seconds, callback, key)
    except RuntimeError:  # no loop (a unit test feeding pieces by hand): nothing expires
        return None


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


# -- the client's side --------------------------------------------------------------------------------


async def request_in_pieces(client: TensorClient, method: str, url: str, path: str, payload: Any,
                            options: PieceOptions, timeout: float, retries: int, raise_for_status: bool,
                            **kwargs: Any) -> Response:
    """:meth:`TensorClient.request` for a body that may be large: ``payload`` (an envelope) in pieces when its
    encoding is over ``options.piece_bytes``, and a response in pieces fetched whole."""
    if isinstance(payload, Envelope):
        parts = encode_envelope_parts(payload)
        if sum(map(len, parts)) > options.piece_bytes:  # (the first answer is handed on, not held here)
            return await _pulled(client, url, await _push(client, method, url, path, payload, parts, options, timeout,
                                                          retries), options, timeout, retries, raise_for_status)
    return await _pulled(client, url, await client.request(method, url, path, payload, timeout=timeout,
                                                           retries=retries, raise_for_status=raise_for_status,
                                                           **kwargs), options, timeout, retries, raise_for_status)


async def _push(client: TensorClient, method: str, url: str, path: str, body: Envelope, parts: list,
                options: PieceOptions, timeout: float, retries: int) -> Response:
    """Send ``body`` in pieces, :data:`IN_FLIGHT` at a time after the first (which the server may refuse
    before the rest is sent); the response to the last."""
    outgoing = Outgoing(parts, options.piece_bytes)
    transfer = new_transfer_id()

    def send(offset: int) -> Any:
        data, digest = outgoing.piece(offset)
        return client.request(method, url, path, piece_envelope(body, transfer, offset, outgoing.size, data, digest),
                              timeout=timeout, retries=retries)

    response = await send(0)
    pending: collections.deque[asyncio.Future] = collections.deque()
    try:
        while outgoing.next_offset < outgoing.size:
            _continued(response, url, path)
            if len(pending) >= IN_FLIGHT:
                response = await pending.popleft()
                continue
            pending.append(asyncio.ensure_future(send(outgoing.next_offset)))
        while pending:
            _continued(response, url, path)
            response = await pending.popleft()
    finally:
        for future in pending:
            future.cancel()
    return response


def _continued(response: Response, url: str, path: str) -> None:
    if response.code != Code.CONTINUE:
        raise MalformedMessage(f"{url}/{path}: answered {response.code.dotted} to a piece that was not the last "
                               f"(expected 2.31 Continue)")


async def _pulled(client: TensorClient, url: str, response: Response, options: PieceOptions, timeout: float,
                  retries: int, raise_for_status: bool) -> Response:
    """``response``, or (it is the first piece of a body) the whole body fetched from ``FETCH /piece``; either
    way in ``options.sink`` when one is given (a file, say)."""
    if not response.ok or response.content_format != CONTENT_FORMAT or not response.payload:
        return response
    envelope = response.envelope(client.limits)
    if envelope.kind != PIECE_KIND:
        if options.sink is None:
            return response
        sink = options.sink(len(response.payload))  # a body that came whole goes where its pieces would have
        sink.write(0, memoryview(response.payload))
        body = sink.finish()
        sink.commit()
        return Response(response.code, body, CONTENT_FORMAT, stored=getattr(sink, "path", None))
    first = _piece(envelope, url)
    if first.offset != 0:
        raise MalformedMessage(f"{url}: a body in pieces began at byte {first.offset}, not 0")
    if first.size > options.max_body:
        raise TooLarge(f"{url}: the response is a body of {first.size} bytes; this request takes at most "
                       f"{options.max_body}", size1=options.max_body)
    transfer, size, step = first.transfer, first.size, len(first.data)
    sink = (options.sink or MemorySink)(size)
    incoming = Incoming(transfer, size, first.of, sink)
    pending: collections.deque[asyncio.Future] = collections.deque()

    async def fetch(offset: int) -> Piece:
        piece = await client.request("FETCH", url, PIECE_PATH, piece_request(transfer, offset),
                                     timeout=timeout, retries=retries)
        return _piece(piece.envelope(client.limits), url)

    try:
        done = _accept(incoming, first, url)
        code = response.code
        del first, envelope, response  # the first piece is in the sink: its message goes
        for offset in range(step, size, step) if not done else ():
            if len(pending) >= IN_FLIGHT:
                done = _accept(incoming, await pending.popleft(), url)
            pending.append(asyncio.ensure_future(fetch(offset)))
        while pending:
            done = _accept(incoming, await pending.popleft(), url)
        if not done:
            raise MalformedMessage(f"{url}: the body in pieces ended at byte {incoming.received} of {size}")
        body = sink.finish()
    except BaseException:
        for future in pending:
            future.cancel()
        sink.abort()
        raise
    sink.commit()
    return Response(code, body, CONTENT_FORMAT, body_limits=stream_limits(size, client.limits),
                    stored=getattr(sink, "path", None))


def _piece(envelope: Envelope, url: str) -> Piece:
    try:
        return read_piece(envelope)
    except ResponseError as error:
        raise MalformedMessage(f"{url}: {error.diagnostic}") from None


def _accept(incoming: Incoming, piece: Piece, url: str) -> bool:
    try:
        return incoming.accept(piece)
    except ResponseError as error:
        raise MalformedMessage(f"{url}: {error.diagnostic}") from None

