"""Declared limits: how big and how deep a message may be, and what a peer may hold, before it is refused.

One frozen :class:`Limits` travels with every server, client and decoder. Size
limits are answered with 4.13 (Request Entity Too Large, Size1 = the limit);
structural limits (nesting depth, dimensions) with 4.00. The connection limits bound
what peers without a verified cluster credential can make a CoAP-over-TCP server hold
(connections, buffered bytes, time; docs/SECURITY.md, "Bounded resources").
"""

from __future__ import annotations

from dataclasses import dataclass, fields

KiB = 1024
MiB = 1024 * KiB

#: Bytes a CoAP-over-TCP message may carry beyond its payload (token, options).
HEAD_SLACK = 4 * KiB

#: Largest Max-Message-Size a CSM can carry (a uint of at most 4 bytes, RFC 8323 section 5.3.1).
MAX_CSM_SIZE = 0xFFFFFFFF


@dataclass(frozen=True)
class Limits:
    """Caps applied while receiving and decoding: sizes and counts are positive ints, timeouts positive seconds."""

    max_payload_bytes: int = 64 * MiB
    """One request or response payload, after blockwise reassembly (4.13)."""
    max_tensor_bytes: int = 64 * MiB
    """One decoded tensor, checked before anything is allocated (4.13)."""
    max_decoded_bytes: int = 256 * MiB
    """All tensors of one envelope after decompression, checked before allocating (4.13)."""
    max_tensors: int = 4096
    """Tensors in one envelope (4.13)."""
    max_items: int = 1_000_000
    """CBOR data items in one message (4.13)."""
    max_string_bytes: int = 1 * MiB
    """One text or byte string outside tensor data (4.13)."""
    max_ndim: int = 16
    """Dimensions of one tensor (4.00)."""
    max_depth: int = 32
    """Nesting of CBOR arrays, maps and tags (4.00)."""
    tcp_message_bytes: int = 0
    """Max-Message-Size advertised on CoAP-over-TCP connections; 0 means payload limit + head slack.

    Set it below the payload limit to make peers send BERT blocks instead of one message.
    It is also the most one connection buffers at once: frames arrive one after the other.
    """
    max_connections: int = 64
    """Open CoAP-over-TCP connections of peers without a verified cluster credential, per server; the
    next one is aborted at once (7.05 "too many connections"). Enrolled peers over TLS are not counted."""
    max_unverified_bytes: int = 256 * MiB
    """Payload bytes of incomplete frames from peers without a verified credential, per server, all
    connections together; a frame that would pass it is answered 5.03 and skipped."""
    max_transfers: int = 16
    """Bodies a server receives in pieces at once, and as many it answers in pieces (docs/PROTOCOL.md §12);
    the next one is answered 5.03. Each one ends, and gives back what it held, after ``frame_timeout``
    seconds without a piece."""
    frame_timeout: float = 30.0
    """Seconds a connection may go without a byte while a frame (or the peer's CSM) is incomplete,
    and without answering a Ping; then it is aborted."""
    idle_timeout: float = 120.0
    """Seconds of silence after which a server sends a connection a Ping (RFC 8323 section 5.4)."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            seconds = field.type == "float"
            if not isinstance(value, (int, float) if seconds else int) or isinstance(value, bool):
                raise TypeError(f"Limits.{field.name} must be {'a number' if seconds else 'an int'}, got {value!r}")
            if seconds:
                if not value > 0:
                    raise ValueError(f"Limits.{field.name} must be > 0 seconds, got {value}")
                continue
            minimum = 0 if field.name == "tcp_message_bytes" else 1
            if value < minimum:
                raise ValueError(f"Limits.{field.name} must be >= {minimum}, got {value}")
        if 0 < self.tcp_message_bytes < 1152:
            raise ValueError(f"Limits.tcp_message_bytes must be 0 or >= 1152 (RFC 8323), got {self.tcp_message_bytes}")

    @property
    def tcp_max_message_size(self) -> int:
        """The Max-Message-Size this endpoint advertises in its CSM (RFC 8323 caps it at 2**32 - 1)."""
        return min(self.tcp_message_bytes or self.max_payload_bytes + HEAD_SLACK, MAX_CSM_SIZE)


DEFAULT_LIMITS = Limits()
