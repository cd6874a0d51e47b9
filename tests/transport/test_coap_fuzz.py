"""Property tests against a live server: random bytes and well-formed-but-wrong envelopes.

The oracle: the server's answer equals what the local decoder says about the same
payload (2.04 if it decodes to an ``activations`` envelope, else the same error
code); never a 5.xx; and afterwards the server still answers valid requests.
"""

import socket

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgert.transport import Envelope, ResponseError, decode_envelope

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow], derandomize=True)

scalars = (st.none() | st.booleans() | st.integers(-(2**64), 2**64 - 1) | st.floats() | st.text(max_size=12)
           | st.binary(max_size=12))


@st.composite
def typed_arrays(draw):
    tag = draw(st.sampled_from([64, 65, 68, 69, 70, 71, 72, 76, 77, 78, 79, 80, 81, 84, 85, 86, 87, 100]))
    dims = draw(st.lists(st.integers(0, 4), max_size=3))
    itemsize = {0: 1, 1: 2, 2: 4, 3: 8}[(tag - 64) & 3] if 64 <= tag <= 87 else 1
    exact = int(np.prod(dims)) * itemsize
    length = draw(st.sampled_from([exact, exact, exact + 1, max(0, exact - 1), 3]))
    data = draw(st.binary(min_size=length, max_size=length))
    inner = cbor2.CBORTag(tag, data)
    shapes = [cbor2.CBORTag(40, [dims, inner]), inner, cbor2.CBORTag(40, [dims]),
              cbor2.CBORTag(40, [dims, list(data[:3])]), cbor2.CBORTag(41, [dims, inner])]
    return shapes[draw(st.integers(0, len(shapes) - 1))]  # (CBORTags are unhashable: no sampled_from)


@st.composite
def codec_maps(draw):
    entry = {"codec": draw(st.sampled_from(["fp16", "int8", "int4", "topk", "none", "zstd", 5])),
             "dtype": draw(st.sampled_from(["float32", "float16", "int8", "bogus"])),
             "shape": draw(st.lists(st.integers(0, 4), max_size=3) | scalars)}
    for key in draw(st.lists(st.sampled_from(["data", "q", "scale", "zero", "axis", "index", "value", "x"]),
                             max_size=4, unique=True)):
        entry[key] = draw(typed_arrays() | st.integers(-2, 5) | scalars)
    return entry


tensor_entries = typed_arrays() | codec_maps() | scalars


@st.composite
def wrong_envelopes(draw):
    """A valid envelope with one layer broken: the header, the tensors, the meta map, or several."""
    item = {"v": 1, "kind": "activations", "run_id": "r", "step": 1, "microbatch": 0, "stage": 0,
            "tensors": {"x": cbor2.CBORTag(40, [[2], cbor2.CBORTag(85, b"\x00" * 8)])}}
    focus = draw(st.sampled_from(["header", "tensors", "tensors", "tensors", "meta", "all"]))
    if focus in ("header", "all"):
        for key in draw(st.lists(st.sampled_from(sorted(item)), max_size=2, unique=True)):
            del item[key]
        for key in draw(st.lists(st.sampled_from(["v", "kind", "step", "stage", "extra", "tensors"]),
                                 max_size=2, unique=True)):
            item[key] = draw(scalars | st.lists(scalars, max_size=3)
                             | st.dictionaries(st.text(max_size=4), scalars, max_size=3))
        if draw(st.booleans()):
            item["kind"] = draw(st.sampled_from(["activations", "gradients", "Bad Kind", ""]))
    if focus in ("tensors", "all"):
        item["tensors"] = draw(st.dictionaries(st.text(max_size=6), tensor_entries, max_size=4))
    if focus in ("meta", "all"):
        item["meta"] = draw(st.dictionaries(st.text(max_size=4), scalars | typed_arrays()
                                            | st.lists(scalars, max_size=3), max_size=3))
    return cbor2.dumps(item)


def expected_code(payload: bytes, limits) -> str:
    """What the server must answer for this payload on /sink (kinds = activations)."""
    try:
        env = decode_envelope(payload, limits)
    except ResponseError as error:
        return error.code.dotted
    return "2.04" if env.kind == "activations" else "4.00"


def check(live, url, payload):
    response = live.client.post(url, "sink", payload, content_format=60, raise_for_status=False)
    expected = expected_code(payload, live.server.limits)
    assert response.code.dotted == expected, (response.code.dotted, response.text, payload[:80])
    assert not response.code.dotted.startswith("5")


@given(st.binary(max_size=300))
@settings(FUZZ, max_examples=250)
def test_random_bytes(live, payload):
    check(live, live.tcp, payload)


@given(wrong_envelopes())
@settings(FUZZ, max_examples=400)
def test_well_formed_but_wrong_envelopes(live, payload):
    check(live, live.tcp, payload)


@given(st.binary(max_size=200) | wrong_envelopes())
@settings(FUZZ, max_examples=60)
def test_udp_payloads(live, payload):
    check(live, live.udp, payload)


@given(st.binary(min_size=1, max_size=400))
@settings(FUZZ, max_examples=40)
def test_random_tcp_streams_after_csm(live, garbage):
    host, port = live.tcp.split("://")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(bytes.fromhex("40e123100000"))  # CSM (7.01) with Max-Message-Size 1 MiB
        sock.sendall(garbage)
        sock.settimeout(0.05)
        try:
            sock.recv(65536)
        except (TimeoutError, ConnectionError):
            pass


@given(st.binary(max_size=300))
@settings(FUZZ, max_examples=100)
def test_random_udp_datagrams(live, datagram):
    host, port = live.udp.split("://")[1].rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(datagram, (host, int(port)))


def test_server_still_serves_after_the_fuzzing(live, still_serving):
    still_serving()
    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    live.client.send(live.tcp, "sink", Envelope("activations", step=9, tensors={"x": x}), codec="int8:axis=1")
    assert live.received[-1].step == 9 and np.abs(live.received[-1].tensors["x"] - x).max() < 0.05
