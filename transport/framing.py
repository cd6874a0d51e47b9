"""RFC 8323 (CoAP over TCP) framing at the byte level: frame length, option bounds, the head of a frame.

Used by :mod:`edgert.transport.coap_tcp` to parse frames incrementally out of a
receive buffer and to write a frame's head and its payload separately.
"""

from __future__ import annotations

from aiocoap import Message
from aiocoap import error as coap_error
from aiocoap.transports.tcp import _encode_length

Buffer = bytes | bytearray | memoryview
"""A payload piece: a bytes-like object whose ``len`` is its size in bytes (memoryviews of format "B")."""


def _frame_length(head: bytearray | bytes) -> tuple[int, int, int] | None:
    """(token offset, token length, bytes after the token) of the frame in ``head``, or None if incomplete."""
    if not head:
        return None
    first = head[0]
    nibble = first >> 4
    tkl = first & 0x0F
    if nibble < 13:
        return 2, tkl, nibble
    ext = {13: 1, 14: 2, 15: 4}[nibble]
    if len(head) < 1 + ext:
        return None
    base = {13: 13, 14: 269, 15: 65805}[nibble]
    return 2 + ext, tkl, int.from_bytes(head[1 : 1 + ext], "big") + base


def _options_end(buf: bytearray | bytes, start: int, end: int) -> int | None:
    """Index of the payload marker (or ``end`` if there is no payload) in ``buf[start:end]``.

    Returns None if the options are not complete in ``buf`` yet; raises
    :class:`aiocoap.error.UnparsableMessage` on a malformed option header.
    """
    pos = start
    have = min(len(buf), end)
    while pos < end:
        if pos >= have:
            return None
        byte = buf[pos]
        if byte == 0xFF:
            if pos + 1 >= end:
                raise coap_error.UnparsableMessage("payload marker without payload")
            return pos
        delta, length = byte >> 4, byte & 0x0F
        if delta == 15 or length == 15:
            raise coap_error.UnparsableMessage("reserved option nibble 15")
        pos += 1
        ext = (delta > 12) * (delta - 12) + (length > 12) * (length - 12)
        if pos + ext > have:
            return None if pos + ext <= end else _bad("option header beyond message end")
        _, pos = extended(buf, pos, delta)
        length, pos = extended(buf, pos, length)
        pos += length
        if pos > end:
            raise coap_error.UnparsableMessage("option value beyond message end")
    return end if have >= end else None  # no payload: complete only once the last option value is in


def extended(buf: bytearray | bytes, pos: int, nibble: int) -> tuple[int, int]:
    """An option header's delta or length: its ``nibble`` with the extension bytes at ``pos`` (RFC 7252
    section 3.1; 13 and 14 take one and two bytes), and the position after them."""
    if nibble == 13:
        return buf[pos] + 13, pos + 1
    if nibble == 14:
        return int.from_bytes(buf[pos:pos + 2], "big") + 269, pos + 2
    return nibble, pos


def _bad(text: str):
    raise coap_error.UnparsableMessage(text)


def serialize_head(msg: Message, payload_len: int | None = None) -> bytes:
    """The RFC 8323 frame of ``msg`` up to and including the payload marker (payload not included).

    ``payload_len`` overrides ``len(msg.payload)`` for a payload sent as separate parts.
    """
    return frame_head(msg.code, msg.token, msg.opt.encode(), len(msg.payload) if payload_len is None else payload_len)


def frame_head(code: int, token: bytes, options: bytes, payload_len: int) -> bytes:
    """The RFC 8323 frame head of a message whose options are already encoded (reused for every request
    to one resource)."""
    body_len = len(options) + (1 + payload_len if payload_len else 0)
    nibble, ext = _encode_length(body_len)
    if len(token) > 8:
        raise ValueError(f"token of {len(token)} bytes is longer than 8")
    marker = b"\xff" if payload_len else b""
    return b"".join((bytes(((nibble << 4) | len(token),)), ext, bytes((code,)), token, options, marker))
