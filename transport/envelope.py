"""The message envelope: who sent which tensors for which step, as one CBOR map.

Wire form (Content-Format 60, application/cbor; full CDDL in docs/PROTOCOL.md)::

    {"v": 1, "kind": "activations", "run_id": "r1", "step": 7, "microbatch": 2,
     "stage": 1, "tensors": {"x": <tensor>, ...}, ? "meta": {...}}

A ``<tensor>`` is a bare RFC 8746 tensor (codec ``none``) or a codec map
``{"codec": "int8", "dtype": "float32", "shape": [...], <codec fields>}``
(see :mod:`edgert.transport.codec`). :func:`decode_envelope` refuses anything
else with a :class:`~edgert.transport.errors.ResponseError` carrying the CoAP
code the server answers with.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgert.transport import cbor
from edgert.transport.codec import Codec, NoCodec, decode_coded, get_codec
from edgert.transport.errors import MalformedMessage, TooLarge, UnsupportedContentFormat
from edgert.transport.limits import DEFAULT_LIMITS, Limits
from edgert.transport.tensor import (
    TAG_DTYPES,
    TAG_MULTIDIM,
    TENSOR_TAGS,
    dtype_name,
    typed_array,
    write_array,
    write_default,
)

#: The envelope format version this module writes and reads.
VERSION = 1

#: CoAP Content-Format of an envelope: application/cbor (RFC 7049 registry, 60).
CONTENT_FORMAT = 60

#: The kinds the runtime uses; others are allowed if they match :data:`KIND_PATTERN`.
KINDS = ("activations", "gradients", "weights", "control", "health", "piece")

KIND_PATTERN = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
MAX_NAME_BYTES = 256
_U63 = 1 << 63

_REQUIRED = ("v", "kind", "run_id", "step", "microbatch", "stage", "tensors")
_OPTIONAL = ("meta",)

CodecChoice = str | Codec | Mapping[str, str | Codec] | None


@dataclass(frozen=True, eq=False)
class Envelope:
    """One message between stages: header fields, named tensors and JSON-like ``meta``.

    ``codecs`` is filled by :func:`decode_envelope` with the codec each tensor
    arrived in; :func:`encode_envelope` takes codecs from its ``codec`` argument.
    """

    kind: str
    run_id: str = ""
    step: int = 0
    microbatch: int = 0
    stage: int = 0
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    codecs: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not KIND_PATTERN.fullmatch(self.kind):
            raise ValueError(f"envelope kind must match {KIND_PATTERN.pattern}, got {self.kind!r}")
        if not isinstance(self.run_id, str) or len(self.run_id.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"run_id must be a str of at most {MAX_NAME_BYTES} bytes, got {self.run_id!r}")
        for name in ("step", "microbatch", "stage"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or not 0 <= value < _U63:
                raise ValueError(f"envelope {name} must be an int in [0, 2**63), got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.tensors, Mapping):
            raise TypeError(f"tensors must be a mapping of name to ndarray, got {type(self.tensors).__name__}")
        for name, array in self.tensors.items():
            _check_name(name)
            if not isinstance(array, np.ndarray):
                raise TypeError(f"tensor {name!r} must be a numpy ndarray, got {type(array).__name__}")
            dtype_name(array.dtype)
        if not isinstance(self.meta, Mapping):
            raise TypeError(f"meta must be a mapping, got {type(self.meta).__name__}")
        object.__setattr__(self, "tensors", dict(self.tensors))
        object.__setattr__(self, "meta", dict(self.meta))
        object.__setattr__(self, "codecs", dict(self.codecs))

    @classmethod
    def _checked(cls, **fields: Any) -> Envelope:
        """Build from fields the decoder already checked (skips re-validation on the hot path)."""
        env = object.__new__(cls)
        env.__dict__.update(fields)  # what frozen's __setattr__ refuses, and faster than object.__setattr__
        return env

    def __repr__(self) -> str:
        tensors = ", ".join(f"{n}:{a.dtype.name}{list(a.shape)}" for n, a in self.tensors.items())
        return (f"Envelope({self.kind} run={self.run_id!r} step={self.step} mb={self.microbatch} "
                f"stage={self.stage} tensors=[{tensors}] meta_keys={sorted(self.meta)})")


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"tensor names must be non-empty str of at most {MAX_NAME_BYTES} bytes, got {name!r}")


# -- encoding -------------------------------------------------------------------


def encode_envelope(env: Envelope, codec: CodecChoice = None) -> bytes:
    """The wire bytes of ``env``; ``codec`` is one codec (spec or instance) for all tensors or a per-name mapping.

    Float tensors go through their codec, everything else as ``none``. Tensor data
    is copied exactly once (into the returned bytes) when the codec is ``none``.
    Pass codec *instances* for stateful codecs (top-k) so residuals persist.
    """
    return b"".join(encode_envelope_parts(env, codec))


def encode_envelope_parts(env: Envelope, codec: CodecChoice = None) -> list[bytes | memoryview]:
    """:func:`encode_envelope` as consecutive parts whose concatenation is the wire bytes.

    ``none`` tensors are referenced (a 1-D byte ``memoryview`` of the array), not
    copied: the arrays must stay unchanged while the parts are in use.
    """
    if not isinstance(env, Envelope):
        raise TypeError(f"expected an Envelope, got {type(env).__name__}")
    pick = _codec_picker(codec)
    writer = cbor.Writer(write_default)
    writer.write(b"".join((
        b"\xa8" if env.meta else b"\xa7", _KEYS["v"], b"\x01",
        _KEYS["kind"], _text(env.kind), _KEYS["run_id"], _text(env.run_id),
        _KEYS["step"], cbor.head(cbor.MAJOR_UINT, env.step),
        _KEYS["microbatch"], cbor.head(cbor.MAJOR_UINT, env.microbatch),
        _KEYS["stage"], cbor.head(cbor.MAJOR_UINT, env.stage),
        _KEYS["tensors"], cbor.head(cbor.MAJOR_MAP, len(env.tensors)),
    )))
    for name, array in env.tensors.items():
        writer.write(_text(name))
        _write_entry(writer, name, array, pick(name))
    if env.meta:
        writer.write(_KEYS["meta"])
        _write_meta(writer, env.meta)
    return writer.parts


def _text(value: str) -> bytes:
    data = value.encode("utf-8")
    return cbor.head(cbor.MAJOR_TEXT, len(data)) + data


_KEYS = {key: _text(key) for key in _REQUIRED + _OPTIONAL}


def _codec_picker(codec: CodecChoice):
    if codec is None or isinstance(codec, (str, Codec)):
        single = get_codec(codec)
        return lambda name: single
    if isinstance(codec, Mapping):
        table = {name: get_codec(spec) for name, spec in codec.items()}
        none = NoCodec()
        return lambda name: table.get(name, none)
    raise TypeError(f"codec must be a spec, a Codec, a mapping of name to codec, or None; got {type(codec).__name__}")


def _write_entry(writer: cbor.Writer, name: str, array: np.ndarray, codec: Codec) -> None:
    if not codec.applies_to(array):
        write_array(writer, array)
        return
    fields = codec.encode(name, array)
    writer.head(cbor.MAJOR_MAP, 3 + len(fields))
    writer.encode("codec")
    writer.encode(codec.name)
    writer.encode("dtype")
    writer.encode(array.dtype.name)
    writer.encode("shape")
    writer.encode([int(d) for d in array.shape])
    for key, value in fields.items():
        writer.encode(key)
        writer.encode(value)


def _write_meta(writer: cbor.Writer, meta: Mapping[str, Any]) -> None:
    try:
        plain = cbor.Writer(_meta_default)
        plain.encode(dict(meta), "meta")
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"envelope {exc}") from None
    writer.write(plain.getvalue())  # meta holds no tensors: one small join


def _meta_default(writer: cbor.Writer, obj: Any) -> bool:
    if isinstance(obj, np.ndarray):
        raise TypeError("meta must be JSON-like; send arrays as tensors")
    return write_default(writer, obj)


def encode_tensor_entry(array: np.ndarray, codec: str | Codec | None = None, name: str = "x") -> bytes:
    """One tensor entry (bare tensor or codec map) as a standalone CBOR item."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy ndarray, got {type(array).__name__}")
    writer = cbor.Writer(write_default)
    _write_entry(writer, name, array, get_codec(codec))
    return writer.getvalue()


# -- decoding -------------------------------------------------------------------


def decode_envelope(payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Parse and check an envelope; ``none`` tensors are views over ``payload`` (no copy).

    The form the tensor path sends (no meta, bare tensors, as :func:`encode_envelope` writes it) is
    read in one pass; anything else goes to the general CBOR reader, which alone refuses. Raises
    :class:`MalformedMessage` (4.00), :class:`TooLarge` (4.13) or
    :class:`UnsupportedContentFormat` / ``UnsupportedCodec`` (4.15).
    """
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    if view.format == "B" and view.ndim == 1:
        try:
            return _decode_canonical(view, limits)
        except (_NotCanonical, IndexError, UnicodeDecodeError):
            pass  # the general reader decides, and names what is wrong
    return _decode_general(payload, limits)


def _decode_general(payload: bytes | bytearray | memoryview, limits: Limits) -> Envelope:
    """Any envelope PROTOCOL.md allows, or the error that names what is wrong with it."""
    value = cbor.loads(payload, limits, TENSOR_TAGS)
    if not isinstance(value, dict):
        raise MalformedMessage(f"an envelope is a CBOR map, found {_type_name(value)}")
    missing = [key for key in _REQUIRED if key not in value]
    if missing:
        raise MalformedMessage(f"envelope lacks field(s) {', '.join(missing)}")
    unknown = sorted(set(value) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise MalformedMessage(f"unknown envelope field(s) {', '.join(unknown)}")
    if value["v"] != VERSION or isinstance(value["v"], bool):
        raise UnsupportedContentFormat(
            f"envelope version {value['v']!r} is not supported (this endpoint speaks {VERSION})")
    header = _decode_header(value)
    tensors, codecs = _decode_tensors(value["tensors"], limits)
    meta = value.get("meta", {})
    if not isinstance(meta, dict):
        raise MalformedMessage(f"envelope meta must be a map, found {_type_name(meta)}")
    _check_meta(meta, "meta")
    return Envelope._checked(tensors=tensors, meta=meta, codecs=codecs, **header)


class _NotCanonical(Exception):
    """The payload is not in the form :func:`_decode_canonical` reads (the general reader takes it)."""


#: How an envelope without meta begins as :func:`encode_envelope` writes it: a map of 7, "v": 1, "kind".
_CANONICAL_START = b"\xa7" + _KEYS["v"] + b"\x01" + _KEYS["kind"]


def _decode_canonical(view: memoryview, limits: Limits) -> Envelope:
    """``view`` read in one pass as :func:`encode_envelope` writes an envelope without meta whose tensors
    are bare (codec ``none``): the tensor path's messages, at a fraction of the general reader's cost.

    Raises :class:`_NotCanonical` (or IndexError, UnicodeDecodeError) for any other form, and for
    anything at or past a limit, so that only the general reader ever refuses; what this returns
    is what the general reader returns for the same bytes.
    """
    end = len(view)
    start = len(_CANONICAL_START)
    if end > limits.max_payload_bytes or limits.max_depth < 2 or view[:start] != _CANONICAL_START:
        raise _NotCanonical
    text_limit = min(limits.max_string_bytes, MAX_NAME_BYTES)
    kind, pos = _canonical_text(view, start, limits.max_string_bytes)
    if KIND_PATTERN.fullmatch(kind) is None:
        raise _NotCanonical
    run_id, pos = _canonical_text(view, _canonical_key(view, pos, "run_id"), text_limit)
    step, pos = _canonical_arg(view, _canonical_key(view, pos, "step"), cbor.MAJOR_UINT)
    microbatch, pos = _canonical_arg(view, _canonical_key(view, pos, "microbatch"), cbor.MAJOR_UINT)
    stage, pos = _canonical_arg(view, _canonical_key(view, pos, "stage"), cbor.MAJOR_UINT)
    count, pos = _canonical_arg(view, _canonical_key(view, pos, "tensors"), cbor.MAJOR_MAP)
    if max(step, microbatch, stage) >= _U63 or count > limits.max_tensors:
        raise _NotCanonical
    items = 15  # the heads the general reader counts against max_items: the map, its keys and values
    decoded = 0
    tensors: dict[str, np.ndarray] = {}
    for _ in range(count):
        name, pos = _canonical_text(view, pos, text_limit)
        tag, pos = _canonical_arg(view, pos, cbor.MAJOR_TAG)
        pair, pos = _canonical_arg(view, pos, cbor.MAJOR_ARRAY)
        ndim, pos = _canonical_arg(view, pos, cbor.MAJOR_ARRAY)
        if not name or name in tensors or tag != TAG_MULTIDIM or pair != 2 or ndim > limits.max_ndim:
            raise _NotCanonical
        shape = []
        for _ in range(ndim):
            dim, pos = _canonical_arg(view, pos, cbor.MAJOR_UINT)
            shape.append(dim)
        typed, pos = _canonical_arg(view, pos, cbor.MAJOR_TAG)
        dtype = TAG_DTYPES.get(typed)
        if dtype is None:
            raise _NotCanonical
        length, pos = _canonical_arg(view, pos, cbor.MAJOR_BYTES)
        stop = pos + length
        elements = length // dtype.itemsize
        decoded += length
        items += 6 + ndim
        if (stop > end or length > limits.max_tensor_bytes or length % dtype.itemsize
                or math.prod(shape) != elements or decoded > limits.max_decoded_bytes):
            raise _NotCanonical
        tensors[name] = typed_array(view[pos:stop], dtype, elements, tuple(shape))
        pos = stop
    if pos != end or items > limits.max_items:
        raise _NotCanonical
    return Envelope._checked(kind=kind, run_id=run_id, step=step, microbatch=microbatch, stage=stage,
                             tensors=tensors, meta={}, codecs=dict.fromkeys(tensors, "none"))


def _canonical_key(view: memoryview, pos: int, key: str) -> int:
    """The position after ``key``, which must be written at ``pos``."""
    stop = pos + len(_KEYS[key])
    if view[pos:stop] != _KEYS[key]:
        raise _NotCanonical
    return stop


def _canonical_arg(view: memoryview, pos: int, major: int) -> tuple[int, int]:
    """The argument of the head at ``pos``, which must be of type ``major``, and the position after it."""
    initial = view[pos]
    info = initial & 0x1F
    if initial >> 5 != major or info > 27:
        raise _NotCanonical
    if info < 24:
        return info, pos + 1
    stop = pos + 1 + (1 << (info - 24))
    if stop > len(view):
        raise _NotCanonical
    return int.from_bytes(view[pos + 1:stop], "big"), stop


def _canonical_text(view: memoryview, pos: int, limit: int) -> tuple[str, int]:
    """The text string at ``pos`` (at most ``limit`` bytes) and the position after it."""
    length, pos = _canonical_arg(view, pos, cbor.MAJOR_TEXT)
    stop = pos + length
    if length > limit or stop > len(view):
        raise _NotCanonical
    return str(view[pos:stop], "utf-8"), stop


def _decode_header(value: dict[str, Any]) -> dict[str, Any]:
    kind, run_id = value["kind"], value["run_id"]
    if not isinstance(kind, str) or not KIND_PATTERN.fullmatch(kind):
        raise MalformedMessage(f"envelope kind must be a text string matching {KIND_PATTERN.pattern}, got {kind!r}")
    if not isinstance(run_id, str) or len(run_id.encode()) > MAX_NAME_BYTES:
        raise MalformedMessage(f"envelope run_id must be a text string of at most {MAX_NAME_BYTES} bytes")
    header = {"kind": kind, "run_id": run_id}
    for key in ("step", "microbatch", "stage"):
        number = value[key]
        if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < _U63:
            raise MalformedMessage(f"envelope {key} must be an unsigned integer below 2**63, got {_short(number)}")
        header[key] = number
    return header


def _decode_tensors(entries: Any, limits: Limits) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    if not isinstance(entries, dict):
        raise MalformedMessage(f"envelope tensors must be a map, found {_type_name(entries)}")
    if len(entries) > limits.max_tensors:
        raise TooLarge(f"{len(entries)} tensors exceed the limit of {limits.max_tensors}")
    tensors: dict[str, np.ndarray] = {}
    codecs: dict[str, str] = {}
    total = 0
    for name, entry in entries.items():
        if not name or len(name.encode()) > MAX_NAME_BYTES:
            raise MalformedMessage(f"tensor name {name[:40]!r} must be 1..{MAX_NAME_BYTES} bytes")
        array, codec = _decode_entry(name, entry, limits, limits.max_decoded_bytes - total)
        total += array.nbytes
        tensors[name] = array
        codecs[name] = codec
    return tensors, codecs


def _decode_entry(name: str, entry: Any, limits: Limits, budget: int) -> tuple[np.ndarray, str]:
    if isinstance(entry, np.ndarray):
        if entry.nbytes > budget:
            raise TooLarge(f"tensors exceed {limits.max_decoded_bytes} decoded bytes at {name!r}")
        return entry, "none"
    if not isinstance(entry, dict):
        raise MalformedMessage(f"tensor {name!r} must be a tag-40 tensor or a codec map, found {_type_name(entry)}")
    codec = entry.get("codec")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    if not isinstance(codec, str) or not isinstance(dtype, str):
        raise MalformedMessage(f"tensor {name!r}: codec map needs text 'codec' and 'dtype'")
    if (not isinstance(shape, list) or len(shape) > limits.max_ndim
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise MalformedMessage(
            f"tensor {name!r}: 'shape' must be a list of at most {limits.max_ndim} unsigned integers")
    if codec == "none":
        raise MalformedMessage(f"tensor {name!r}: codec 'none' is sent as a bare tensor, not a codec map")
    itemsize = np.dtype(dtype).itemsize if dtype in ("float16", "float32", "float64") else 0
    if math.prod(shape) * itemsize > budget:
        raise TooLarge(f"tensors exceed {limits.max_decoded_bytes} decoded bytes at {name!r}")
    fields = {k: v for k, v in entry.items() if k not in ("codec", "dtype", "shape")}
    try:
        array = decode_coded(codec, fields, dtype, tuple(shape), limits)
    except MalformedMessage as exc:
        raise MalformedMessage(f"tensor {name!r}: {exc.diagnostic}") from None
    return array, codec


def decode_tensor_entry(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """Decode a standalone tensor entry written by :func:`encode_tensor_entry`."""
    value = cbor.loads(data, limits, TENSOR_TAGS)
    return _decode_entry("x", value, limits, limits.max_decoded_bytes)[0]


def _check_meta(value: Any, path: str) -> None:
    if isinstance(value, np.ndarray):
        raise MalformedMessage(f"{path} holds a tensor; meta must be JSON-like")
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_meta(item, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_meta(item, f"{path}.{key}")


def _type_name(value: Any) -> str:
    return {dict: "a map", list: "an array", str: "a text string", bytes: "a byte string", int: "an integer",
            float: "a float", bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

