"""Every bad request gets the right CoAP code and a diagnostic payload, and the server keeps serving."""

import cbor2
import numpy as np
import pytest
from aiocoap.numbers.codes import Code

from edgert.transport import (
    BadRequest,
    Envelope,
    InternalServerError,
    MethodNotAllowed,
    NotFound,
    TooLarge,
    UnsupportedContentFormat,
    encode_envelope,
)

pytestmark = pytest.mark.timeout(60)

GOOD = encode_envelope(Envelope("activations", tensors={"x": np.arange(8, dtype=np.float32)}))


def envelope_map(**changes):
    item = cbor2.loads(GOOD)
    item.update(changes)
    return cbor2.dumps(item)


CASES = [
    # (id, method, path, payload, content_format, expected error, code, diagnostic fragment)
    ("malformed-cbor", "POST", "sink", b"\xa1\x61", 60, BadRequest, "4.00", "truncated CBOR"),
    ("not-cbor-at-all", "POST", "sink", b"hello world", None, BadRequest, "4.00", "trailing bytes"),
    ("wrong-tag", "POST", "sink",
     envelope_map(tensors={"x": cbor2.CBORTag(41, [[2], cbor2.CBORTag(85, b"\x00" * 8)])}), 60,
     BadRequest, "4.00", "unsupported CBOR tag 41"),
    ("wrong-typed-tag", "POST", "sink",
     envelope_map(tensors={"x": cbor2.CBORTag(40, [[2], cbor2.CBORTag(87, b"\x00" * 32)])}), 60,
     BadRequest, "4.00", "found tag 87"),
    ("shape-mismatch", "POST", "sink",
     envelope_map(tensors={"x": cbor2.CBORTag(40, [[3], cbor2.CBORTag(85, b"\x00" * 8)])}), 60,
     BadRequest, "4.00", "shape [3] x 4 bytes = 12 bytes"),
    ("truncated", "POST", "sink", GOOD[:-5], 60, BadRequest, "4.00", "typed array of 32 bytes declared"),
    ("missing-field", "POST", "sink", cbor2.dumps({"v": 1}), 60, BadRequest, "4.00", "lacks field(s)"),
    ("wrong-kind", "POST", "sink", encode_envelope(Envelope("gradients")), 60, BadRequest, "4.00",
     "takes envelope kind(s) activations"),
    ("empty-post", "POST", "sink", b"", None, BadRequest, "4.00", "needs an envelope payload"),
    ("unknown-resource", "GET", "no/such/thing", b"", None, NotFound, "4.04", "no resource at /no/such/thing"),
    ("wrong-method", "DELETE", "sink", b"", None, MethodNotAllowed, "4.05", "DELETE is not allowed on /sink"),
    ("get-on-post-only", "GET", "echo", b"", None, MethodNotAllowed, "4.05", "allowed: POST"),
    ("too-many-tensors", "POST", "sink",
     encode_envelope(Envelope("activations", tensors={f"t{i}": np.zeros(1, np.uint8) for i in range(65)})), 60,
     TooLarge, "4.13", "65 tensors exceed the limit of 64"),
    ("content-format", "POST", "sink", GOOD, 0, UnsupportedContentFormat, "4.15", "takes Content-Format 60"),
    ("unknown-codec", "POST", "sink",
     envelope_map(tensors={"x": {"codec": "zstd", "dtype": "float32", "shape": [1]}}), 60,
     UnsupportedContentFormat, "4.15", "codec 'zstd' is not supported"),  # UnsupportedCodec server-side
    ("envelope-version", "POST", "sink", envelope_map(v=9), 60, UnsupportedContentFormat, "4.15", "version 9"),
    ("handler-exception", "POST", "boom", GOOD, 60, InternalServerError, "5.00", "RuntimeError: handler exploded"),
    ("handler-bad-return", "GET", "bad-return", b"", None, InternalServerError, "5.00", "handler returned int"),
]


@pytest.mark.parametrize("scheme", ["tcp", "udp"])
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_error_answers(live, still_serving, scheme, case):
    _, method, path, payload, content_format, error, code, fragment = case
    url = getattr(live, scheme)
    response = live.client.request(method, url, path, payload or None, content_format=content_format,
                                   raise_for_status=False)
    assert response.code.dotted == code
    assert response.content_format is None and fragment in response.text  # RFC 7252 diagnostic payload
    with pytest.raises(error) as info:
        response.raise_for_status()
    assert fragment in info.value.diagnostic
    still_serving()


def test_oversized_payload_is_refused_with_size1(live, still_serving):
    limit = live.server.limits.max_payload_bytes
    big = Envelope("activations", tensors={"x": np.zeros((limit + 1024) // 4, np.float32)})
    with pytest.raises(TooLarge) as info:
        live.client.send(live.tcp, "sink", big)
    assert info.value.size1 == limit and "exceeds" in info.value.diagnostic
    still_serving()


def test_oversized_blockwise_transfer_is_refused_early(live, still_serving):
    limit = live.server.limits.max_payload_bytes
    payload = bytes(limit + 10 * 1024 * 1024)  # beyond the CSM size too: aiocoap sends BERT with Size1
    response = live.client.post(live.tcp, "raw", payload, raise_for_status=False)
    assert response.code == Code.REQUEST_ENTITY_TOO_LARGE and response.size1 == limit
    assert "announced payload" in response.text
    udp_big = live.client.post(live.udp, "raw", bytes(limit + 1), raise_for_status=False)  # first Block1 says Size1
    assert udp_big.code == Code.REQUEST_ENTITY_TOO_LARGE and udp_big.size1 == limit
    udp = live.client.post(live.udp, "raw", bytes(4096), raise_for_status=False)  # small UDP transfer still fine
    assert udp.ok and udp.payload == b"4096"
    still_serving()


def test_decode_errors_in_responses_raise_on_the_client(live):
    response = live.client.post(live.tcp, "raw", b"abc")
    with pytest.raises(BadRequest):
        response.envelope()  # "3" is not an envelope
