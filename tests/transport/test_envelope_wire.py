"""The envelope: round trips, the documented wire structure, strict decoding, and validation."""

import struct

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgert.transport import Envelope, decode_envelope, encode_envelope
from edgert.transport import envelope as envelope_module
from edgert.transport.envelope import encode_envelope_parts
from edgert.transport.errors import MalformedMessage, TooLarge, UnsupportedContentFormat
from edgert.transport.limits import Limits


def make(**overrides):
    fields = dict(kind="activations", run_id="run-7", step=12, microbatch=3, stage=1,
                  tensors={"h": np.arange(6, dtype=np.float32).reshape(2, 3), "mask": np.array([1, 0], np.uint8)},
                  meta={"lr": 0.01, "tags": ["a", None, True], "nested": {"n": -5, "b": b"\x00\x01"}})
    fields.update(overrides)
    return Envelope(**fields)


def test_round_trip_keeps_every_field():
    env = make()
    back = decode_envelope(encode_envelope(env))
    assert (back.kind, back.run_id, back.step, back.microbatch, back.stage) == ("activations", "run-7", 12, 3, 1)
    assert back.meta == env.meta and back.codecs == {"h": "none", "mask": "none"}
    for name, array in env.tensors.items():
        assert np.array_equal(back.tensors[name], array) and back.tensors[name].dtype == array.dtype


def test_wire_structure_is_the_documented_map():
    item = cbor2.loads(encode_envelope(make(meta={})))
    assert list(item) == ["v", "kind", "run_id", "step", "microbatch", "stage", "tensors"]
    assert item["v"] == 1 and item["tensors"]["h"].tag == 40 and item["tensors"]["h"].value[1].tag == 85
    coded = cbor2.loads(encode_envelope(make(), {"h": "int8:axis=1"}))["tensors"]["h"]
    assert coded["codec"] == "int8" and coded["dtype"] == "float32" and coded["shape"] == [2, 3]
    assert coded["axis"] == 1 and coded["q"].value[1].tag == 72 and coded["scale"].value[1].tag == 85


def test_a_foreign_encoder_following_protocol_md_is_understood():
    foreign = cbor2.dumps({
        "v": 1, "kind": "gradients", "run_id": "r", "step": 1, "microbatch": 0, "stage": 2,
        "tensors": {"g": cbor2.CBORTag(40, [[2, 2], cbor2.CBORTag(85, struct.pack("<4f", 1, -2, 3, -4))]),
                    "q": {"codec": "int8", "dtype": "float32", "shape": [2],
                          "q": cbor2.CBORTag(40, [[2], cbor2.CBORTag(72, b"\x02\xfe")]),
                          "scale": cbor2.CBORTag(40, [[1], cbor2.CBORTag(85, struct.pack("<f", 0.5))]),
                          "zero": cbor2.CBORTag(40, [[1], cbor2.CBORTag(72, b"\x00")])}},
        "meta": {"note": "from C"},
    })
    env = decode_envelope(foreign)
    assert env.tensors["g"].tolist() == [[1, -2], [3, -4]]
    assert env.tensors["q"].tolist() == [1.0, -1.0] and env.codecs["q"] == "int8"


def test_per_message_and_per_tensor_codecs():
    env = make()
    assert decode_envelope(encode_envelope(env, "fp16")).codecs == {"h": "fp16", "mask": "none"}
    assert decode_envelope(encode_envelope(env, {"h": "int4"})).codecs == {"h": "int4", "mask": "none"}


@pytest.mark.parametrize("overrides, message", [
    ({"kind": "Activations"}, "kind must match"),
    ({"kind": ""}, "kind must match"),
    ({"run_id": 5}, "run_id must be a str"),
    ({"step": -1}, "step must be an int"),
    ({"microbatch": True}, "microbatch must be an int"),
    ({"stage": 2**63}, "stage must be an int"),
    ({"tensors": {"x": [1, 2]}}, "must be a numpy ndarray"),
    ({"tensors": {"": np.zeros(1)}}, "tensor names must be"),
    ({"tensors": {"x": np.zeros(1, bool)}}, "dtype bool is not supported"),
    ({"meta": [1]}, "meta must be a mapping"),
])
def test_envelope_checks_its_fields(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make(**overrides)


def test_meta_must_be_json_like():
    with pytest.raises(TypeError, match="send arrays as tensors"):
        encode_envelope(make(meta={"a": np.zeros(2)}))
    with pytest.raises(TypeError, match="meta.x: cannot encode object"):
        encode_envelope(make(meta={"x": object()}))


def valid_map():
    return cbor2.loads(encode_envelope(make(meta={})))


@pytest.mark.parametrize("mutate, error, message", [
    (lambda m: m.pop("step"), MalformedMessage, "lacks field(s) step"),
    (lambda m: m.update(extra=1), MalformedMessage, "unknown envelope field(s) extra"),
    (lambda m: m.update(v=2), UnsupportedContentFormat, "version 2 is not supported"),
    (lambda m: m.update(kind=7), MalformedMessage, "kind must be a text string"),
    (lambda m: m.update(step=-3), MalformedMessage, "step must be an unsigned integer"),
    (lambda m: m.update(stage=1.5), MalformedMessage, "stage must be an unsigned integer"),
    (lambda m: m.update(tensors=[1]), MalformedMessage, "tensors must be a map"),
    (lambda m: m["tensors"].update(bad=5), MalformedMessage, "must be a tag-40 tensor or a codec map"),
    (lambda m: m.update(meta=[1]), MalformedMessage, "meta must be a map"),
    (lambda m: m.update(meta={"t": m["tensors"]["h"]}), MalformedMessage, "meta.t holds a tensor"),
])
def test_decode_refuses_wrong_envelopes(mutate, error, message):
    item = valid_map()
    mutate(item)
    with pytest.raises(error) as info:
        decode_envelope(cbor2.dumps(item))
    assert message in info.value.diagnostic


def test_decode_limits():
    many = make(tensors={f"t{i}": np.zeros(1, np.float32) for i in range(10)})
    with pytest.raises(TooLarge, match="10 tensors exceed the limit of 4"):
        decode_envelope(encode_envelope(many), Limits(max_tensors=4))
    big = make(tensors={"a": np.zeros(300, np.float32), "b": np.zeros(300, np.float32)})
    with pytest.raises(TooLarge, match="decoded bytes"):
        decode_envelope(encode_envelope(big), Limits(max_decoded_bytes=2000))
    with pytest.raises(TooLarge, match="payload of"):
        decode_envelope(encode_envelope(big), Limits(max_payload_bytes=1000))
    for payload in (b"", b"\x80", cbor2.dumps([1]), encode_envelope(make())[:-3]):
        with pytest.raises(MalformedMessage):
            decode_envelope(payload)


def test_decoded_tensors_are_views_of_the_payload():
    payload = bytearray(encode_envelope(make(meta={})))
    env = decode_envelope(payload)
    assert np.shares_memory(env.tensors["h"], np.frombuffer(payload, np.uint8))
    assert env.tensors["h"].flags.aligned and env.tensors["h"].flags.writeable


def test_parts_reference_tensor_data_and_join_to_the_wire_bytes():
    env = make(tensors={"h": np.arange(50_000, dtype=np.float32), "m": np.arange(3, dtype=np.uint8)})
    parts = encode_envelope_parts(env)
    assert b"".join(parts) == encode_envelope(env)
    assert any(np.shares_memory(np.frombuffer(part, np.uint8), env.tensors["h"])
               for part in parts if isinstance(part, memoryview))
    assert all(len(part) == memoryview(part).nbytes for part in parts)  # lengths are byte counts


# -- the tensor path's envelopes, read in one pass ---------------------------------------------

DTYPE_NAMES = ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "uint64")

tensor_path_envelopes = st.builds(
    lambda kind, run_id, step, microbatch, stage, arrays: Envelope(
        kind, run_id=run_id, step=step, microbatch=microbatch, stage=stage, tensors=arrays),
    st.sampled_from(("activations", "gradients", "weights", "a.b-c_9")),
    st.text(max_size=12),
    st.integers(0, 2**63 - 1), st.integers(0, 300), st.integers(0, 70_000),
    st.dictionaries(
        st.text(min_size=1, max_size=6),
        st.builds(lambda dtype, shape: np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape),
                  st.sampled_from(DTYPE_NAMES), st.lists(st.integers(0, 5), max_size=3)),
        max_size=3),
)


def same(one, other, codecs=True):
    assert (one.kind, one.run_id, one.step, one.microbatch, one.stage) == (
        other.kind, other.run_id, other.step, other.microbatch, other.stage)
    assert one.meta == other.meta and list(one.tensors) == list(other.tensors)
    assert not codecs or one.codecs == other.codecs
    for name, array in one.tensors.items():
        assert array.dtype == other.tensors[name].dtype and array.shape == other.tensors[name].shape
        assert array.tobytes() == other.tensors[name].tobytes()  # (a flipped byte may make a NaN)


@given(tensor_path_envelopes)
@settings(max_examples=200, deadline=None, derandomize=True)
def test_the_one_pass_reader_reads_what_the_general_reader_reads(env):
    payload = bytearray(encode_envelope(env))
    fast = envelope_module._decode_canonical(memoryview(payload), Limits())  # raises if it would not take it
    same(fast, envelope_module._decode_general(payload, Limits()))
    same(fast, env, codecs=False)
    for array in fast.tensors.values():
        if array.size:  # the wire is little-endian, as this host is: every tensor is a view of the payload
            assert np.shares_memory(array, np.frombuffer(payload, np.uint8)) and array.flags.writeable


@given(tensor_path_envelopes, st.data())
@settings(max_examples=300, deadline=None, derandomize=True)
def test_the_one_pass_reader_takes_nothing_the_general_reader_refuses(env, data):
    """Any damage to a tensor-path envelope either leaves the one-pass reader out or gives the same envelope."""
    payload = bytearray(encode_envelope(env))
    damage = data.draw(st.sampled_from(("flip", "truncate", "extend")))
    if damage == "flip":
        at = data.draw(st.integers(0, len(payload) - 1))
        payload[at] = data.draw(st.integers(0, 255))
    elif damage == "truncate":
        del payload[data.draw(st.integers(0, len(payload) - 1)):]
    else:
        payload += data.draw(st.binary(min_size=1, max_size=4))
    limits = Limits()
    try:
        fast = envelope_module._decode_canonical(memoryview(payload), limits)
    except (envelope_module._NotCanonical, IndexError, UnicodeDecodeError):
        return
    same(fast, envelope_module._decode_general(payload, limits))


@pytest.mark.parametrize("limits, error, message", [
    (Limits(max_tensors=1), TooLarge, "2 tensors exceed the limit of 1"),
    (Limits(max_decoded_bytes=25), TooLarge, "decoded bytes"),
    (Limits(max_tensor_bytes=16), TooLarge, "exceeds 16"),
    (Limits(max_ndim=1), MalformedMessage, "tensor has 2 dimensions, limit is 1"),
    (Limits(max_items=20), TooLarge, "more than 20 CBOR items"),
    (Limits(max_string_bytes=4), TooLarge, "text string of 11 bytes exceeds 4"),
    (Limits(max_depth=1), MalformedMessage, "nesting deeper than 1"),
])
def test_tensor_path_envelopes_at_a_limit_get_the_general_readers_error(limits, error, message):
    payload = encode_envelope(make(meta={}))
    assert envelope_module._decode_canonical(memoryview(payload), Limits()).step == 12
    with pytest.raises(error) as info:
        decode_envelope(payload, limits)
    assert message in info.value.diagnostic
