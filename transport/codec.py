"""Compression codecs for tensors crossing a link (AccEPT-style bit-level compression).

A codec is chosen per link and per direction (the plan decides, e.g. ``int8:axis=1``
forward, ``topk:ratio=0.01`` backward) and the envelope names it per tensor, so
the receiver never guesses. Codecs apply to floating-point tensors; integer
tensors always travel uncompressed.

==========  =========================================================  ==========
spec        what is sent                                               state
==========  =========================================================  ==========
``none``    the tensor itself                                          none
``fp16``    float16 values                                             none
``int8``    int8 codes, affine ``x = (q - zero) * scale`` (ONNX         none
            DequantizeLinear semantics); per tensor, or per channel
            with ``int8:axis=1`` or ``int8:1`` (per tensor for
            tensors without that axis)
``int4``    as int8 with codes in [-8, 7], two per byte (low nibble      none
            first), ``int4:axis=1`` for per channel
``topk``    the k largest-magnitude entries of ``x + residual`` as      residual per
            (flat index, value); the rest is kept as residual and        tensor name
            added next time (error feedback); ``topk:ratio=0.01``
            (or ``topk:0.01``) or ``topk:k=1000``
==========  =========================================================  ==========

Encoders are objects (:func:`get_codec`), decoders are stateless
(:func:`decode_coded`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from edgert.transport.errors import MalformedMessage, TooLarge, UnsupportedCodec
from edgert.transport.limits import Limits

FLOAT_DTYPES = ("float16", "float32", "float64")


class Codec(ABC):
    """Encodes one float tensor into codec fields; ``spec`` round-trips through :func:`get_codec`."""

    name: ClassVar[str]
    positional: ClassVar[str | None] = None
    """The parameter a bare value in a spec stands for (``topk:0.1`` is ``topk:ratio=0.1``)."""

    @property
    def spec(self) -> str:
        """The canonical spec string, e.g. ``int8:axis=1``."""
        return self.name

    def applies_to(self, array: np.ndarray) -> bool:
        """Whether this codec compresses ``array`` (floats only); others are sent as ``none``."""
        return array.dtype.name in FLOAT_DTYPES

    @abstractmethod
    def encode(self, name: str, array: np.ndarray) -> dict[str, Any]:
        """The codec fields for ``array`` (numpy arrays and numbers), without codec/dtype/shape."""

    def reset(self) -> None:  # noqa: B027  (deliberately a no-op for stateless codecs)
        """Forget any state (error-feedback residuals); stateless codecs do nothing."""

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"


class NoCodec(Codec):
    """The tensor is sent as it is."""

    name = "none"

    def applies_to(self, array: np.ndarray) -> bool:
        return False

    def encode(self, name: str, array: np.ndarray) -> dict[str, Any]:
        raise RuntimeError("the none codec writes bare tensors; encode_envelope handles it")


class Fp16Codec(Codec):
    """float16 values; exact for float16 input, ~1e-3 relative error for float32."""

    name = "fp16"

    def applies_to(self, array: np.ndarray) -> bool:
        return array.dtype.name in ("float32", "float64")

    def encode(self, name: str, array: np.ndarray) -> dict[str, Any]:
        return {"data": array.astype(np.float16)}

    @staticmethod
    def decode(fields: Mapping[str, Any], dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        data = _field_array(fields, "data", "float16", shape)
        return data.astype(dtype)


class AffineCodec(Codec):
    """Shared affine quantisation for int8 and int4: per tensor, or per channel along ``axis``."""

    qmin: ClassVar[int]
    qmax: ClassVar[int]
    positional = "axis"

    def __init__(self, axis: int | None = None) -> None:
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise ValueError(f"{self.name}: axis must be an int or None, got {axis!r}")
        self.axis = axis

    @property
    def spec(self) -> str:
        return self.name if self.axis is None else f"{self.name}:axis={self.axis}"

    def encode(self, name: str, array: np.ndarray) -> dict[str, Any]:
        axis = self._axis_for(array)
        scale, zero = self._params(array, axis)
        codes = self._quantise(array, axis, scale, zero)
        fields: dict[str, Any] = {"q": self._pack(codes), "scale": scale, "zero": zero}
        if axis is not None:
            fields["axis"] = axis
        return fields

    def _axis_for(self, array: np.ndarray) -> int | None:
        """The channel axis for ``array``; None (per tensor) if it has no such axis (biases, scalars)."""
        if self.axis is None:
            return None
        axis = self.axis + array.ndim if self.axis < 0 else self.axis
        return axis if 0 <= axis < array.ndim else None

    def _params(self, array: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel (or single) float32 scale and integer zero point; the range always includes 0."""
        if array.size == 0:
            channels = 1 if axis is None else array.shape[axis]
            return np.ones(channels, np.float32), np.zeros(channels, np.int8)
        reduce = None if axis is None else tuple(i for i in range(array.ndim) if i != axis)
        lo = np.minimum(np.min(array, axis=reduce), 0).astype(np.float64).reshape(-1)
        hi = np.maximum(np.max(array, axis=reduce), 0).astype(np.float64).reshape(-1)
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
            raise ValueError(f"{self.spec}: cannot quantise a tensor holding inf or nan")
        scale = (hi - lo) / (self.qmax - self.qmin)
        scale[scale == 0] = 1.0
        zero = np.clip(np.round(self.qmin - lo / scale), self.qmin, self.qmax)
        return scale.astype(np.float32), zero.astype(np.int8)

    def _quantise(self, array: np.ndarray, axis: int | None, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
        shape = _channel_shape(array.ndim, axis)
        work = np.asarray(np.multiply(array, (1.0 / scale).reshape(shape), dtype=np.float32))  # 0-d stays an array
        np.rint(work, out=work)
        work += zero.reshape(shape)
        np.clip(work, self.qmin, self.qmax, out=work)
        return work.astype(np.int8)

    @abstractmethod
    def _pack(self, codes: np.ndarray) -> np.ndarray:
        """The wire form of the int8 codes."""

    @classmethod
    def decode(cls, fields: Mapping[str, Any], dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        axis = fields.get("axis")
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool) or not 0 <= axis < len(shape)):
            raise MalformedMessage(f"{cls.name}: axis {axis!r} is invalid for shape {list(shape)}")
        channels = 1 if axis is None else shape[axis]
        scale = _field_array(fields, "scale", "float32", (channels,))
        zero = _field_array(fields, "zero", "int8", (channels,))
        if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
            raise MalformedMessage(f"{cls.name}: scales must be finite and positive")
        if np.any(zero < cls.qmin) or np.any(zero > cls.qmax):
            raise MalformedMessage(f"{cls.name}: zero points must lie in [{cls.qmin}, {cls.qmax}]")
        codes = cls._unpack(fields, shape)
        bshape = _channel_shape(len(shape), axis)
        out = codes.astype(np.float32)
        out -= zero.reshape(bshape)
        out *= scale.reshape(bshape)
        return out.astype(dtype, copy=False)

    @classmethod
    @abstractmethod
    def _unpack(cls, fields: Mapping[str, Any], shape: tuple[int, ...]) -> np.ndarray:
        """The int8 codes (shape ``shape``) from the wire form, validated."""


class Int8Codec(AffineCodec):
    """8-bit affine codes: 4x smaller than float32."""

    name = "int8"
    qmin, qmax = -128, 127

    def _pack(self, codes: np.ndarray) -> np.ndarray:
        return codes

    @classmethod
    def _unpack(cls, fields: Mapping[str, Any], shape: tuple[int, ...]) -> np.ndarray:
        return _field_array(fields, "q", "int8", shape)


class Int4Codec(AffineCodec):
    """4-bit affine codes, two per byte (low nibble = even flat index): 8x smaller than float32."""

    name = "int4"
    qmin, qmax = -8, 7

    def _pack(self, codes: np.ndarray) -> np.ndarray:
        flat = codes.reshape(-1).view(np.uint8) & 0x0F
        if flat.size % 2:
            flat = np.append(flat, np.uint8(0))
        return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)

    @classmethod
    def _unpack(cls, fields: Mapping[str, Any], shape: tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape)
        packed = _field_array(fields, "q", "uint8", ((count + 1) // 2,))
        nibbles = np.empty(packed.size * 2, np.uint8)
        nibbles[0::2] = packed & 0x0F
        nibbles[1::2] = packed >> 4
        codes = ((nibbles[:count] ^ 8).astype(np.int8) - 8).astype(np.int8)
        return codes.reshape(shape)


class TopKCodec(Codec):
    """Top-k sparsification with error feedback, for gradients; keeps a residual per tensor name."""

    name = "topk"
    positional = "ratio"

    def __init__(self, ratio: float | None = None, k: int | None = None) -> None:
        if (ratio is None) == (k is None):
            if ratio is None and k is None:
                ratio = 0.01
            else:
                raise ValueError(f"topk: give ratio or k, not both (ratio={ratio!r}, k={k!r})")
        if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"topk: ratio must be in (0, 1], got {ratio!r}")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"topk: k must be a positive int, got {k!r}")
        self.ratio = None if ratio is None else float(ratio)
        self.k = k
        self._residual: dict[str, np.ndarray] = {}

    @property
    def spec(self) -> str:
        return f"topk:k={self.k}" if self.k is not None else f"topk:ratio={self.ratio:g}"

    def reset(self) -> None:
        self._residual.clear()

    def residual(self, name: str) -> np.ndarray | None:
        """The error-feedback residual kept for ``name`` (None before the first send)."""
        return self._residual.get(name)

    def encode(self, name: str, array: np.ndarray) -> dict[str, Any]:
        acc = np.array(array, dtype=array.dtype, order="C", copy=True).reshape(-1)
        previous = self._residual.get(name)
        if previous is not None and previous.shape == acc.shape and previous.dtype == acc.dtype:
            acc += previous
        count = acc.size
        k = min(count, self.k if self.k is not None else max(1, math.ceil(self.ratio * count)))
        if k == count:
            index = np.arange(count, dtype=np.int64)
        elif k == 0:
            index = np.zeros(0, np.int64)
        else:
            index = np.argpartition(np.abs(acc), count - k)[count - k:]
            index.sort()
        values = acc[index]
        acc[index] = 0
        self._residual[name] = acc
        index_dtype = np.uint32 if count <= 0xFFFFFFFF else np.uint64
        return {"index": index.astype(index_dtype), "value": values}

    @staticmethod
    def decode(fields: Mapping[str, Any], dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape)
        index = fields.get("index")
        value = fields.get("value")
        if not isinstance(index, np.ndarray) or index.dtype.name not in ("uint32", "uint64") or index.ndim != 1:
            raise MalformedMessage("topk: 'index' must be a 1-D uint32 or uint64 tensor")
        if not isinstance(value, np.ndarray) or value.shape != index.shape or value.dtype.name not in FLOAT_DTYPES:
            raise MalformedMessage(f"topk: 'value' must be a float tensor of shape {list(index.shape)}")
        if index.size:
            if int(index[-1]) >= count:
                raise MalformedMessage(f"topk: index {int(index[-1])} out of range for {count} elements")
            if index.size > 1 and not np.all(index[1:] > index[:-1]):
                raise MalformedMessage("topk: indices must be strictly increasing")
        out = np.zeros(count, dtype=dtype)
        out[index] = value
        return out.reshape(shape)


class Precoded(Codec):
    """Fields ``codec`` computed beforehand, sent as they are: for a sender that also uses the decoded tensor
    itself (a group member sums what the others receive), so a stateful codec's residual advances once."""

    def __init__(self, codec: Codec, fields: dict[str, Any]) -> None:
        self.name = codec.name  # type: ignore[misc]  (the wire name is the codec's)
        self._spec = codec.spec
        self._fields = fields

    @property
    def spec(self) -> str:
        return self._spec

    def encode(self, name: str, array: np.ndarray) -> dict[str, Any]:
        return self._fields


def round_trip(codec: Codec, name: str, array: np.ndarray, limits: Limits) -> tuple[np.ndarray, Codec]:
    """``array`` as its receiver will decode it, and a codec that sends exactly that (``codec`` encodes once)."""
    if not codec.applies_to(array) or isinstance(codec, NoCodec):
        return array, codec
    fields = codec.encode(name, array)
    return decode_coded(codec.name, fields, array.dtype.name, array.shape, limits), Precoded(codec, fields)


CODECS: dict[str, type[Codec]] = {cls.name: cls for cls in (NoCodec, Fp16Codec, Int8Codec, Int4Codec, TopKCodec)}
_DECODERS = {"fp16": Fp16Codec.decode, "int8": Int8Codec.decode, "int4": Int4Codec.decode, "topk": TopKCodec.decode}


def get_codec(spec: str | Codec | None) -> Codec:
    """A codec from a spec (``int8``, ``int8:axis=1``, ``topk:ratio=0.01``, ``topk:k=100``, ``topk:0.01``) or
    instance; the one parser of specs, for the command line and the worker alike. Raises ValueError."""
    if spec is None:
        return NoCodec()
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"codec spec must be a str or Codec, got {type(spec).__name__}")
    name, _, params = spec.partition(":")
    cls = CODECS.get(name.strip())
    if cls is None:
        raise ValueError(f"unknown codec {name!r} in spec {spec!r} (known: {', '.join(CODECS)})")
    kwargs: dict[str, Any] = {}
    for position, item in enumerate(filter(None, (p.strip() for p in params.split(",")))):
        key, eq, raw = item.partition("=")
        if not eq and position == 0 and cls.positional is not None and _is_number(item):
            key, raw = cls.positional, item
        elif not eq:
            hint = f" or a number ({name}:{cls.positional}=N)" if cls.positional else ""
            raise ValueError(f"codec parameter {item!r} in {spec!r} must be key=value{hint}")
        kwargs[key.strip()] = _parse_number(raw.strip(), spec)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"bad parameters for codec {name!r} in {spec!r}: {exc}") from None


def _is_number(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return True


def _parse_number(raw: str, spec: str) -> int | float:
    try:
        return int(raw)
    except ValueError:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"codec parameter value {raw!r} in {spec!r} is not a number") from None


def decode_coded(codec: str, fields: Mapping[str, Any], dtype: str, shape: tuple[int, ...],
                 limits: Limits) -> np.ndarray:
    """Reconstruct a tensor from a codec entry; checks the output size against ``limits`` first."""
    decoder = _DECODERS.get(codec)
    if decoder is None:
        raise UnsupportedCodec(f"codec {codec!r} is not supported here (supported: {', '.join(CODECS)})")
    if dtype not in FLOAT_DTYPES:
        raise MalformedMessage(f"codec {codec}: dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes > limits.max_tensor_bytes:
        raise TooLarge(f"codec {codec}: decoded tensor of {nbytes} bytes exceeds {limits.max_tensor_bytes}",
                       size1=limits.max_tensor_bytes)
    return decoder(fields, np.dtype(dtype), shape)


def _field_array(fields: Mapping[str, Any], key: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    value = fields.get(key)
    if not isinstance(value, np.ndarray):
        raise MalformedMessage(f"codec field {key!r} must be a tensor, got {type(value).__name__}")
    if value.dtype.name != dtype or value.shape != tuple(shape):
        raise MalformedMessage(
            f"codec field {key!r} must be {dtype}{list(shape)}, got {value.dtype.name}{list(value.shape)}")
    return value


def _channel_shape(ndim: int, axis: int | None) -> tuple[int, ...]:
    if axis is None:
        return (1,) * ndim if ndim else ()
    return tuple(-1 if i == axis else 1 for i in range(ndim))
