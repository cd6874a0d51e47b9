"""Compression codecs: error bounds, ratios, error feedback, spec parsing and decode-side checks."""

import math

import cbor2
import numpy as np
import pytest

from edgert.bench.codecs import activation_tensor, gradient_tensor, measure
from edgert.transport import Envelope, decode_envelope, encode_envelope, get_codec
from edgert.transport.codec import NoCodec, TopKCodec
from edgert.transport.codec import round_trip as sent_as_received
from edgert.transport.envelope import decode_tensor_entry, encode_tensor_entry
from edgert.transport.errors import MalformedMessage, TooLarge, UnsupportedCodec
from edgert.transport.limits import DEFAULT_LIMITS, Limits, MiB

rng = np.random.default_rng(7)


def round_trip(array, spec):
    return decode_tensor_entry(encode_tensor_entry(array, spec))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4), (2, 3, 5, 7), (0, 4)])
@pytest.mark.parametrize("spec", ["fp16", "int8", "int8:axis=1", "int8:axis=-1", "int4", "int4:axis=1",
                                  "topk:ratio=0.5", "topk:k=3"])
def test_every_codec_round_trips_within_its_bound(dtype, shape, spec):
    array = np.asarray(rng.standard_normal(shape) * 3).astype(dtype)
    back = round_trip(array, spec)
    assert back.dtype == array.dtype and back.shape == array.shape
    if not array.size:
        return
    err = np.abs(back.astype(np.float64) - array.astype(np.float64))
    if spec == "fp16":
        assert np.all(err <= np.abs(array.astype(np.float64)) * 1e-3 + 1e-7)
    elif spec.startswith(("int8", "int4")):
        levels = 255 if spec.startswith("int8") else 15
        axis = None
        if ":" in spec:
            wanted = int(spec.split("=")[1])
            wanted = wanted + array.ndim if wanted < 0 else wanted
            axis = wanted if 0 <= wanted < array.ndim else None
        reduce = None if axis is None else tuple(i for i in range(array.ndim) if i != axis)
        data = array.astype(np.float64)
        lo = np.minimum(data.min(axis=reduce, keepdims=True), 0)
        hi = np.maximum(data.max(axis=reduce, keepdims=True), 0)
        step = np.where(hi > lo, (hi - lo) / levels, 1.0)
        slack = 1e-3 if dtype == "float16" else 1e-5
        assert np.all(err <= step * (0.5 + slack) + np.abs(data) * (1e-3 if dtype == "float16" else 0))
    else:
        kept = np.count_nonzero(back)
        assert kept <= max(3, math.ceil(0.5 * array.size))
        assert np.all((back == 0) | (back == array))


def test_ratios_and_the_int8_per_channel_target():
    activations = activation_tensor(1 * MiB)
    int8 = measure("int8:axis=1", activations)
    assert int8.ratio >= 3.9 and int8.rel_rms <= 0.01
    assert measure("fp16", activations).ratio == pytest.approx(2.0, rel=1e-3)
    assert measure("int4", activations).ratio == pytest.approx(8.0, rel=1e-2)
    assert measure("topk:ratio=0.01", gradient_tensor(1 * MiB)).ratio == pytest.approx(50.0, rel=1e-2)
    assert measure("none", activations).rel_rms == 0.0


def test_int8_per_channel_beats_per_tensor_on_uneven_channels():
    x = np.stack([rng.standard_normal((8, 8)) * s for s in (0.01, 1.0, 100.0)], axis=1).astype(np.float32)
    per_tensor, per_channel = measure("int8", x), measure("int8:axis=1", x)
    assert per_channel.rel_rms < per_tensor.rel_rms


def test_constant_and_extreme_inputs():
    for array in (np.zeros((4, 4), np.float32), np.full((3, 5), -2.5, np.float32), np.full(9, 1e30, np.float32)):
        for spec in ("int8", "int8:axis=1", "int4"):
            back = round_trip(array, spec)
            assert np.allclose(back, array, rtol=0.01)
    with pytest.raises(ValueError, match="inf or nan"):
        encode_tensor_entry(np.array([1.0, np.inf], np.float32), "int8")


def test_topk_error_feedback_keeps_the_residual():
    codec = TopKCodec(ratio=0.1)
    total_in = np.zeros(200, np.float64)
    total_out = np.zeros(200, np.float64)
    for step in range(30):
        grad = rng.standard_normal(200).astype(np.float32)
        wire = encode_envelope(Envelope("gradients", step=step, tensors={"g": grad}), codec)
        out = decode_envelope(wire).tensors["g"]
        total_in += grad
        total_out += out
        assert np.count_nonzero(out) <= 20
    assert np.allclose(total_in - total_out, codec.residual("g"), atol=1e-3)
    codec.reset()
    assert codec.residual("g") is None


def test_integer_tensors_are_never_compressed():
    env = Envelope("activations", tensors={"labels": np.arange(5), "x": np.ones(4, np.float32)})
    back = decode_envelope(encode_envelope(env, "int8"))
    assert back.codecs == {"labels": "none", "x": "int8"}
    assert np.array_equal(back.tensors["labels"], np.arange(5))


def test_codec_spec_parsing():
    assert get_codec("int8:axis=1").spec == "int8:axis=1"
    assert get_codec("topk:ratio=0.05").spec == "topk:ratio=0.05"
    assert get_codec("topk:k=10").spec == "topk:k=10"
    assert get_codec(None).spec == "none"
    assert get_codec("topk:0.1").spec == "topk:ratio=0.1"  # the bare value is the codec's first parameter
    assert get_codec("int4:1").spec == "int4:axis=1"
    for spec, message in [("zip", "unknown codec 'zip'"), ("int8:axis", "must be key=value"),
                          ("fp16:1", "must be key=value$"), ("topk:0.1,0.2", "must be key=value"),
                          ("int8:axis=x", "not a number"), ("topk:ratio=2", "ratio must be in"),
                          ("topk:ratio=0.1,k=3", "not both"), ("fp16:axis=1", "bad parameters")]:
        with pytest.raises(ValueError, match=message):
            get_codec(spec)
    per_tensor = cbor2.loads(encode_tensor_entry(np.zeros((2, 2), np.float32), "int8:axis=3"))
    assert "axis" not in per_tensor and list(per_tensor["scale"].value[0]) == [1]  # no such axis: per tensor
    with pytest.raises(TypeError, match="expected a numpy ndarray"):
        encode_tensor_entry(np.float32(1), "int8")


def coded(codec, **fields):
    entry = {"codec": codec, "dtype": "float32", "shape": [2, 2]}
    entry.update(fields)
    return cbor2.dumps(entry)


def typed(tag, data, dims):
    return cbor2.CBORTag(40, [dims, cbor2.CBORTag(tag, data)])


GOOD_Q = typed(72, b"\x00\x01\x02\x03", [2, 2])
ONE_SCALE = typed(85, np.float32([0.5]).tobytes(), [1])
ONE_ZERO = typed(72, b"\x00", [1])


@pytest.mark.parametrize("data, error, message", [
    (coded("zstd"), UnsupportedCodec, "codec 'zstd' is not supported"),
    (coded("int8", dtype="int32", q=GOOD_Q, scale=ONE_SCALE, zero=ONE_ZERO), MalformedMessage, "dtype must be one of"),
    (coded("int8", q=GOOD_Q, scale=typed(85, np.float32([-1]).tobytes(), [1]), zero=ONE_ZERO), MalformedMessage,
     "finite and positive"),
    (coded("int8", q=GOOD_Q, scale=typed(85, np.float32([np.nan]).tobytes(), [1]), zero=ONE_ZERO), MalformedMessage,
     "finite and positive"),
    (coded("int4", q=typed(64, b"\x00\x00", [2]), scale=ONE_SCALE, zero=typed(72, b"\x09", [1])), MalformedMessage,
     "zero points must lie in"),
    (coded("int8", q=typed(72, b"\x00" * 3, [3]), scale=ONE_SCALE, zero=ONE_ZERO), MalformedMessage,
     "must be int8[2, 2]"),
    (coded("int8", q=GOOD_Q, scale=ONE_SCALE, zero=ONE_ZERO, axis=5), MalformedMessage, "axis 5 is invalid"),
    (coded("int8", q=GOOD_Q, scale=ONE_SCALE), MalformedMessage, "'zero' must be a tensor"),
    (coded("topk", index=typed(70, np.uint32([9]).tobytes(), [1]), value=typed(85, np.float32([1]).tobytes(), [1])),
     MalformedMessage, "index 9 out of range"),
    (coded("topk", index=typed(70, np.uint32([2, 1]).tobytes(), [2]),
           value=typed(85, np.float32([1, 2]).tobytes(), [2])),
     MalformedMessage, "strictly increasing"),
    (coded("topk", index=typed(70, np.uint32([1]).tobytes(), [1]), value=typed(85, np.float32([1, 2]).tobytes(), [2])),
     MalformedMessage, "'value' must be a float tensor"),
    (coded("fp16", data=typed(85, b"\x00" * 16, [2, 2])), MalformedMessage, "must be float16[2, 2]"),
    (coded("none"), MalformedMessage, "sent as a bare tensor"),
    (cbor2.dumps({"codec": "topk", "dtype": "float32", "shape": [1 << 40],
                  "index": typed(70, b"", [0]), "value": typed(85, b"", [0])}), TooLarge, "decoded bytes"),
    (cbor2.dumps({"codec": "int8", "shape": [1]}), MalformedMessage, "needs text 'codec' and 'dtype'"),
    (cbor2.dumps({"codec": "int8", "dtype": "float32", "shape": [True]}), MalformedMessage, "'shape' must be"),
])
def test_decoders_refuse_inconsistent_fields(data, error, message):
    with pytest.raises(error) as info:
        decode_tensor_entry(data, DEFAULT_LIMITS)
    assert message in info.value.diagnostic


def test_decoded_size_is_checked_before_allocation():
    data = coded("topk", shape=[4096, 4096], index=typed(70, b"", [0]), value=typed(85, b"", [0]))
    with pytest.raises(TooLarge):
        decode_tensor_entry(data, Limits(max_tensor_bytes=1 << 20))


@pytest.mark.parametrize("spec", ["int8", "topk:0.25"])
def test_a_round_trip_is_what_the_receiver_decodes_and_encodes_once(spec):
    """A sender that also uses its tensor as sent (a group member) gets exactly what the receiver decodes, and a
    top-k residual advances once per send, not twice."""
    codec = get_codec(spec)
    value = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    sent, precoded = sent_as_received(codec, "gradient", value, DEFAULT_LIMITS)
    received = decode_envelope(encode_envelope(Envelope("group_gradients", tensors={"gradient": value}),
                                               {"gradient": precoded})).tensors["gradient"]
    np.testing.assert_array_equal(sent, received)
    assert not np.array_equal(sent, value)
    if isinstance(codec, TopKCodec):
        np.testing.assert_array_equal(codec.residual("gradient"), value - sent)  # one encode's residual
    unchanged, same = sent_as_received(NoCodec(), "gradient", value, DEFAULT_LIMITS)
    assert unchanged is value and isinstance(same, NoCodec)
