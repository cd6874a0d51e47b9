"""RFC 8746 tensors: every dtype, zero-copy views, alignment, foreign encodings, and every refusal."""

import struct

import cbor2
import numpy as np
import pytest

from edgert.transport import cbor, tensor
from edgert.transport.errors import MalformedMessage, TooLarge
from edgert.transport.limits import DEFAULT_LIMITS, Limits

RFC8746_LE_TAGS = {"uint8": 64, "uint16": 69, "uint32": 70, "uint64": 71, "int8": 72, "int16": 77,
                   "int32": 78, "int64": 79, "float16": 84, "float32": 85, "float64": 86}


def sample(dtype, shape):
    count = int(np.prod(shape))
    values = (np.arange(count) * 37 % 251) - (100 if np.dtype(dtype).kind in "if" else 0)
    return values.astype(dtype).reshape(shape)


def test_tag_table_matches_rfc8746():
    assert {name: tags[0] for name, tags in tensor.DTYPES.items()} == RFC8746_LE_TAGS


@pytest.mark.parametrize("dtype", list(tensor.DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4), (1, 0, 3)])
def test_every_dtype_round_trips_as_a_view(dtype, shape):
    array = sample(dtype, shape)
    data = tensor.encode_tensor(array)
    back = tensor.decode_tensor(data, DEFAULT_LIMITS)
    assert back.dtype == np.dtype(dtype) and back.shape == shape
    assert np.array_equal(back, array)
    if array.size:
        assert np.shares_memory(back, np.frombuffer(data, np.uint8))  # zero copy
        assert not back.flags.writeable  # a view over immutable bytes
    writable = tensor.decode_tensor(bytearray(data), DEFAULT_LIMITS)
    assert writable.flags.writeable or not array.size


@pytest.mark.parametrize("prefix", range(0, 17))
def test_element_data_is_aligned_whatever_precedes_it(prefix):
    array = np.arange(300, dtype=np.float64)
    writer = cbor.Writer(tensor.write_default)
    writer.encode(["p" * prefix, array])
    data = writer.getvalue()
    start = data.find(array.tobytes())
    assert start % tensor.ALIGN == 0
    decoded = cbor.loads(data, DEFAULT_LIMITS, tensor.TENSOR_TAGS)
    assert decoded[1].flags.aligned and np.array_equal(decoded[1], array)
    assert cbor2.loads(data)[1].value[1].value == array.tobytes()  # still plain CBOR for others


def test_cbor2_sees_the_documented_structure():
    array = sample("float32", (2, 3))
    item = cbor2.loads(tensor.encode_tensor(array))
    assert item.tag == 40
    dims, elements = item.value
    assert list(dims) == [2, 3] and elements.tag == 85 and elements.value == array.tobytes()


def test_foreign_encodings_decode():
    big_endian = cbor2.dumps(cbor2.CBORTag(40, [[2, 2], cbor2.CBORTag(81, struct.pack(">4f", 1, 2, 3, 4))]))
    result = tensor.decode_tensor(big_endian, DEFAULT_LIMITS)
    assert result.dtype == np.float32 and result.dtype.isnative and result.tolist() == [[1, 2], [3, 4]]
    bare = cbor2.dumps(cbor2.CBORTag(78, struct.pack("<3i", -1, 0, 7)))
    assert tensor.decode_tensor(bare, DEFAULT_LIMITS).tolist() == [-1, 0, 7]
    clamped = cbor2.dumps(cbor2.CBORTag(40, [[2], cbor2.CBORTag(68, b"\x01\xff")]))
    assert tensor.decode_tensor(clamped, DEFAULT_LIMITS).tolist() == [1, 255]


def test_non_contiguous_and_big_endian_inputs_are_encoded_little_endian():
    base = np.arange(24, dtype=">i4").reshape(4, 6)
    view = base[:, ::2]
    back = tensor.decode_tensor(tensor.encode_tensor(view), DEFAULT_LIMITS)
    assert np.array_equal(back, view) and back.dtype == np.dtype("<i4")


@pytest.mark.parametrize("item, message", [
    (cbor2.CBORTag(40, [[2, 3], cbor2.CBORTag(85, b"\x00" * 20)]), "shape [2, 3] x 4 bytes = 24 bytes"),
    (cbor2.CBORTag(40, [[3], cbor2.CBORTag(85, b"\x00" * 10)]), "not a multiple of float32"),
    (cbor2.CBORTag(40, [[2], [1.0, 2.0]]), "found an untyped element array"),
    (cbor2.CBORTag(40, [[2], cbor2.CBORTag(76, b"\x00\x00")]), "found tag 76"),
    (cbor2.CBORTag(40, [[1], cbor2.CBORTag(87, b"\x00" * 16)]), "found tag 87"),
    (cbor2.CBORTag(40, [[1, 2, 3]]), "found an array of 1"),
    (cbor2.CBORTag(40, [[-1], cbor2.CBORTag(85, b"")]), "an unsigned dimension"),
    (cbor2.CBORTag(40, [[1], cbor2.CBORTag(85, "text")]), "a byte string inside typed-array tag 85"),
    (cbor2.CBORTag(41, [[1], cbor2.CBORTag(85, b"\x00" * 4)]), "unsupported CBOR tag 41"),
    ({"x": 1}, "expected a tag-40 tensor"),
])
def test_wrong_tensors_are_refused_with_a_reason(item, message):
    with pytest.raises(MalformedMessage) as info:
        tensor.decode_tensor(cbor2.dumps(item), DEFAULT_LIMITS)
    assert message in info.value.diagnostic


def test_tensor_limits():
    with pytest.raises(TooLarge, match="exceeds 1000"):
        tensor.decode_tensor(tensor.encode_tensor(np.zeros(1000, np.float32)), Limits(max_tensor_bytes=1000))
    with pytest.raises(MalformedMessage, match="limit is 3"):
        tensor.decode_tensor(tensor.encode_tensor(np.zeros((1, 1, 1, 1))), Limits(max_ndim=3))


def test_unsupported_dtypes_are_named():
    for array in (np.zeros(2, bool), np.zeros(2, complex), np.array(["a"])):
        with pytest.raises(ValueError, match=f"dtype {array.dtype} is not supported"):
            tensor.encode_tensor(array)
    with pytest.raises(TypeError, match="expected a numpy ndarray, got list"):
        tensor.wire_array([1, 2])
