"""A CoAP message read straight off a TCP frame: :class:`IncomingMessage`, without aiocoap's objects.

The tensor path's messages carry only the options edgert uses: a request Uri-Path, Content-Format
and Uri-Query (and Uri-Host, Uri-Port and Accept, which the server ignores), a response
Content-Format and Size1 (and Max-Age, which the client ignores). :func:`parse_plain` reads those
from the frame's bytes, so such a message never becomes an aiocoap ``Message`` with its option
objects (what they cost: docs/RUNTIME.md). A message with any other option (Observe, Block1/Block2,
No-Response, ETag, an unknown critical option ...) is left to aiocoap as before;
:meth:`IncomingMessage.of` reads the same fields off an aiocoap request, so the server's checks and
handlers see one kind of request whichever way it came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiocoap import Message
from aiocoap.message import Direction
from aiocoap.numbers.codes import Code

from edgert.transport.framing import extended
from edgert.transport.message import Response

#: Option numbers (RFC 7252 section 5.10) read off a frame without aiocoap.
URI_PATH, CONTENT_FORMAT, URI_QUERY, SIZE1 = 11, 12, 15, 60

#: Further options a plain request or response may carry, which edgert ignores (as on aiocoap's path).
_IGNORED_IN_REQUESTS = frozenset((3, 7, 17))  # Uri-Host, Uri-Port, Accept
_IGNORED_IN_RESPONSES = frozenset((14,))  # Max-Age


@dataclass(slots=True, eq=False)
class IncomingMessage:
    """One request to a :class:`~edgert.transport.server.TensorServer` (its head, then its payload), or
    one response to a client's request."""

    code: Code
    token: bytes
    path: tuple[str, ...]
    content_format: int | None
    query: tuple[str, ...]
    remote: Any
    """The connection (TCP) or aiocoap remote (UDP, OSCORE) it came from."""
    size1: int | None = None
    payload: bytes | bytearray | memoryview = b""

    @classmethod
    def of(cls, message: Message) -> IncomingMessage:
        """The fields of a request aiocoap parsed."""
        content_format = message.opt.content_format
        return cls(Code(message.code), message.token, tuple(message.opt.uri_path),
                   None if content_format is None else int(content_format), tuple(message.opt.uri_query),
                   message.remote, message.opt.size1, message.payload)

    def to_message(self) -> Message:
        """This message as aiocoap's (for what only aiocoap serves: Block2 responses, its dispatch)."""
        message = Message(code=self.code, _token=self.token, payload=self.payload)
        if self.path:
            message.opt.uri_path = self.path
        if self.content_format is not None:
            message.opt.content_format = self.content_format
        if self.query:
            message.opt.uri_query = self.query
        if self.size1 is not None:
            message.opt.size1 = self.size1
        message.direction = Direction.INCOMING
        message.remote = self.remote
        return message

    def response(self) -> Response:
        """This response as a client returns it."""
        return Response(self.code, self.payload, self.content_format, self.size1)

    @property
    def peer_name(self) -> str:
        """Who sent it, for logs."""
        try:
            return self.remote.hostinfo
        except Exception:  # noqa: BLE001  (only used for logs)
            return "?"


def parse_plain(code: Code, token: bytes, frame: bytes | bytearray, start: int, end: int,
                remote: Any) -> IncomingMessage | None:
    """The request or response whose options are ``frame[start:end]`` (well-formed, as the frame reader
    checked), or None if it carries an option beyond the plain ones (aiocoap parses it then)."""
    request = code.is_request()
    ignored = _IGNORED_IN_REQUESTS if request else _IGNORED_IN_RESPONSES
    number = 0
    pos = start
    path: list[str] = []
    query: list[str] = []
    content_format = size1 = None
    try:
        while pos < end:
            byte = frame[pos]
            delta, pos = extended(frame, pos + 1, byte >> 4)
            length, pos = extended(frame, pos, byte & 0x0F)
            number += delta
            value = frame[pos:pos + length]
            pos += length
            if number == CONTENT_FORMAT and content_format is None and length <= 2:
                content_format = int.from_bytes(value, "big")
            elif request and number == URI_PATH:
                path.append(str(value, "utf-8"))
            elif request and number == URI_QUERY:
                query.append(str(value, "utf-8"))
            elif not request and number == SIZE1 and size1 is None and length <= 4:
                size1 = int.from_bytes(value, "big")
            elif number not in ignored:
                return None
    except UnicodeDecodeError:
        return None  # aiocoap decides what a path that is not UTF-8 gets
    return IncomingMessage(code, token, tuple(path), content_format, tuple(query), remote, size1)
