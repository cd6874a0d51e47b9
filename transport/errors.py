"""Transport errors; each response error knows the CoAP response code it travels as.

Servers raise them (or the transport raises them while decoding) and the client
re-raises the matching class from an error response, so ``except NotFound`` works
on both sides of the wire. The diagnostic text is the response payload
(RFC 7252 section 5.5.2: UTF-8, no Content-Format).
"""

from __future__ import annotations

from typing import ClassVar

from aiocoap import Message
from aiocoap.error import NetworkError, RenderableError
from aiocoap.numbers.codes import Code

from edgert.errors import EdgertError


class TransportError(EdgertError):
    """Base of every error the transport raises."""


class ResponseError(TransportError, RenderableError):
    """An error that is (or was) a CoAP error response: ``code`` plus a diagnostic text."""

    code: ClassVar[Code] = Code.INTERNAL_SERVER_ERROR

    def __init__(self, diagnostic: str = "", *, code: Code | None = None) -> None:
        super().__init__(diagnostic)
        self.diagnostic = diagnostic
        if code is not None:
            self.code = code  # type: ignore[misc]  (instance override for codes without a class)

    def __str__(self) -> str:
        return f"{self.code.dotted} {self.code.name_printable}: {self.diagnostic}"

    def to_message(self) -> Message:
        """The CoAP response this error is sent as."""
        return Message(code=self.code, payload=self.diagnostic.encode("utf-8", "replace")[:1024])


class BadRequest(ResponseError):
    """4.00: the request is malformed (bad CBOR, wrong tags, truncated or inconsistent envelope)."""

    code = Code.BAD_REQUEST


class MalformedMessage(BadRequest):
    """4.00: the payload is not a valid edgert message (raised by the decoders)."""


class Unauthorized(ResponseError):
    """4.01: the peer is not authenticated (no cluster credential, or a revoked one)."""

    code = Code.UNAUTHORIZED

    def to_message(self) -> Message:
        """The 4.01 with Max-Age 0: a refusal is not to be cached (RFC 8613 section 8.2 for OSCORE)."""
        message = super().to_message()
        message.opt.max_age = 0
        return message


class OscoreRefused(Unauthorized):
    """4.01: an OSCORE request that does not verify or comes from no live enrolment; the diagnostic says why."""


class Forbidden(ResponseError):
    """4.03: the peer is known but may not do this (wrong role, unsigned manifest, forbidden op domain)."""

    code = Code.FORBIDDEN


class NotFound(ResponseError):
    """4.04: no resource at that path."""

    code = Code.NOT_FOUND


class MethodNotAllowed(ResponseError):
    """4.05: the resource exists but does not take that method."""

    code = Code.METHOD_NOT_ALLOWED


class Incomplete(ResponseError):
    """4.08: a piece of a body out of order, or of a transfer the server no longer has (docs/PROTOCOL.md §12)."""

    code = Code.REQUEST_ENTITY_INCOMPLETE


class TooLarge(ResponseError):
    """4.13: the payload or one of its parts exceeds a declared limit; ``size1`` is the limit in bytes."""

    code = Code.REQUEST_ENTITY_TOO_LARGE

    def __init__(self, diagnostic: str = "", *, size1: int | None = None) -> None:
        super().__init__(diagnostic)
        self.size1 = size1

    def to_message(self) -> Message:
        message = super().to_message()
        if self.size1 is not None:
            message.opt.size1 = self.size1
        return message


class UnsupportedContentFormat(ResponseError):
    """4.15: the Content-Format (or a tensor codec inside the envelope) is not supported here."""

    code = Code.UNSUPPORTED_CONTENT_FORMAT


class UnsupportedCodec(UnsupportedContentFormat):
    """4.15: the envelope names a codec this endpoint does not decode."""


class InternalServerError(ResponseError):
    """5.00: the handler failed; the diagnostic names the exception."""

    code = Code.INTERNAL_SERVER_ERROR


class ServiceUnavailable(ResponseError):
    """5.03: the server is busy or shutting down; clients retry these."""

    code = Code.SERVICE_UNAVAILABLE


RETRIED_CODES = (Code.SERVICE_UNAVAILABLE,)
"""Response codes a client retries like a timeout."""


class InvalidUrl(TransportError, ValueError):
    """A URL that is not ``coap+tcp://``, ``coaps+tcp://`` or ``coap://host:port`` (see urls.py)."""


class RequestTimeout(TransportError):
    """No response arrived within the timeout, after all retries."""


class PeerUnreachable(TransportError):
    """The peer could not be reached (connection refused, reset or closed), after all retries."""


class OscoreUnverified(TransportError, NetworkError):
    """A response to an OSCORE request that does not verify (forged or damaged): aiocoap treats it as lost,
    the client as an unreachable peer."""


class CredentialError(EdgertError):
    """A credential file is missing, unreadable, malformed or not a cluster credential.

    Not a :class:`TransportError`: a caller that treats those as an unreachable peer must not take a
    broken credential of its own for one."""


_BY_CODE: dict[Code, type[ResponseError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        MethodNotAllowed,
        Incomplete,
        TooLarge,
        UnsupportedContentFormat,
        InternalServerError,
        ServiceUnavailable,
    )
}


def error_from_response(code: Code | int, payload: bytes | bytearray, size1: int | None = None) -> ResponseError:
    """The :class:`ResponseError` subclass for an error response (generic class for unmapped codes)."""
    code = Code(code)
    diagnostic = bytes(payload[:1024]).decode("utf-8", "replace")
    cls = _BY_CODE.get(code)
    if cls is TooLarge:
        return TooLarge(diagnostic, size1=size1)
    if cls is None:
        return ResponseError(diagnostic, code=code)
    return cls(diagnostic)
