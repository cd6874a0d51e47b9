"""One served path: the checks every request to it passes, from its head to its payload, then its handler.

An :class:`Endpoint` belongs to a :class:`~edgert.transport.server.TensorServer`: method
(4.05), role (4.03) and Content-Format (4.15) from the head (:meth:`Endpoint.check_head`,
also used before a TCP payload is received), then size (4.13) and envelope (4.00), then the
handler, whose exceptions become 5.00. Block1 uploads are reassembled linearly and capped.

A handler is a coroutine function or a plain function. A plain one is answered without a task: over
TCP its response is written from the protocol callback that parsed the request (the tensor path's
receive, :meth:`Endpoint.start`), so it must not block.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiocoap import Message, resource
from aiocoap.blockwise import Block1Spool
from aiocoap.numbers.codes import Code

from edgert.transport import linkformat
from edgert.transport.coap_tcp import LargeTcpConnection
from edgert.transport.envelope import (
    CONTENT_FORMAT,
    Envelope,
    decode_envelope,
    encode_envelope_parts,
)
from edgert.transport.errors import (
    BadRequest,
    Forbidden,
    InternalServerError,
    MethodNotAllowed,
    ResponseError,
    TooLarge,
    UnsupportedContentFormat,
)
from edgert.transport.incoming import IncomingMessage
from edgert.transport.message import TEXT, Request, Response
from edgert.transport.oscore import OscoreAddress
from edgert.transport.pieces import PIECE_BYTES, PIECE_KIND, read_piece, stream_limits
from edgert.transport.tls import PeerIdentity

if TYPE_CHECKING:
    from edgert.transport.server import TensorServer
    from edgert.transport.transfers import Admission

log = logging.getLogger("edgert.transport.server")

HandlerResult = Response | Envelope | bytes | bytearray | str | None
Handler = Callable[[Request], Awaitable[HandlerResult] | HandlerResult]

Answer = Response | Message
"""What a request gets: a handler's result as a :class:`Response` (over TCP written without aiocoap's
message), or a refusal as the message its :class:`ResponseError` builds (its options exactly: Max-Age 0 on
a 4.01, Size1 on a 4.13)."""


class CappedBlock1Spool(Block1Spool):
    """aiocoap's Block1 reassembly, linear in time, refusing (4.13) transfers over the payload limit."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def feed_and_take(self, req: Message) -> Message:
        block1 = req.opt.block1
        if block1 is not None:
            announced = req.opt.size1
            if announced is not None and announced > self.limit:
                raise TooLarge(f"announced payload of {announced} bytes exceeds {self.limit}", size1=self.limit)
            if block1.start + len(req.payload) > self.limit:
                raise TooLarge(f"blockwise payload exceeds {self.limit} bytes", size1=self.limit)
            if block1.block_number == 0 and block1.more:
                # aiocoap appends each block with `payload += block`: on bytes that is quadratic
                req.payload = bytearray(req.payload)
        return super().feed_and_take(req)


class Endpoint(resource.Resource):
    """One path: checks method, size, Content-Format and envelope, then calls the handler."""

    def __init__(self, server: TensorServer, path: str, handlers: dict[str, Handler], *, rt: str | None,
                 envelope: bool, kinds: tuple[str, ...] | None, title: str | None,
                 roles: dict[str, tuple[str, ...]] | None, pieces: Admission | None = None,
                 piece_answers: bool = False) -> None:
        super().__init__()
        self.server = server
        self.path = path.strip("/")
        self.handlers = handlers
        self.rt = rt
        self.envelope = envelope
        self.kinds = kinds
        self.title = title
        self.roles = roles
        self.pieces = pieces  # admits a request body in pieces (None: this path takes none)
        self.piece_answers = piece_answers  # answers an envelope over a piece in pieces
        self._block1 = CappedBlock1Spool(server.limits.max_payload_bytes)

    def link(self) -> linkformat.Link:
        """This resource's link-format entry."""
        attrs: list[tuple[str, str | None]] = []
        if self.rt:
            attrs.append(("rt", self.rt))
        if self.envelope:
            attrs.append(("ct", str(CONTENT_FORMAT)))
        if isinstance(self, ObservableEndpoint):
            attrs.append(("obs", None))
        if self.title:
            attrs.append(("title", self.title))
        return linkformat.Link("/" + self.path, tuple(attrs))

    async def render(self, message: Message) -> Message:
        """Answer one (reassembled) request that aiocoap parsed; never raises."""
        answer = self.start(IncomingMessage.of(message))
        if not isinstance(answer, (Response, Message)):
            answer = await answer
        return answer.to_message() if isinstance(answer, Response) else answer

    def start(self, incoming: IncomingMessage) -> Answer | Awaitable[Answer]:
        """Check ``incoming`` and call its handler: the response, or (the handler is a coroutine) an
        awaitable of it. Never raises: a refusal or a handler's exception is the response. A piece of a
        body (transport/pieces.py) that is not its last is answered 2.31 Continue without the handler."""
        request = None
        try:
            request = self._request(incoming)
            if request is None:
                return Response(Code.CONTINUE)
            result = self.handlers[request.method](request)
        except Exception as error:  # noqa: BLE001  (see _failure)
            return self._failure(incoming, error, request)
        if inspect.isawaitable(result):
            return self._finish(incoming, request, result)
        return self._respond(incoming, request, result)

    async def _finish(self, incoming: IncomingMessage, request: Request,
                      result: Awaitable[HandlerResult]) -> Answer:
        try:
            result = await result
        except Exception as error:  # noqa: BLE001  (see _failure)
            return self._failure(incoming, error, request)
        return self._respond(incoming, request, result)

    def _respond(self, incoming: IncomingMessage, request: Request, result: HandlerResult) -> Answer:
        try:
            response = self._response(result, incoming.code, request)
            if request.sink is not None:
                request.sink.commit()  # the handler took the body: a file stays where it was written
            return response
        except Exception as error:  # noqa: BLE001  (see _failure)
            return self._failure(incoming, error, request)

    def _failure(self, incoming: IncomingMessage, error: Exception, request: Request | None = None) -> Message:
        """A refusal's own code, or 5.00 for anything else: a handler bug must not kill the server. A body
        that came in pieces is dropped (a file written for it is removed)."""
        if request is not None and request.sink is not None:
            request.sink.abort()
        method = incoming.code
        if isinstance(error, ResponseError):
            log.info("%s /%s from %s: %s", method.name, self.path, incoming.peer_name, error)
            return error.to_message()
        log.error("handler for %s /%s failed", method.name, self.path, exc_info=error)
        return InternalServerError(f"handler failed: {type(error).__name__}: {error}").to_message()

    def check_head(self, incoming: IncomingMessage) -> PeerIdentity | None:
        """Method (4.05), role (4.03) and Content-Format (4.15) of a request; returns the peer's identity.

        Needs no payload: TCP requests are checked this way before their payload is received.
        """
        method = incoming.code
        if not method.is_request() or method.name not in self.handlers:
            allowed = ", ".join(sorted(self.handlers))
            raise MethodNotAllowed(f"{method.name if method.is_request() else method.dotted} is not allowed on "
                                   f"/{self.path} (allowed: {allowed})")
        peer = _identity(incoming.remote)
        allowed = None if self.roles is None or peer is None else self.roles.get(method.name)
        if allowed is not None and peer.role not in allowed:
            raise Forbidden(f"{peer} may not {method.name} /{self.path} (allowed: {', '.join(allowed)})")
        content_format = incoming.content_format
        if self.envelope and content_format not in (None, CONTENT_FORMAT):
            raise UnsupportedContentFormat(
                f"/{self.path} takes Content-Format {CONTENT_FORMAT} (application/cbor envelope), "
                f"got {content_format}")
        return peer

    def _request(self, incoming: IncomingMessage) -> Request | None:
        """The request to hand to the handler; None for a piece of a body that is not its last."""
        peer = self.check_head(incoming)
        method = incoming.code
        limits = self.server.limits
        payload = incoming.payload
        if len(payload) > limits.max_payload_bytes:
            raise TooLarge(f"payload of {len(payload)} bytes exceeds {limits.max_payload_bytes}",
                           size1=limits.max_payload_bytes)
        if payload and method == Code.GET:  # refused, not ignored: the sender meant something by it
            raise BadRequest(f"GET /{self.path} takes no payload; got {len(payload)} bytes")
        request = Request(method=method.name, path=self.path, payload=payload,
                          content_format=incoming.content_format, query=_query(incoming.query),
                          peer=incoming.peer_name, identity=peer)
        if self.envelope:
            if payload:
                request.envelope = decode_envelope(payload, limits)
                if request.envelope.kind == PIECE_KIND:
                    return self._piece(request)
                if self.kinds is not None and request.envelope.kind not in self.kinds:
                    raise BadRequest(f"/{self.path} takes envelope kind(s) {', '.join(self.kinds)}, "
                                     f"got {request.envelope.kind!r}")
            elif method.name in ("POST", "PUT", "FETCH"):
                raise BadRequest(f"{method.name} /{self.path} needs an envelope payload")
        return request

    def _piece(self, request: Request) -> Request | None:
        """Take a piece of a body pushed to this path; once the body is whole and verified, the request it
        makes (decoded, its kind checked), else None."""
        if self.pieces is None:
            raise BadRequest(f"{request.method} /{self.path} takes no body in pieces")
        try:
            piece = read_piece(request.envelope)
            if self.kinds is not None and piece.of not in self.kinds:
                raise BadRequest(f"/{self.path} takes envelope kind(s) {', '.join(self.kinds)}, "
                                 f"got pieces of {piece.of!r}")
        except ResponseError:  # a bad piece ends the transfer it names
            self.server.transfers.drop(request.sender, request.envelope.meta.get("transfer"))
            raise
        incoming = self.server.transfers.receive(request.sender, piece, lambda first: self.pieces(request, first))
        if incoming is None:
            return None
        body = incoming.sink.finish()
        request.sink = incoming.sink
        try:
            envelope = decode_envelope(body, stream_limits(len(body), self.server.limits))
            if envelope.kind != piece.of:
                raise BadRequest(f"the body in pieces is a {envelope.kind!r} envelope, its pieces said {piece.of!r}")
        except Exception:
            incoming.sink.abort()
            raise
        request.payload, request.envelope, request.stored = body, envelope, incoming.sink.path
        return request

    def _response(self, result: HandlerResult, method: Code, request: Request | None = None) -> Response:
        default = Code.CONTENT if method in (Code.GET, Code.FETCH) else (
            Code.DELETED if method == Code.DELETE else Code.CHANGED)
        if isinstance(result, Response):
            return result
        if isinstance(result, Envelope):
            parts = encode_envelope_parts(result)
            if self.piece_answers and request is not None and sum(map(len, parts)) > PIECE_BYTES:
                first = self.server.transfers.answer(request.sender, result, parts)
                return Response(default, content_format=CONTENT_FORMAT, parts=tuple(encode_envelope_parts(first)))
            return Response(default, b"".join(parts), CONTENT_FORMAT)
        if result is None:
            return Response(default)
        if isinstance(result, (bytes, bytearray, memoryview)):
            return Response(default, bytes(result) if isinstance(result, memoryview) else result)
        if isinstance(result, str):
            return Response(default, result.encode(), TEXT)
        raise TypeError(f"handler returned {type(result).__name__}; expected Response, Envelope, bytes, str or None")


class ObservableEndpoint(Endpoint, resource.ObservableResource):
    """An :class:`Endpoint` that accepts RFC 7641 observations on GET."""


def _identity(remote: Any) -> PeerIdentity | None:
    """Who sent a request, as TLS or OSCORE authenticated it (None: nobody or plaintext)."""
    return remote.peer if isinstance(remote, (LargeTcpConnection, OscoreAddress)) else None


def _query(items: tuple[str, ...]) -> dict[str, str]:
    result = {}
    for item in items:
        key, _, value = item.partition("=")
        result[key] = value
    return result
