"""What handlers receive and what both sides return: :class:`Request` and :class:`Response`.

Thin, typed views over aiocoap messages, so runtime code never touches CoAP options.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiocoap import Message
from aiocoap.numbers.codes import Code

from edgert.transport.codec import Codec
from edgert.transport.envelope import CONTENT_FORMAT, Envelope, decode_envelope, encode_envelope
from edgert.transport.errors import MalformedMessage, ResponseError, error_from_response
from edgert.transport.limits import DEFAULT_LIMITS, Limits
from edgert.transport.tls import PeerIdentity

#: Content-Format of text/plain; charset=utf-8.
TEXT = 0


@dataclass
class Request:
    """One incoming request as a handler sees it; ``envelope`` is set on envelope resources."""

    method: str
    path: str
    payload: bytes | bytearray
    content_format: int | None = None
    query: dict[str, str] = field(default_factory=dict)
    peer: str = ""
    identity: PeerIdentity | None = None
    """The peer's verified identity (TLS only)."""
    envelope: Envelope | None = None
    stored: Path | None = None
    """Where a body that arrived in pieces into a file is (kept there once the handler returns)."""
    sink: Any = None
    """The sink of a body that arrived in pieces: committed once the handler returns, aborted if it raises."""

    @property
    def sender(self) -> str:
        """Who sent it, as a key: the name its credential proves (TLS, OSCORE), else its address."""
        return self.identity.name if self.identity is not None else self.peer


@dataclass
class Response:
    """A response: code, payload and Content-Format (None = no option, e.g. diagnostics)."""

    code: Code = Code.CONTENT
    payload: bytes | bytearray = b""
    content_format: int | None = None
    size1: int | None = None
    body_limits: Limits | None = None
    """Set on a body fetched in pieces (transport/pieces.py): the limits it is decoded with, its size being
    bounded already by the request's ``max_body``."""
    stored: Path | None = None
    """Set on a body fetched in pieces into a file: where it is."""
    parts: tuple | None = None
    """A server's answer written from these consecutive buffers instead of ``payload`` (a piece of a state:
    its data straight from the arrays, transport/pieces.py)."""

    @classmethod
    def of(cls, env: Envelope, codec: str | Codec | None = None, code: Code = Code.CONTENT) -> Response:
        """A response carrying ``env`` (Content-Format 60)."""
        return cls(code=code, payload=encode_envelope(env, codec), content_format=CONTENT_FORMAT)

    @classmethod
    def from_message(cls, message: Message) -> Response:
        """Wrap a received aiocoap message."""
        return cls(code=Code(message.code), payload=message.payload,
                   content_format=message.opt.content_format, size1=message.opt.size1)

    @property
    def options(self) -> bytes:
        """This response's CoAP options as they go on the wire (Content-Format, Size1)."""
        return _encoded_options(self.content_format, self.size1)

    def to_message(self) -> Message:
        """The aiocoap message to send."""
        message = Message(code=self.code, payload=self.payload if self.parts is None else b"".join(self.parts))
        if self.content_format is not None:
            message.opt.content_format = self.content_format
        if self.size1 is not None:
            message.opt.size1 = self.size1
        return message

    @property
    def ok(self) -> bool:
        """True for 2.xx codes."""
        return self.code.is_successful()

    @property
    def text(self) -> str:
        """The payload as UTF-8 text (diagnostics, link format)."""
        return bytes(self.payload).decode("utf-8", "replace")

    def envelope(self, limits: Limits = DEFAULT_LIMITS) -> Envelope:
        """Decode the payload as an envelope (raises on error codes and foreign Content-Formats)."""
        self.raise_for_status()
        if self.content_format not in (None, CONTENT_FORMAT):
            raise MalformedMessage(f"response has Content-Format {self.content_format}, not {CONTENT_FORMAT}")
        return decode_envelope(self.payload, self.body_limits or limits)

    def raise_for_status(self) -> Response:
        """Raise the matching :class:`ResponseError` for a 4.xx/5.xx code; return self otherwise."""
        if not self.code.is_successful():
            raise error_from_response(self.code, self.payload, self.size1)
        return self

    def __repr__(self) -> str:
        return f"<Response {self.code.dotted} {len(self.payload)} bytes cf={self.content_format}>"


@functools.lru_cache(maxsize=64)
def _encoded_options(content_format: int | None, size1: int | None) -> bytes:
    """A response's options as aiocoap encodes them; the same few pairs recur, so each is encoded once."""
    return Response(content_format=content_format, size1=size1).to_message().opt.encode()


def method_code(method: str) -> Code:
    """The CoAP code of a request method's name (``"PUT"``: 0.03)."""
    code = {"GET": Code.GET, "POST": Code.POST, "PUT": Code.PUT, "DELETE": Code.DELETE,
            "FETCH": Code.FETCH}.get(method.upper() if isinstance(method, str) else method)
    if code is None:
        raise ValueError(f"unsupported method {method!r} (GET, POST, PUT, DELETE, FETCH)")
    return code


def error_response(error: ResponseError) -> Response:
    """The response an error is sent as."""
    message = error.to_message()
    return Response(code=Code(message.code), payload=message.payload, size1=message.opt.size1)
