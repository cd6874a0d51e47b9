"""The CBOR subset: round trips, interop with cbor2 both ways, and refusal of every malformed input."""

import math
import types

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgert.transport import cbor
from edgert.transport.errors import MalformedMessage, TooLarge
from edgert.transport.limits import Limits

json_like = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=25,
)


@given(json_like)
@settings(max_examples=300, deadline=None, derandomize=True)
def test_round_trip_and_cbor2_interop(value):
    ours = cbor.dumps(value)
    assert cbor.loads(ours) == value
    assert cbor2.loads(ours) == value
    assert cbor.loads(cbor2.dumps(value)) == value


@given(st.binary(max_size=200))
@settings(max_examples=500, deadline=None, derandomize=True)
def test_random_bytes_raise_only_transport_errors(data):
    try:
        cbor.loads(data, Limits(max_items=1000, max_depth=8))
    except (MalformedMessage, TooLarge):
        pass


@pytest.mark.parametrize("data, message", [
    (b"", "expected a data item"),
    (b"\x19\x01", "runs past the end"),
    (b"\x5f\x41a\xff", "indefinite-length"),
    (b"\x1c", "reserved additional information"),
    (b"\x44ab", "byte string of 4 bytes declared, only 2 remain"),
    (b"\xc1\x00", "unsupported CBOR tag 1"),
    (b"\xa1\x01\x02", "text-string map key"),
    (b"\xa2\x61a\x01\x61a\x02", "duplicate map key 'a'"),
    (b"\x01\x02", "1 trailing bytes"),
    (b"\x62\xff\xfe", "not valid UTF-8"),
    (b"\xf7", "unsupported simple value"),
    (b"\x9b\x00\x00\x00\x01\x00\x00\x00\x00", "4294967296 entries declared"),
    (b"\x5b\x10\x00\x00\x00\x00\x00\x00\x00", "exceeds 1048576"),
])
def test_malformed_inputs_are_named(data, message):
    with pytest.raises((MalformedMessage, TooLarge)) as info:
        cbor.loads(data)
    assert message in str(info.value)


def test_depth_and_item_limits():
    deep = b"\x81" * 100 + b"\x00"
    with pytest.raises(MalformedMessage, match="nesting deeper than 32"):
        cbor.loads(deep)
    many = cbor.dumps(list(range(50)))
    with pytest.raises(TooLarge, match="more than 20 CBOR items"):
        cbor.loads(many, Limits(max_items=20))
    with pytest.raises(TooLarge, match="exceeds 4"):
        cbor.loads(cbor.dumps("hello"), Limits(max_string_bytes=4))


def test_non_preferred_heads_and_floats_decode():
    assert cbor.loads(b"\x1b\x00\x00\x00\x00\x00\x00\x00\x05") == 5
    assert cbor.loads(b"\xd9\xd9\xf7\x05") == 5  # self-described CBOR prefix
    assert cbor.loads(b"\xf9\x3c\x00") == 1.0
    assert cbor.loads(b"\xfa\x3f\xc0\x00\x00") == 1.5
    assert math.isnan(cbor.loads(b"\xf9\x7e\x00"))
    for value in (0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1):
        for width in cbor.head_widths(value):
            head = cbor.head(cbor.MAJOR_UINT, value, width)
            assert cbor.loads(head) == value == cbor2.loads(head)


def test_encoder_refuses_what_it_cannot_represent():
    with pytest.raises(TypeError, match=r"\$\.a: map keys must be str"):
        cbor.dumps({"a": {1: 2}})
    with pytest.raises(ValueError, match="outside the CBOR 64-bit range"):
        cbor.dumps(2**64)
    with pytest.raises(TypeError, match="cannot encode set"):
        cbor.dumps({1, 2})
    with pytest.raises(TypeError, match=r"^\$\.reports\[1\]\.spans\[0\]: cannot encode set as CBOR$"):
        cbor.dumps({"reports": [{"spans": []}, {"spans": [{1}]}]})
    with pytest.raises(ValueError, match=r"^\$\.x\[2\]: integer -18446744073709551617 is outside"):
        cbor.dumps({"x": (0, 1, -(2**64) - 1)})


def test_encoder_writes_what_cbor2_reads_back():
    """Exact types, their subclasses and mappings that are not dicts all encode as the plain values."""
    class Name(str):
        pass

    class Count(int):
        pass

    value = {"text": "é", Name("sub"): Name("str"), "ints": [0, 23, 24, 2**64 - 1, -1, -(2**64), Count(7), True],
             "floats": [1.5, float("inf")],
             "nested": (None, False, b"\x00\xff", {"m": types.MappingProxyType({"k": 1})})}
    assert cbor2.loads(cbor.dumps(value)) == {
        "text": "é", "sub": "str", "ints": [0, 23, 24, 2**64 - 1, -1, -(2**64), 7, True], "floats": [1.5, float("inf")],
        "nested": [None, False, b"\x00\xff", {"m": {"k": 1}}]}
