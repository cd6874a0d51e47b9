"""Receiving RFC 8323 frames so that a peer can make a connection hold only what it has sent.

A :class:`FrameReader` cuts a connection's byte stream into messages:

- a frame's head (token and options) may take at most ``HEAD_SLACK`` bytes (4.13 beyond), and a
  frame longer than this endpoint's Max-Message-Size is answered 4.13; both are skipped unread;
- a request or response with only the options edgert uses is read without aiocoap's ``Message``
  (:mod:`~edgert.transport.incoming`); any other becomes aiocoap's message, as every signal does;
- a request's head goes to the connection's screen before any payload byte is stored; a
  refused request (4.01, 4.03, 4.04 ...) is answered from its head and its payload skipped;
- an accepted payload from a peer without a verified credential is received into a buffer of
  :data:`FIRST_BUFFER` bytes that grows :data:`GROWTH`-fold whenever it is full (straight to the
  declared length when that is at most a quarter more), never past the declared length (a head
  declaring 60 MiB costs 64 KiB). Each growth copies what arrived into a new buffer, the last one
  the payload's own (no join): at most a third of the payload is copied, and the allocator reuses
  the same sizes message after message, where resizing in place (``realloc``) faulted in fresh
  pages at each growth, several times slower. A verified peer's payload buffer is allocated whole
  when its head arrives;
- with a :class:`~edgert.transport.guard.Budget` (a server's peers without a verified credential)
  every byte of buffer is charged to it; a frame that cannot be charged is answered 5.03 and skipped.

The socket writes payload bytes straight into the buffer (``recv_into``, via the connection's
:meth:`get_buffer`); heads and small frames land in a reused scratch buffer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from aiocoap import Message
from aiocoap import error as coap_error
from aiocoap.message import Direction
from aiocoap.numbers.codes import Code

from edgert.transport.framing import _frame_length, _options_end
from edgert.transport.guard import Budget
from edgert.transport.incoming import IncomingMessage, parse_plain
from edgert.transport.limits import HEAD_SLACK

log = logging.getLogger("edgert.transport.frame_reader")

#: Size of the reused buffer that frame heads (and small frames) are received into.
SCRATCH = 64 * 1024

#: An unverified peer's payload buffer starts this large (or at the payload's size, if smaller) ...
FIRST_BUFFER = 64 * 1024

#: ... and each next chunk makes the room this many times larger, up to the payload's size.
GROWTH = 4

#: Seconds a peer refused for lack of buffer space is told to wait before retrying (Max-Age of the 5.03).
BUSY_RETRY_AFTER = 1


class FrameSink(Protocol):
    """What a :class:`FrameReader` needs from its connection."""

    max_message_size: int

    @property
    def csm_seen(self) -> bool: ...

    @property
    def hostinfo(self) -> str: ...

    def deliver(self, message: Message | IncomingMessage) -> bool:
        """Hand on a complete message; False if the connection ended."""

    def screen(self, request: Message | IncomingMessage) -> Message | None:
        """A refusal of a request from its head alone (None: receive its payload)."""

    def send_signal(self, message: Message) -> None:
        """Send a (small) message now."""

    def abort(self, reason: str) -> None:
        """Send Abort with ``reason`` and close."""


@dataclass
class _Fill:
    """A payload being received."""

    message: Message | IncomingMessage
    size: int  # the declared payload length
    payload: bytearray = field(default_factory=bytearray)  # the buffer being received into (its room so far)
    filled: int = 0  # bytes received into ``payload``
    charged: int = 0  # bytes of the buffer charged to the budget


class FrameReader:
    """One connection's incoming frames; memory grows with the bytes that arrived, not the bytes declared."""

    def __init__(self, sink: FrameSink, budget: Budget | None = None) -> None:
        self._sink = sink
        self.budget = budget
        """Charged for payload buffers (peers without a verified credential); None: not counted."""
        self.trusted = False
        """Whether the peer holds a verified credential: its payloads are allocated whole when their head arrives."""
        self._head = bytearray()
        self._fill: _Fill | None = None
        self._discard = 0
        self._scratch: memoryview | None = memoryview(bytearray(SCRATCH))
        self._direct = False  # whether get_buffer last handed out the payload buffer (not the scratch)

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame has arrived and the rest has not."""
        return bool(self._head) or self._fill is not None or self._discard > 0

    def close(self) -> None:
        """Drop every buffer and give back what was charged (the connection closed)."""
        fill, self._fill = self._fill, None
        if fill is not None:
            self._release(fill)
        self._head = bytearray()
        self._discard = 0
        self._scratch = None

    # -- asyncio.BufferedProtocol ----------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes go: the free part of the payload buffer, or the scratch buffer."""
        fill = self._fill
        if fill is not None:
            if fill.filled < len(fill.payload) or self._grow(fill, 1):
                self._direct = True
                return memoryview(fill.payload)[fill.filled:]
            self._abandon(fill)
        self._direct = False
        if self._scratch is None:  # closed: bytes still in flight go nowhere
            self._scratch = memoryview(bytearray(SCRATCH))
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` arrived in the buffer :meth:`get_buffer` returned."""
        fill = self._fill
        if not self._direct or fill is None:
            self.feed(self._scratch[:nbytes])
            return
        fill.filled += nbytes
        if fill.filled == fill.size:
            self._complete(fill)

    def feed(self, data: bytes | memoryview) -> None:
        """Bytes received outside :meth:`get_buffer` (or into the scratch buffer)."""
        view = memoryview(data)
        while view:
            if self._discard:
                step = min(self._discard, len(view))
                self._discard -= step
                view = view[step:]
                continue
            fill = self._fill
            if fill is not None:
                if fill.filled == len(fill.payload) and not self._grow(fill, len(view)):
                    if not self._abandon(fill):
                        return
                    continue  # the rest of the frame is skipped
                step = min(len(fill.payload) - fill.filled, len(view))
                fill.payload[fill.filled : fill.filled + step] = view[:step]
                fill.filled += step
                view = view[step:]
                if fill.filled == fill.size and not self._complete(fill):
                    return
                continue
            self._head += view
            view = view[len(view) :]
            if not self._parse_head():
                return

    # -- heads -------------------------------------------------------------------------

    def _parse_head(self) -> bool:
        """Consume complete frames (or start a payload) from the head buffer; False if the connection ended."""
        sink = self._sink
        while self._head:
            frame = _frame_length(self._head)
            if frame is None:
                return True
            token_at, tkl, rest = frame
            total = token_at + tkl + rest
            if tkl > 8:
                sink.abort("Overly long token")
                return False
            if len(self._head) < token_at + tkl:
                return True
            code = Code(self._head[token_at - 1])
            if not code.is_signalling() and not sink.csm_seen:
                sink.abort("No CSM received")
                return False
            if total > sink.max_message_size:
                if not self._refuse(code, token_at, tkl, total, _too_large(
                        f"message of {total} bytes exceeds this endpoint's Max-Message-Size of "
                        f"{sink.max_message_size} bytes", sink.max_message_size - HEAD_SLACK)):
                    return False
                continue
            opt_at = token_at + tkl
            try:
                opt_end = _options_end(self._head, opt_at, total)
            except coap_error.UnparsableMessage as exc:
                sink.abort(f"Failed to parse message: {exc}")
                return False
            if (opt_end if opt_end is not None else len(self._head)) - opt_at > HEAD_SLACK:
                if not self._refuse(code, token_at, tkl, total, _too_large(
                        f"options longer than {HEAD_SLACK} bytes", sink.max_message_size - HEAD_SLACK)):
                    return False
                continue
            if opt_end is None:
                return True
            token = bytes(self._head[token_at:opt_at])
            message: Message | IncomingMessage | None = None
            if code.is_request() or code.is_response():
                message = parse_plain(code, token, self._head, opt_at, opt_end, sink)
            if message is None:
                message = Message(code=code, _token=token)
                try:
                    message.opt.decode(bytes(self._head[opt_at:opt_end]))
                except (coap_error.UnparsableMessage, ValueError) as exc:
                    sink.abort(f"Failed to parse options: {exc}")
                    return False
                message.direction = Direction.INCOMING
                message.remote = sink
            if opt_end == total:
                message.payload = b""
                del self._head[:total]
                if not sink.deliver(message):
                    return False
                continue
            refusal = sink.screen(message) if code.is_request() else None
            if refusal is not None:
                refusal.token = message.token
                sink.send_signal(refusal)
                self._skip(total)
                continue
            if not self._start_payload(message, opt_end + 1, total):
                return False
        return True

    def _start_payload(self, message: Message | IncomingMessage, start: int, total: int) -> bool:
        """Begin receiving the payload at ``self._head[start:total]``; False if the connection ended."""
        size = total - start
        have = min(len(self._head), total) - start
        fill = _Fill(message, size)
        if not self._grow(fill, size if self.trusted else max(have, 1)):
            self._skip(total)
            return self._refuse_payload(fill)
        fill.payload[:have] = memoryview(self._head)[start : start + have]
        fill.filled = have
        del self._head[: start + have]
        self._fill = fill
        if have == size:
            return self._complete(fill)
        return True

    def _refuse(self, code: Code, token_at: int, tkl: int, total: int, answer: Message) -> bool:
        """Answer a request frame with ``answer`` and skip it; abort (False) on any other frame."""
        if not code.is_request():
            self._sink.abort(f"{bytes(answer.payload).decode()} (a {code.dotted} frame)")
            return False
        answer.token = bytes(self._head[token_at : token_at + tkl])
        self._sink.send_signal(answer)
        log.warning("refused a %d-byte frame from %s: %s", total, self._sink.hostinfo,
                    bytes(answer.payload).decode())
        self._skip(total)
        return True

    def _skip(self, total: int) -> None:
        """Drop the frame of ``total`` bytes that starts the head buffer, also the bytes still to come."""
        have = min(total, len(self._head))
        del self._head[:have]
        self._discard = total - have

    # -- payloads ----------------------------------------------------------------------

    def _grow(self, fill: _Fill, want: int) -> bool:
        """Make room for ``want`` more bytes once ``fill.payload`` is full (room at least GROWTH-fold, at
        most the declared size); False (nothing changes): the budget cannot pay for it."""
        capacity = len(fill.payload)
        room = min(fill.size, max(FIRST_BUFFER, GROWTH * capacity, capacity + want))
        if fill.size - room <= room // GROWTH:
            room = fill.size  # rather than one more growth (and copy) for the last few bytes
        extra = room - capacity
        if self.budget is not None and not self.budget.charge(extra):
            return False
        # a new buffer and a copy of what arrived: resizing in place (realloc) maps fresh pages at each
        # growth, and their page faults cost far more than copying the smaller part received so far
        grown = bytearray(room)
        memoryview(grown)[:capacity] = fill.payload
        fill.payload = grown
        fill.charged += extra
        return True

    def _abandon(self, fill: _Fill) -> bool:
        """Stop receiving a payload the budget cannot hold: skip its remaining bytes and refuse it."""
        self._fill = None
        self._discard = fill.size - fill.filled
        return self._refuse_payload(fill)

    def _refuse_payload(self, fill: _Fill) -> bool:
        """Answer 5.03 to a request refused for lack of buffer space (abort on other frames; then False)."""
        message = fill.message
        budget = self.budget
        self._release(fill)
        reason = (f"busy: {budget.used} bytes of incomplete messages from peers without a cluster credential are "
                  f"buffered (limit {budget.limit}); retry")
        log.warning("refused a %d-byte payload from %s: %s", fill.size, self._sink.hostinfo, reason)
        if not message.code.is_request():
            self._sink.abort(reason)
            return False
        answer = Message(code=Code.SERVICE_UNAVAILABLE, max_age=BUSY_RETRY_AFTER, payload=reason.encode())
        answer.token = message.token
        self._sink.send_signal(answer)
        return True

    def _complete(self, fill: _Fill) -> bool:
        self._fill = None
        self._release(fill)
        fill.message.payload = fill.payload
        return self._sink.deliver(fill.message)

    def _release(self, fill: _Fill) -> None:
        if self.budget is not None and fill.charged:
            self.budget.release(fill.charged)
        fill.charged = 0


def _too_large(text: str, size1: int) -> Message:
    """A 4.13 answer to a frame refused unread, with Size1 = the payload this endpoint takes."""
    answer = Message(code=Code.REQUEST_ENTITY_TOO_LARGE, payload=text.encode())
    answer.opt.size1 = max(0, size1)
    return answer
