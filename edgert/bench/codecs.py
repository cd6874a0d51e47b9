"""The codec measurements: one codec on one tensor (:func:`measure`), the sample tensors, the codec rows.

The ``codec`` section of ``edgert bench transport``; tests/transport/test_codecs.py checks the
codecs' ratios and errors with :func:`measure` too.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgert.transport.codec import Codec, get_codec
from edgert.transport.envelope import (
    Envelope,
    decode_envelope,
    decode_tensor_entry,
    encode_envelope,
    encode_tensor_entry,
)
from edgert.transport.limits import Limits, MiB

CODECS = {
    "fp16": "fp16",
    "int8": "int8",
    "int8_channel": "int8:axis=1",
    "int4": "int4",
    "int4_channel": "int4:axis=1",
    "topk": "topk:ratio=0.01",
}


@dataclass(frozen=True)
class CodecStats:
    """What a codec did to one tensor: size ratio, error, and time."""

    codec: str
    raw_bytes: int
    wire_bytes: int
    ratio: float
    rel_rms: float
    max_abs: float
    encode_ms: float
    decode_ms: float


def measure(codec: str | Codec, array: np.ndarray, limits: Limits | None = None) -> CodecStats:
    """Encode and decode ``array`` once (fresh state for stateful codecs) and report ratio and error."""
    codec = get_codec(codec.spec if isinstance(codec, Codec) else codec)
    limits = limits or Limits(max_tensor_bytes=max(array.nbytes, 1), max_payload_bytes=max(array.nbytes * 2, 1 << 20))
    start = time.perf_counter()
    wire = encode_tensor_entry(array, codec)
    middle = time.perf_counter()
    restored = decode_tensor_entry(wire, limits)
    end = time.perf_counter()
    ref = array.astype(np.float64)
    err = restored.astype(np.float64) - ref
    rms_ref = float(np.sqrt(np.mean(ref * ref))) if ref.size else 0.0
    rms_err = float(np.sqrt(np.mean(err * err))) if err.size else 0.0
    return CodecStats(
        codec=codec.spec,
        raw_bytes=array.nbytes,
        wire_bytes=len(wire),
        ratio=array.nbytes / len(wire) if len(wire) else math.inf,
        rel_rms=rms_err / rms_ref if rms_ref else rms_err,
        max_abs=float(np.max(np.abs(err))) if err.size else 0.0,
        encode_ms=(middle - start) * 1e3,
        decode_ms=(end - middle) * 1e3,
    )


def activation_tensor(nbytes: int = 4 * MiB, seed: int = 0) -> np.ndarray:
    """A ReLU activation batch [N, 64, 32, 32] with per-channel scale and shift (what int8 per channel is for)."""
    rng = np.random.default_rng(seed)
    count = nbytes // 4
    batch = max(1, count // (64 * 32 * 32))
    scale = rng.uniform(0.2, 3.0, 64).astype(np.float32).reshape(1, 64, 1, 1)
    shift = rng.uniform(-0.5, 1.0, 64).astype(np.float32).reshape(1, 64, 1, 1)
    x = rng.standard_normal((batch, 64, 32, 32), dtype=np.float32) * scale + shift
    return np.maximum(x, 0, out=x)


def gradient_tensor(nbytes: int = 4 * MiB, seed: int = 1) -> np.ndarray:
    """A gradient-like tensor: heavy-tailed (Student t, 3 dof) values of scale 1e-3."""
    rng = np.random.default_rng(seed)
    return (rng.standard_t(3, nbytes // 4) * 1e-3).astype(np.float32)


def measure_codecs(limits: Limits, nbytes: int = 4 * MiB, reps: int = 7) -> list[dict[str, Any]]:
    """Codec rows: envelope encode+decode without a codec, then each codec's ratio, error and time."""
    rows = []
    activations = activation_tensor(nbytes)
    env = Envelope("activations", tensors={"x": activations})
    samples = []
    for _ in range(reps * 3):
        start = time.perf_counter()
        decode_envelope(encode_envelope(env), limits)
        samples.append(time.perf_counter() - start)
    rows.append({"section": "codec", "codec": "none", "tensor": "activations", "bytes": activations.nbytes,
                 "wire_bytes": len(encode_envelope(env)), "ratio": activations.nbytes / len(encode_envelope(env)),
                 "rel_rms": 0.0, "max_abs": 0.0, "ms": statistics.median(samples) * 1e3})
    for key, spec in CODECS.items():
        tensor = gradient_tensor(nbytes) if key == "topk" else activations
        stats = [measure(spec, tensor, limits) for _ in range(reps)]
        best = stats[0]
        rows.append({
            "section": "codec", "codec": key, "spec": spec, "tensor": "gradients" if key == "topk" else "activations",
            "bytes": tensor.nbytes, "wire_bytes": best.wire_bytes, "ratio": best.ratio, "rel_rms": best.rel_rms,
            "max_abs": best.max_abs, "ms": statistics.median(s.encode_ms + s.decode_ms for s in stats),
        })
    return rows
