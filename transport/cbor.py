"""The CBOR (RFC 8949) subset edgert speaks, with zero-copy byte strings and strict limits.

Why not cbor2: its decoder copies every byte string (so tensors could not be
views over the received payload) and it has no RFC 8746 typed arrays. This
module covers exactly what the wire format uses:

- unsigned/negative integers, byte and text strings, arrays, maps with text
  keys, tags (only those a caller registers), false/true/null, half/single/double
  floats;
- definite lengths only (indefinite-length items are refused);
- a :class:`Writer` that collects parts (large buffers by reference, joined once)
  and a :class:`Reader` that hands out ``memoryview`` slices of its input.

Every violation raises :class:`MalformedMessage` (4.00) or :class:`TooLarge`
(4.13) naming the byte offset; nothing else escapes :func:`loads`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from typing import Any

from edgert.transport.errors import MalformedMessage, TooLarge
from edgert.transport.limits import DEFAULT_LIMITS, Limits

MAJOR_UINT, MAJOR_NINT, MAJOR_BYTES, MAJOR_TEXT, MAJOR_ARRAY, MAJOR_MAP, MAJOR_TAG, MAJOR_SIMPLE = range(8)

#: Self-described CBOR (RFC 8949 section 3.4.6); tolerated at the top level only.
TAG_SELF_DESCRIBED = 55799

_WIDTH_AI = {1: 24, 2: 25, 4: 26, 8: 27}
_FLOAT64 = struct.Struct(">d")


def head(major: int, value: int, width: int | None = None) -> bytes:
    """The head of a data item: major type plus argument, in ``width`` argument bytes (None = shortest)."""
    if value < 0:
        raise ValueError(f"CBOR argument must be >= 0, got {value}")
    if width is None:
        if value < 24:
            return bytes((major << 5 | value,))
        width = 1 if value < 0x100 else 2 if value < 0x10000 else 4 if value < 0x100000000 else 8
    elif width == 0:
        if value >= 24:
            raise ValueError(f"argument {value} does not fit in the initial byte")
        return bytes((major << 5 | value,))
    if value >= 1 << (8 * width):
        raise ValueError(f"argument {value} does not fit in {width} bytes")
    return bytes((major << 5 | _WIDTH_AI[width],)) + value.to_bytes(width, "big")


def head_widths(value: int) -> tuple[int, ...]:
    """Argument widths (0 = in the initial byte) that can carry ``value``; the first is the shortest."""
    widths = [w for w in (1, 2, 4, 8) if value < 1 << (8 * w)]
    return ((0,) if value < 24 else ()) + tuple(widths)


class _Unencodable(Exception):
    """Raised inside :meth:`Writer.encode` and turned into ``kind`` with the path of the item at fault."""

    def __init__(self, kind: type[Exception], reason: str):
        super().__init__(reason)
        self.kind, self.reason, self.where = kind, reason, ""


_HEADS = {major: [bytes((major << 5 | value,)) for value in range(24)] for major in range(8)}


def _head(major: int, value: int) -> bytes:
    """:func:`head` in the shortest width, from a table for the arguments under 24."""
    return _HEADS[major][value] if value < 24 else head(major, value)


class Writer:
    """Collects the encoding of one CBOR item as a list of parts; large buffers are kept by reference."""

    def __init__(self, default: Callable[[Writer, Any], bool] | None = None) -> None:
        self.parts: list[bytes | memoryview] = []
        self.size = 0
        self._default = default

    def write(self, part: bytes | memoryview) -> None:
        """Append raw bytes (or a buffer, referenced until :meth:`getvalue`)."""
        self.parts.append(part)
        self.size += len(part) if isinstance(part, bytes) else part.nbytes

    def head(self, major: int, value: int, width: int | None = None) -> None:
        """Append a data item head."""
        self.write(head(major, value, width))

    def encode(self, obj: Any, _path: str = "$") -> None:
        """Append ``obj`` (None, bool, int, float, str, bytes, list/tuple, dict with str keys, or via ``default``).

        What cannot be encoded raises TypeError or ValueError naming where it is (``$.reports[0].spans``).
        """
        try:
            self._item(obj)
        except _Unencodable as problem:
            raise problem.kind(f"{_path}{problem.where}: {problem.reason}") from None

    def _item(self, obj: Any) -> None:
        # Exact types first (the meta of every report is dicts, lists, str, int, float), then the general rules.
        kind = type(obj)
        if kind is str:
            data = obj.encode("utf-8")
            self._append(_head(MAJOR_TEXT, len(data)) + data)
        elif kind is int and 0 <= obj < 1 << 64:
            self._append(_head(MAJOR_UINT, obj))
        elif kind is float:
            self._append(b"\xfb" + _FLOAT64.pack(obj))
        elif kind is dict:
            self._append(_head(MAJOR_MAP, len(obj)))
            for key, value in obj.items():
                if type(key) is not str:
                    self._key(key)
                else:
                    data = key.encode("utf-8")
                    self._append(_head(MAJOR_TEXT, len(data)) + data)
                try:
                    self._item(value)
                except _Unencodable as problem:  # the path is only built for an error
                    problem.where = f".{key}{problem.where}"
                    raise
        elif kind is list or kind is tuple:
            self._append(_head(MAJOR_ARRAY, len(obj)))
            for index, item in enumerate(obj):
                try:
                    self._item(item)
                except _Unencodable as problem:
                    problem.where = f"[{index}]{problem.where}"
                    raise
        else:
            self._other(obj)

    def _key(self, key: Any) -> None:
        if not isinstance(key, str):
            raise _Unencodable(TypeError, f"map keys must be str, got {type(key).__name__} {key!r}")
        self._item(str(key))

    def _other(self, obj: Any) -> None:
        if obj is None:
            self.write(b"\xf6")
        elif obj is True:
            self.write(b"\xf5")
        elif obj is False:
            self.write(b"\xf4")
        elif isinstance(obj, int):
            if 0 <= obj < 1 << 64:
                self.head(MAJOR_UINT, obj)
            elif -(1 << 64) <= obj < 0:
                self.head(MAJOR_NINT, -1 - obj)
            else:
                raise _Unencodable(ValueError, f"integer {obj} is outside the CBOR 64-bit range")
        elif isinstance(obj, float):
            self.write(b"\xfb" + _FLOAT64.pack(obj))
        elif isinstance(obj, str):
            self._item(str(obj))
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            data = bytes(obj)
            self.head(MAJOR_BYTES, len(data))
            self.write(data)
        elif isinstance(obj, (list, tuple)):
            self._item(list(obj))
        elif isinstance(obj, Mapping):
            self._item(dict(obj))
        elif self._default is not None and self._default(self, obj):
            pass
        else:
            raise _Unencodable(TypeError, f"cannot encode {type(obj).__name__} as CBOR")

    def _append(self, part: bytes) -> None:
        """:meth:`write` for the bytes the encoder built itself: no buffer check (about 10% of a report's encoding)."""
        self.parts.append(part)
        self.size += len(part)

    def getvalue(self) -> bytes:
        """The encoded bytes (the one copy of any referenced buffer happens here)."""
        return b"".join(self.parts)


def dumps(obj: Any, default: Callable[[Writer, Any], bool] | None = None) -> bytes:
    """Encode one item."""
    writer = Writer(default)
    writer.encode(obj)
    return writer.getvalue()


TagHandler = Callable[["Reader", int, int, int], Any]
"""``handler(reader, tag, offset, depth)`` reads the tag content from ``reader`` and returns the value."""


class Reader:
    """Decodes CBOR items from a buffer, returning ``memoryview`` slices for byte strings."""

    def __init__(self, data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS,
                 tags: Mapping[int, TagHandler] | None = None) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        self.buf = view
        self.end = len(view)
        self.pos = 0
        self.limits = limits
        self.tags = tags or {}
        self.items = 0
        self._max_items = limits.max_items
        self._max_depth = limits.max_depth
        self._max_string = limits.max_string_bytes

    # -- primitive steps ---------------------------------------------------

    def fail(self, text: str, offset: int | None = None) -> MalformedMessage:
        """A :class:`MalformedMessage` naming the offset (default: the current position)."""
        return MalformedMessage(f"{text} (at byte {self.pos if offset is None else offset})")

    def read_head(self) -> tuple[int, int, int]:
        """(major type, argument, offset of the head); refuses reserved and indefinite-length heads."""
        offset = self.pos
        if offset >= self.end:
            raise self.fail("truncated CBOR: expected a data item, found end of payload")
        self.items += 1
        if self.items > self._max_items:
            raise TooLarge(f"more than {self._max_items} CBOR items (at byte {offset})")
        initial = self.buf[offset]
        info = initial & 0x1F
        if info < 24:
            self.pos = offset + 1
            return initial >> 5, info, offset
        if info > 27:
            if info == 31:
                raise self.fail("indefinite-length items are not supported", offset)
            raise self.fail(f"reserved additional information {info}", offset)
        end = offset + 1 + (1 << (info - 24))
        if end > self.end:
            raise self.fail(f"truncated CBOR: {end - offset - 1}-byte argument runs past the end", offset)
        self.pos = end
        return initial >> 5, int.from_bytes(self.buf[offset + 1 : end], "big"), offset

    def take(self, count: int, offset: int, what: str) -> memoryview:
        """The next ``count`` bytes as a view (no copy)."""
        end = self.pos + count
        if end > self.end:
            raise self.fail(
                f"truncated CBOR: {what} of {count} bytes declared, only {self.end - self.pos} remain", offset
            )
        view = self.buf[self.pos : end]
        self.pos = end
        return view

    def expect(self, major: int, what: str) -> tuple[int, int]:
        """Read a head that must have the given major type; returns (argument, offset)."""
        got, value, offset = self.read_head()
        if got != major:
            raise self.fail(f"expected {what}, found {_MAJOR_NAMES[got]}", offset)
        return value, offset

    def text(self, value: int, offset: int) -> str:
        """The content of a text string whose head was just read."""
        if value > self._max_string:
            raise TooLarge(f"text string of {value} bytes exceeds {self._max_string} (at byte {offset})")
        raw = self.take(value, offset, "text string")
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.fail("text string is not valid UTF-8", offset) from None

    # -- items ---------------------------------------------------------------

    def item(self, depth: int = 0) -> Any:
        """Decode the next data item."""
        if depth > self._max_depth:
            raise self.fail(f"nesting deeper than {self._max_depth}")
        major, value, offset = self.read_head()
        if major == MAJOR_TEXT:
            return self.text(value, offset)
        if major == MAJOR_UINT:
            return value
        if major == MAJOR_MAP:
            return self.map_body(value, offset, depth)
        if major == MAJOR_TAG:
            handler = self.tags.get(value)
            if handler is None:
                raise self.fail(f"unsupported CBOR tag {value}", offset)
            return handler(self, value, offset, depth + 1)
        if major == MAJOR_NINT:
            return -1 - value
        if major == MAJOR_BYTES:
            if value > self._max_string:
                raise TooLarge(f"byte string of {value} bytes exceeds {self._max_string} (at byte {offset})")
            return bytes(self.take(value, offset, "byte string"))
        if major == MAJOR_ARRAY:
            self._check_count(value, offset)
            return [self.item(depth + 1) for _ in range(value)]
        return self._simple(value, offset)

    def map_body(self, count: int, offset: int, depth: int) -> dict[str, Any]:
        """The entries of a map whose head was just read; keys must be unique text strings."""
        self._check_count(count, offset)
        result: dict[str, Any] = {}
        for _ in range(count):
            major, key_value, key_offset = self.read_head()
            if major != MAJOR_TEXT:
                raise self.fail(f"expected a text-string map key, found {_MAJOR_NAMES[major]}", key_offset)
            key = self.text(key_value, key_offset)
            if key in result:
                raise self.fail(f"duplicate map key {key!r}", key_offset)
            result[key] = self.item(depth + 1)
        return result

    def _check_count(self, count: int, offset: int) -> None:
        # every entry needs at least one byte: refuse absurd counts before looping
        if count > self.end - self.pos:
            remain = self.end - self.pos
            raise self.fail(f"truncated CBOR: {count} entries declared, only {remain} bytes remain", offset)

    def _simple(self, value: int, offset: int) -> Any:
        initial = self.buf[offset] & 0x1F
        if initial == 20:
            return False
        if initial == 21:
            return True
        if initial == 22:
            return None
        if initial == 25:
            return struct.unpack(">e", value.to_bytes(2, "big"))[0]
        if initial == 26:
            return struct.unpack(">f", value.to_bytes(4, "big"))[0]
        if initial == 27:
            return struct.unpack(">d", value.to_bytes(8, "big"))[0]
        raise self.fail(f"unsupported simple value {value}", offset)


_MAJOR_NAMES = ("unsigned integer", "negative integer", "byte string", "text string", "array", "map", "tag",
                "simple value or float")


def loads(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS,
          tags: Mapping[int, TagHandler] | None = None) -> Any:
    """Decode exactly one item that fills ``data`` (a leading self-described tag is skipped)."""
    reader = Reader(data, limits, tags)
    if len(reader.buf) > limits.max_payload_bytes:
        raise TooLarge(f"payload of {len(reader.buf)} bytes exceeds {limits.max_payload_bytes}",
                       size1=limits.max_payload_bytes)
    if reader.end >= 3 and reader.buf[0] == 0xD9 and reader.buf[:3] == b"\xd9\xd9\xf7":
        reader.pos = 3
    value = reader.item()
    if reader.pos != reader.end:
        raise reader.fail(f"{reader.end - reader.pos} trailing bytes after the item")
    return value


def is_finite_number(value: Any) -> bool:
    """True for ints and finite floats (not bool)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
