"""Tensors on the wire: RFC 8746 typed arrays inside tag 40 (row-major multi-dimensional array).

A tensor is ``40([[d0, d1, ...], <typed-array tag>(h'...')])``; the typed-array
tag names element type and byte order (:data:`DTYPES`). Encoding references the
array's buffer (joined once into the message); decoding returns a numpy view over
the received payload after checking tag, dtype, ``prod(shape) * itemsize ==
len(bytes)`` and the declared limits. Views are read-only when the payload is
``bytes`` and writable when it is a ``bytearray`` (the TCP transport's case).

The writer pads with longer-than-shortest CBOR heads (valid CBOR, RFC 8949
section 3) so element data starts at a multiple of 8 bytes from the payload start;
a receiver whose payload buffer is aligned therefore gets aligned views. Unaligned
or big-endian data is copied once into a native aligned array.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgert.transport import cbor
from edgert.transport.errors import MalformedMessage, TooLarge
from edgert.transport.limits import Limits

#: Tag of an RFC 8746 row-major multi-dimensional array.
TAG_MULTIDIM = 40

#: dtype name -> (little-endian tag, big-endian tag) per RFC 8746 section 2.1.
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (64, 64),
    "uint16": (69, 65),
    "uint32": (70, 66),
    "uint64": (71, 67),
    "int8": (72, 72),
    "int16": (77, 73),
    "int32": (78, 74),
    "int64": (79, 75),
    "float16": (84, 80),
    "float32": (85, 81),
    "float64": (86, 82),
}

#: typed-array tag -> numpy dtype with explicit byte order (68 = uint8 "clamped" reads as uint8).
TAG_DTYPES: dict[int, np.dtype] = {}
for _name, (_le, _be) in DTYPES.items():
    TAG_DTYPES[_le] = np.dtype(_name).newbyteorder("<")
    TAG_DTYPES[_be] = np.dtype(_name).newbyteorder(">")
TAG_DTYPES[68] = np.dtype("uint8")

#: Every accepted in-memory dtype (either byte order) -> wire name.
_NAMES: dict[np.dtype, str] = {}
for _name in DTYPES:
    for _order in ("<", ">", "="):
        _NAMES[np.dtype(_name).newbyteorder(_order)] = _name

#: Element data starts at a multiple of this many bytes from the start of the payload.
ALIGN = 8

_NATIVE = "<" if sys.byteorder == "little" else ">"


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a supported dtype; raises ValueError naming the unsupported one."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES.get(np.dtype(dtype))
        if name is None:
            raise ValueError(f"dtype {np.dtype(dtype)} is not supported on the wire (supported: {', '.join(DTYPES)})")
    return name


def wire_array(array: np.ndarray) -> np.ndarray:
    """``array`` as a C-contiguous little-endian array of a supported dtype (a copy only if needed)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy ndarray, got {type(array).__name__}")
    name = dtype_name(array.dtype)
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and _NATIVE == ">"):
        array = array.astype(np.dtype(name).newbyteorder("<"))
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


def write_array(writer: cbor.Writer, array: np.ndarray) -> None:
    """Append ``40([dims, tag(bytes)])`` for ``array``, element data aligned to :data:`ALIGN`."""
    array = wire_array(array)
    tag = DTYPES[_NAMES[array.dtype]][0]
    shape = array.shape
    dims_bytes = cbor.head(cbor.MAJOR_ARRAY, len(shape)) + b"".join([cbor.head(cbor.MAJOR_UINT, d) for d in shape])
    nbytes = array.nbytes
    fixed = writer.size + 1 + len(dims_bytes)  # + the 0x82 array(2) head
    w40, wtag, wlen = _padded_widths((-fixed) % ALIGN, cbor.head_widths(nbytes))
    writer.write(cbor.head(cbor.MAJOR_TAG, TAG_MULTIDIM, w40) + b"\x82" + dims_bytes
                 + cbor.head(cbor.MAJOR_TAG, tag, wtag) + cbor.head(cbor.MAJOR_BYTES, nbytes, wlen))
    if nbytes:
        writer.write(memoryview(array.reshape(-1).view(np.uint8)))


_HEAD_LEN = {0: 1, 1: 2, 2: 3, 4: 5, 8: 9}


@functools.lru_cache(maxsize=64)
def _padded_widths(residue: int, length_widths: tuple[int, ...]) -> tuple[int, int, int]:
    """Widths (tag 40, typed tag, byte-string length) whose heads sum to ``residue`` mod ALIGN; shortest."""
    best = None
    for w40 in (1, 2, 4, 8):
        for wtag in (1, 2, 4, 8):
            for wlen in length_widths:
                total = _HEAD_LEN[w40] + _HEAD_LEN[wtag] + _HEAD_LEN[wlen]
                if total % ALIGN == residue and (best is None or total < best[0]):
                    best = (total, (w40, wtag, wlen))
    if best is None:  # cannot happen for ALIGN = 8, kept for safety with other alignments
        return 1, 1, length_widths[0]
    return best[1]


def read_multidim(reader: cbor.Reader, tag: int, offset: int, depth: int) -> np.ndarray:
    """Tag-40 handler: read ``[dims, typed-array]`` and return the checked view."""
    count, at = reader.expect(cbor.MAJOR_ARRAY, "a 2-element array inside tag 40")
    if count != 2:
        raise reader.fail(f"tag 40 must hold [dims, elements], found an array of {count}", at)
    dims = _read_dims(reader)
    major, typed_tag, typed_at = reader.read_head()
    if major != cbor.MAJOR_TAG or typed_tag not in TAG_DTYPES:
        what = f"tag {typed_tag}" if major == cbor.MAJOR_TAG else "an untyped element array"
        raise reader.fail(f"tag 40 elements must be an RFC 8746 typed array (tags 64-86), found {what}", typed_at)
    return _read_typed_body(reader, typed_tag, typed_at, dims)


def read_typed(reader: cbor.Reader, tag: int, offset: int, depth: int) -> np.ndarray:
    """Bare typed-array handler (tags 64-86 outside tag 40): a 1-D tensor."""
    return _read_typed_body(reader, tag, offset, None)


def _read_dims(reader: cbor.Reader) -> list[int]:
    count, at = reader.expect(cbor.MAJOR_ARRAY, "the dimensions array")
    if count > reader.limits.max_ndim:
        raise reader.fail(f"tensor has {count} dimensions, limit is {reader.limits.max_ndim}", at)
    dims = []
    for _ in range(count):
        dim, dim_at = reader.expect(cbor.MAJOR_UINT, "an unsigned dimension")
        dims.append(dim)
    return dims


def _read_typed_body(reader: cbor.Reader, tag: int, offset: int, dims: list[int] | None) -> np.ndarray:
    dtype = TAG_DTYPES[tag]
    length, at = reader.expect(cbor.MAJOR_BYTES, f"a byte string inside typed-array tag {tag}")
    limits: Limits = reader.limits
    if length > limits.max_tensor_bytes:
        raise TooLarge(f"tensor of {length} bytes exceeds {limits.max_tensor_bytes} (at byte {at})",
                       size1=limits.max_tensor_bytes)
    data = reader.take(length, at, "typed array")
    if length % dtype.itemsize:
        raise reader.fail(f"typed array of {length} bytes is not a multiple of {dtype.name}'s {dtype.itemsize}", at)
    count = length // dtype.itemsize
    shape = (count,) if dims is None else tuple(dims)
    if dims is not None and _product(dims) != count:
        raise reader.fail(
            f"shape {list(dims)} x {dtype.itemsize} bytes = {_product(dims) * dtype.itemsize} bytes, "
            f"but the typed array holds {length}", at)
    return typed_array(data, dtype, count, shape)


def typed_array(data: memoryview, dtype: np.dtype, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """The checked element bytes as an array: a view over them, or one native aligned copy if they are
    big-endian or unaligned."""
    array = np.frombuffer(data, dtype=dtype, count=count).reshape(shape)
    if dtype.byteorder not in ("=", "|", _NATIVE) or not array.flags.aligned:
        array = array.astype(dtype.newbyteorder("="), order="C")
    return array


def _product(values: Sequence[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def tensor_tags() -> dict[int, cbor.TagHandler]:
    """Tag handlers for :class:`cbor.Reader`: tag 40 and the bare typed arrays."""
    handlers: dict[int, cbor.TagHandler] = {TAG_MULTIDIM: read_multidim}
    for tag in TAG_DTYPES:
        handlers[tag] = read_typed
    return handlers


TENSOR_TAGS = tensor_tags()


def write_default(writer: cbor.Writer, obj: Any) -> bool:
    """``Writer`` fallback: encode numpy arrays as tensors and numpy scalars as plain numbers."""
    if isinstance(obj, np.ndarray):
        write_array(writer, obj)
        return True
    if isinstance(obj, np.bool_):
        writer.encode(bool(obj))
        return True
    if isinstance(obj, np.integer):
        writer.encode(int(obj))
        return True
    if isinstance(obj, np.floating):
        writer.encode(float(obj))
        return True
    return False


def encode_tensor(array: np.ndarray) -> bytes:
    """One tensor as a standalone CBOR item (tests, tools, other-language fixtures)."""
    writer = cbor.Writer(write_default)
    write_array(writer, array)
    return writer.getvalue()


def decode_tensor(data: bytes | bytearray | memoryview, limits: Limits) -> np.ndarray:
    """Decode a standalone tensor item; anything else raises :class:`MalformedMessage`."""
    value = cbor.loads(data, limits, TENSOR_TAGS)
    if not isinstance(value, np.ndarray):
        raise MalformedMessage(f"expected a tag-40 tensor, found {type(value).__name__}")
    return value
