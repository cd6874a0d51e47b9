"""Bodies in pieces: an envelope too large for one message, cut into pieces and checked end to end.

The wire format is defined here and only here (docs/PROTOCOL.md §12, "Bodies in pieces"). A body is
the bytes of one encoded envelope (for a stage state, exactly a ``stage<k>.cbor`` file). It travels as
``piece`` envelopes, in order, each carrying ``data`` (a uint8 tensor: the body's bytes from
``meta.offset``), the body's total ``meta.size`` and the ``meta.transfer`` id; the last one carries
``meta.digest``, the SHA-256 of the whole body. A receiver writes each piece where the body goes (a
buffer of the declared size, or a file), hashes it as it comes, and takes the body only when the digest
matches: it holds the body plus the piece in hand, never a second copy.

- :class:`Outgoing` cuts a body (the zero-copy parts of an encoding) into pieces and hashes them in order;
- :class:`Incoming` takes pieces in order into a :class:`MemorySink` or a :class:`FileSink` and checks them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgert.transport.envelope import Envelope
from edgert.transport.errors import BadRequest, Incomplete, TooLarge
from edgert.transport.framing import Buffer
from edgert.transport.limits import Limits, MiB

PIECE_KIND = "piece"
"""Envelope kind of one piece of a body."""
PIECE_PATH = "piece"
"""Where a server hands out the next pieces of the bodies it answers in pieces (``FETCH /piece``)."""
PIECE_BYTES = 8 * MiB
"""Bytes of body a sender puts in one piece (the last one may hold fewer)."""
IN_FLIGHT = 2
"""Pieces a sender (or a puller) has on the way at once: the link never waits for a round trip."""
DIGEST_BYTES = 32  # SHA-256
DATA = "data"
_U63 = 1 << 63


def new_transfer_id() -> int:
    """A transfer id no other transfer of the same peer is likely to have."""
    return secrets.randbits(63)


def stream_limits(size: int, limits: Limits) -> Limits:
    """Limits to decode a body of ``size`` bytes received in pieces: ``limits`` with its byte caps raised to the
    size (the transfer already bounded it), every structural cap kept."""
    cap = max(size, 1)
    return dataclasses.replace(limits, max_payload_bytes=max(cap, limits.max_payload_bytes),
                               max_tensor_bytes=max(cap, limits.max_tensor_bytes),
                               max_decoded_bytes=max(cap, limits.max_decoded_bytes),
                               max_tensors=max(limits.max_tensors, 65536))


@dataclass(frozen=True)
class Piece:
    """One piece as read off the wire: which transfer, where in the body, the body's size, and its bytes."""

    transfer: int
    offset: int
    size: int
    of: str  # the kind of the envelope the body is
    data: memoryview
    digest: bytes | None  # on the last piece only
    header: Envelope  # the piece envelope itself: run_id, step, stage of the body, for admission

    @property
    def last(self) -> bool:
        return self.offset + len(self.data) == self.size


def piece_envelope(body: Envelope, transfer: int, offset: int, size: int, data: np.ndarray,
                   digest: bytes | None = None) -> Envelope:
    """The piece of ``body`` (whose header fields it repeats) holding ``data`` from ``offset``."""
    meta: dict[str, Any] = {"transfer": transfer, "offset": offset, "size": size, "of": body.kind}
    if digest is not None:
        meta["digest"] = digest
    return Envelope(kind=PIECE_KIND, run_id=body.run_id, step=body.step, microbatch=body.microbatch,
                    stage=body.stage, tensors={DATA: data}, meta=meta)


def read_piece(envelope: Envelope) -> Piece:
    """Check a piece envelope's fields (4.00 naming the one that is wrong); the piece."""
    meta = envelope.meta
    for name in ("transfer", "offset", "size"):
        value = meta.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _U63:
            raise BadRequest(f"piece is malformed: meta.{name} must be an integer >= 0, got {value!r}")
    unknown = set(meta) - {"transfer", "offset", "size", "of", "digest"}
    if unknown:
        raise BadRequest(f"piece is malformed: unknown field(s) meta.{', meta.'.join(sorted(unknown))}")
    if not isinstance(meta.get("of"), str):
        raise BadRequest(f"piece is malformed: meta.of must be the body's kind, got {meta.get('of')!r}")
    digest = meta.get("digest")
    if digest is not None and (not isinstance(digest, (bytes, bytearray)) or len(digest) != DIGEST_BYTES):
        raise BadRequest(f"piece is malformed: meta.digest must be {DIGEST_BYTES} bytes (SHA-256)")
    data = envelope.tensors.get(DATA)
    if set(envelope.tensors) != {DATA} or data is None or data.dtype != np.uint8 or data.ndim != 1:
        raise BadRequest("piece is malformed: it must carry exactly one tensor, 'data', of uint8[n]")
    if meta["offset"] + len(data) > meta["size"]:
        raise TooLarge(f"piece of {len(data)} bytes at byte {meta['offset']} passes the body's declared size "
                       f"of {meta['size']} bytes", size1=meta["size"])
    if not len(data) and meta["size"]:
        raise BadRequest("piece is malformed: an empty piece of a body that is not empty")
    return Piece(int(meta["transfer"]), int(meta["offset"]), int(meta["size"]), meta["of"],
                 memoryview(data).cast("B"), None if digest is None else bytes(digest), envelope)


def piece_request(transfer: int, offset: int) -> Envelope:
    """``FETCH /piece``: the piece of ``transfer`` that starts at ``offset``."""
    return Envelope(kind="control", meta={"transfer": transfer, "offset": offset})


def read_piece_request(envelope: Envelope) -> tuple[int, int]:
    """(transfer, offset) of a ``FETCH /piece`` (4.00 if malformed)."""
    meta = envelope.meta
    if envelope.kind != "control" or set(meta) != {"transfer", "offset"} or envelope.tensors:
        raise BadRequest("FETCH /piece takes a 'control' envelope with exactly meta.transfer and meta.offset")
    for name in ("transfer", "offset"):
        value = meta[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _U63:
            raise BadRequest(f"FETCH /piece: meta.{name} must be an integer >= 0, got {value!r}")
    return int(meta["transfer"]), int(meta["offset"])


# -- sending ----------------------------------------------------------------------------------------


class Outgoing:
    """A body cut into pieces of at most ``piece_bytes``, served in order, hashed as it goes.

    ``parts`` are the body's consecutive buffers (an envelope's encoding references its arrays, so
    they must stay unchanged until the last piece is out). A piece inside one part is a view of it;
    one that straddles parts is copied into one of :data:`IN_FLIGHT` reused buffers.
    """

    def __init__(self, parts: list[Buffer], piece_bytes: int = PIECE_BYTES):
        self._parts = [memoryview(p).cast("B") for p in parts if len(p)]
        self._starts = np.cumsum([0] + [len(p) for p in self._parts])
        self.size = int(self._starts[-1])
        self.piece_bytes = piece_bytes
        self.next_offset = 0
        self._hash = hashlib.sha256()
        self._digest: bytes | None = None
        self._spare = [np.empty(min(piece_bytes, self.size), np.uint8) for _ in range(IN_FLIGHT)] \
            if len(self._parts) > 1 else []
        self._turn = 0
        self._last: tuple[int, np.ndarray, bytes | None] | None = None

    @property
    def done(self) -> bool:
        return self._digest is not None

    def piece(self, offset: int) -> tuple[np.ndarray, bytes | None]:
        """The piece at ``offset`` (the next one, or the last one again) and, on the last, the body's digest."""
        if self._last is not None and offset == self._last[0]:
            return self._last[1], self._last[2]
        if offset != self.next_offset:
            raise Incomplete(f"piece at byte {offset} asked for; the next one starts at byte {self.next_offset} "
                             f"(pieces go in order)")
        n = min(self.piece_bytes, self.size - offset)
        data = self._slice(offset, n)
        self._hash.update(data)
        self.next_offset = offset + n
        if self.next_offset == self.size:
            self._digest = self._hash.digest()
        self._last = (offset, data, self._digest)
        return data, self._digest

    def pieces(self):
        """Every piece still to send, in order: (offset, data, digest on the last)."""
        while self.next_offset < self.size:
            offset = self.next_offset
            data, digest = self.piece(offset)
            yield offset, data, digest

    def _slice(self, offset: int, n: int) -> np.ndarray:
        first = int(np.searchsorted(self._starts, offset, side="right")) - 1
        start = offset - int(self._starts[first])
        if start + n <= len(self._parts[first]):
            return np.frombuffer(self._parts[first], np.uint8, n, start)
        out = self._spare[self._turn][:n]
        self._turn = (self._turn + 1) % len(self._spare)
        filled, index = 0, first
        while filled < n:
            part = self._parts[index]
            take = min(len(part) - start, n - filled)
            out[filled:filled + take] = np.frombuffer(part, np.uint8, take, start)
            filled += take
            index, start = index + 1, 0
        return out


# -- receiving --------------------------------------------------------------------------------------


class Sink(Protocol):
    """Where a body received in pieces goes."""

    def write(self, offset: int, data: memoryview) -> None: ...

    def finish(self) -> memoryview:
        """The whole body, once every piece was written and the digest matched."""
        ...

    def commit(self) -> None:
        """Keep the body (after its receiver took it)."""
        ...

    def abort(self) -> None:
        """Drop what was written (a refused or abandoned body)."""
        ...


class MemorySink:
    """A body in memory: one buffer of the declared size (pages are touched, so resident, only as pieces land);
    ``on_close`` runs once, when the body is kept or dropped (to give back what its admission reserved)."""

    path = None

    def __init__(self, size: int, on_close: Callable[[], None] | None = None):
        self._buffer: np.ndarray | None = np.empty(size, np.uint8)
        self._on_close = on_close

    def _close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def write(self, offset: int, data: memoryview) -> None:
        self._buffer[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def finish(self) -> memoryview:
        return memoryview(self._buffer)

    def commit(self) -> None:
        self._close()

    def abort(self) -> None:
        self._buffer = None
        self._close()


class FileSink:
    """A body written to ``path`` as it arrives: to ``path``.partial, renamed by :meth:`commit` (after the digest
    matched and the receiver took it; with ``keep=False`` removed instead: a body only read once);
    :meth:`finish` maps the file read-only, so what is decoded from it lives in the page cache, not in the
    heap."""

    def __init__(self, path: Path, keep: bool = True):
        self.path = Path(path)
        self._keep = keep
        self._committed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._partial = self.path.with_name(f"{self.path.name}.{secrets.token_hex(4)}.partial")  # one per transfer
        self._file = open(self._partial, "wb")  # noqa: SIM115 - closed by finish/abort

    def write(self, offset: int, data: memoryview) -> None:
        self._file.write(data)

    def finish(self) -> memoryview:
        self._file.close()
        return map_file(self._partial)

    def commit(self) -> None:
        """Idempotent: a receiver that needs the file in place before it answers commits it itself."""
        if self._committed:
            return
        self._committed = True
        if self._keep:
            os.replace(self._partial, self.path)
        else:
            self._partial.unlink(missing_ok=True)

    def abort(self) -> None:
        self._file.close()
        if not self._committed:
            self._partial.unlink(missing_ok=True)


def map_file(path: Path) -> memoryview:
    """``path``'s bytes, mapped read-only (an empty file as empty bytes)."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))


class Incoming:
    """One body arriving in pieces, in order, into ``sink``; checked against its size and digest."""

    def __init__(self, transfer: int, size: int, of: str, sink: Sink):
        self.transfer = transfer
        self.size = size
        self.of = of
        self.sink = sink
        self.received = 0
        self._hash = hashlib.sha256()

    def accept(self, piece: Piece) -> bool:
        """Take ``piece``; True once the body is complete and its digest matched. A piece wholly before what
        was received is a repeat (a retried send) and changes nothing. Raises (4.08 out of order, 4.00
        a piece that disagrees with the transfer or a wrong digest); the caller then drops the transfer."""
        if piece.size != self.size or piece.of != self.of:
            raise BadRequest(f"piece of transfer {self.transfer} declares a body of {piece.size} bytes of kind "
                             f"{piece.of!r}; the transfer's first piece said {self.size} bytes of {self.of!r}")
        end = piece.offset + len(piece.data)
        if end <= self.received and len(piece.data):
            return False
        if piece.offset != self.received:
            raise Incomplete(f"piece at byte {piece.offset} of transfer {self.transfer}; the next one starts at "
                             f"byte {self.received} (pieces go in order)")
        if piece.digest is not None and not piece.last:
            raise BadRequest(f"piece at byte {piece.offset} of transfer {self.transfer} carries a digest but is "
                             f"not the last")
        self._hash.update(piece.data)
        self.sink.write(piece.offset, piece.data)
        self.received = end
        if not piece.last:
            return False
        if piece.digest is None:
            raise BadRequest(f"the last piece of transfer {self.transfer} carries no digest (meta.digest)")
        if piece.digest != self._hash.digest():
            raise BadRequest(f"transfer {self.transfer}: the body's SHA-256 does not match its digest "
                             f"({len(piece.digest)} bytes received: damaged or mixed pieces); nothing was kept")
        return True
