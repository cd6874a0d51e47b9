"""CoAP over TCP (RFC 8323) at the byte level: framing, fragmented delivery, over-size frames, garbage."""

import asyncio
import logging
import socket

import numpy as np
import pytest
from aiocoap import Message
from aiocoap.numbers.codes import Code
from aiocoap.transports.tcp import _serialize

from edgert.transport import Envelope, decode_envelope, encode_envelope
from edgert.transport.coap_tcp import LargeTcpConnection
from edgert.transport.framing import _frame_length, _options_end, serialize_head
from edgert.transport.incoming import IncomingMessage, parse_plain
from edgert.transport.limits import MiB
from edgert.transport.message import Response
from tests.transport.raw_peer import RawPeer, frame

pytestmark = pytest.mark.timeout(30)


def test_serialize_head_matches_aiocoap():
    for payload in (b"", b"x", b"y" * 300, b"z" * 70000):
        message = Message(code=Code.POST, payload=payload, uri_path=("a", "b"))
        message.token = b"\x05\x06"
        message.opt.content_format = 60
        assert serialize_head(message) + payload == _serialize(message)


def test_options_end_handles_partial_and_bad_input():
    data = frame(Code.POST, path=("stage", "1"), payload=b"abc")
    token_at, tkl, rest = _frame_length(data)
    total = token_at + tkl + rest
    assert data[_options_end(data, token_at + tkl, total) + 1:] == b"abc"
    assert _options_end(data[:token_at + tkl + 2], token_at + tkl, total) is None
    assert _frame_length(b"\xd0") is None and _frame_length(b"") is None
    bare = frame(Code.GET, path=("weights",))  # no payload: the options run to the end of the frame
    token_at, tkl, rest = _frame_length(bare)
    assert _options_end(bare, token_at + tkl, len(bare)) == len(bare)
    assert _options_end(bare[:-2], token_at + tkl, len(bare)) is None


@pytest.mark.parametrize("options", [
    dict(uri_path=("stage", "1", "activations")),
    dict(uri_path=("a",), content_format=60, uri_query=("k=v", "flag")),
    dict(uri_path=("é", ""), uri_host="worker-2", uri_port=5701, accept=60, content_format=0),
    dict(uri_path=("x" * 300,), content_format=65000),  # an extended option length and a 2-byte value
    dict(),
])
def test_plain_requests_are_read_off_the_frame_as_aiocoap_reads_them(options):
    message = Message(code=Code.PUT, _token=b"\xed\x01", **options)
    encoded = message.opt.encode()
    plain = parse_plain(Code.PUT, b"\xed\x01", b"\x00" + encoded, 1, 1 + len(encoded), "remote")
    message.remote = "remote"
    expected = IncomingMessage.of(message)
    assert (plain.code, plain.token, plain.path, plain.content_format, plain.query, plain.remote) == (
        expected.code, expected.token, expected.path, expected.content_format, expected.query, expected.remote)
    again = IncomingMessage.of(plain.to_message())
    assert (again.path, again.content_format, again.query) == (plain.path, plain.content_format, plain.query)


@pytest.mark.parametrize("extra", [
    dict(observe=0), dict(block2=(0, False, 6)), dict(size1=10), dict(no_response=26), dict(if_none_match=True),
])
def test_requests_with_other_options_are_left_to_aiocoap(extra):
    message = Message(code=Code.GET, uri_path=("health",), **extra)
    encoded = message.opt.encode()
    assert parse_plain(Code.GET, b"\x01", encoded, 0, len(encoded), None) is None
    bad_path = b"\xb2\xff\xfe"  # Uri-Path that is not UTF-8: aiocoap decides what it gets
    assert parse_plain(Code.GET, b"\x01", bad_path, 0, len(bad_path), None) is None
    twice = Message(code=Code.POST, uri_path=("a",), content_format=60).opt.encode() + b"\x01\x3c"
    assert parse_plain(Code.POST, b"\x01", twice, 0, len(twice), None) is None  # Content-Format twice


def test_plain_requests_skip_aiocoap_and_others_keep_it(connection):
    observe = Message(code=Code.GET, uri_path=("health",), observe=0)
    observe.token = b"\x02"
    feed(connection, frame(Code.POST, b"\x01", ("stage", "1"), payload=b"abc", content_format=60)
         + _serialize(observe), 1 << 16)
    plain, other = connection.delivered
    assert isinstance(plain, IncomingMessage) and plain.path == ("stage", "1") and plain.payload == b"abc"
    assert plain.content_format == 60 and plain.remote is connection
    assert isinstance(other, Message) and other.opt.observe == 0 and other.token == b"\x02"


@pytest.mark.parametrize("options", [dict(), dict(content_format=60), dict(size1=70_000, max_age=1)])
def test_plain_responses_are_read_off_the_frame(options):
    message = Message(code=Code.REQUEST_ENTITY_TOO_LARGE, **options)
    encoded = message.opt.encode()
    plain = parse_plain(Code.REQUEST_ENTITY_TOO_LARGE, b"\xed\x02", encoded, 0, len(encoded), None)
    response = plain.response()
    assert (response.code, response.content_format, response.size1) == (
        Code.REQUEST_ENTITY_TOO_LARGE, options.get("content_format"), options.get("size1"))
    for other in (dict(block2=(0, True, 6)), dict(etag=b"\x01"), dict(uri_path=("a",))):
        encoded = Message(code=Code.CONTENT, **other).opt.encode()
        assert parse_plain(Code.CONTENT, b"\x01", encoded, 0, len(encoded), None) is None


def test_a_plain_response_settles_its_request_and_any_other_goes_to_aiocoap(connection):
    class Ctx(type(connection._ctx)):
        def __init__(self):
            self.dispatched = []

        def _dispatch_incoming(self, conn, message):
            self.dispatched.append(message)

    connection._ctx = Ctx()
    settled = []
    token = b"\xed\x00\x00\x00\x00\x00\x00\x09"
    connection._pending[token] = settled.append
    feed(connection, frame(Code.CONTENT, token, (), payload=b"abc", content_format=60)
         + frame(Code.CHANGED, b"\x05", ()), 1 << 16)
    [response] = settled
    assert isinstance(response, Response) and response.payload == b"abc" and response.content_format == 60
    [other] = connection._ctx.dispatched  # a token aiocoap gave out: its own message, as before
    assert isinstance(other, Message) and other.code == Code.CHANGED and other.token == b"\x05"
    assert other.remote is connection


def test_fragmented_and_coalesced_frames(live):
    env = Envelope("activations", tensors={"x": np.arange(1000, dtype=np.float32)})
    body = encode_envelope(env)
    peer = RawPeer(live.tcp)
    try:
        peer.read_until(Code.CSM)
        request = frame(Code.POST, token=b"\x07", payload=body, content_format=60)
        for i in range(0, len(request), 97):  # dribble the frame in small pieces
            peer.sock.sendall(request[i:i + 97])
        answer = peer.read()
        assert answer.code == Code.CHANGED and answer.token == b"\x07"
        assert np.array_equal(decode_envelope(answer.payload).tensors["x"], env.tensors["x"])
        peer.sock.sendall(frame(Code.GET, b"\x08", ("weights",)) + frame(Code.GET, b"\x09", ("nope",)))
        assert {peer.read().token, peer.read().token} == {b"\x08", b"\x09"}
    finally:
        peer.close()


def test_over_size_frame_is_answered_with_413_and_skipped(live, still_serving):
    limit = live.server.limits.tcp_max_message_size
    peer = RawPeer(live.tcp)
    try:
        huge = frame(Code.POST, token=b"\x0a", payload=b"\x00" * (limit + 10), content_format=60)
        peer.sock.sendall(huge)
        refusal = peer.read_until(Code.REQUEST_ENTITY_TOO_LARGE)
        assert refusal.token == b"\x0a" and b"exceeds this endpoint's Max-Message-Size" in refusal.payload
        answer = peer.request(Code.GET, ("weights",), b"\x0b")  # the connection still works
        assert answer.code == Code.CONTENT
    finally:
        peer.close()
    still_serving()


@pytest.mark.parametrize("garbage", [
    b"\x0f" + b"\x00" * 20,                # token length 15
    b"\x31\x02\x01\xf0",                    # reserved option nibble
    b"\x11\x02\x01\xff",                    # payload marker without payload
    bytes(range(256)),
])
def test_garbage_frames_end_only_that_connection(live, still_serving, garbage):
    peer = RawPeer(live.tcp)
    try:
        peer.read_until(Code.CSM)
        peer.sock.sendall(garbage)
        with pytest.raises((ConnectionError, OSError)):
            while True:
                code = peer.read().code
                assert code in (Code.ABORT, Code.CONTENT, Code.NOT_FOUND, Code.BAD_REQUEST, Code.CHANGED,
                                Code.METHOD_NOT_ALLOWED)
    finally:
        peer.close()
    still_serving()


def test_request_before_csm_is_refused(live, still_serving):
    host, port = live.tcp.split("://")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(frame(Code.GET, b"\x01", ("weights",)))
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    assert b"No CSM received" in data
    still_serving()


class _Transport:
    """Collects what a connection writes."""

    def __init__(self):
        self.writes = []

    def write(self, data):
        self.writes.append(data)

    def is_closing(self):
        return False

    def close(self):
        pass


class _Ctx:
    _scheme = "coap+tcp"


@pytest.fixture
def connection():
    """A server-side LargeTcpConnection on a fake transport that has seen the peer's CSM."""
    loop = asyncio.new_event_loop()
    delivered = []
    conn = LargeTcpConnection(_Ctx(), logging.getLogger("test"), loop, is_server=True,
                              max_message_size=64 * MiB, fast_server=lambda c, m: delivered.append(m) or True)
    conn._transport = _Transport()
    conn._remote_settings = {"max-message-size": 64 * MiB}
    conn.delivered = delivered
    yield conn
    loop.close()


def feed(conn, data, chunk, hold=False):
    """Deliver ``data`` the way asyncio does for a BufferedProtocol: recv_into get_buffer(), up to ``chunk`` bytes.

    ``hold`` keeps the last buffer referenced while get_buffer() is called again, as Python 3.10
    does when it feeds decrypted TLS data (``protocols._feed_data_to_buffered_proto``).
    """
    used = []
    pos = 0
    buf = None
    while pos < len(data):
        if not hold:
            buf = None
        buf = conn.get_buffer(-1)
        count = min(len(buf), chunk, len(data) - pos)
        buf[:count] = data[pos:pos + count]
        used.append((buf.obj, count))
        pos += count
        conn.buffer_updated(count)
    return used


@pytest.mark.parametrize("trusted", [False, True], ids=["unverified", "verified"])
@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("count, chunk", [(2000, 1), (300_000, 1000), (300_000, 65536), (300_000, 1 << 22)])
def test_large_payloads_are_received_in_place(connection, count, chunk, hold, trusted):
    connection.reader.trusted = trusted  # a verified peer's payload buffer is allocated whole
    body = encode_envelope(Envelope("activations", tensors={"x": np.arange(count, dtype=np.float32)}))
    stream = (frame(Code.POST, b"\x01", payload=body, content_format=60) + frame(Code.GET, b"\x02", ("weights",))
              + frame(Code.POST, b"\x03", payload=b"tail"))
    used = feed(connection, stream, chunk, hold)
    got = connection.delivered
    assert connection._transport.writes == []  # nothing refused or aborted
    assert [m.token for m in got] == [b"\x01", b"\x02", b"\x03"]
    assert got[0].payload == body and got[2].payload == b"tail" and got[1].path == ("weights",)
    scratch = connection.reader._scratch.obj
    direct = [(target, n) for target, n in used if target is not scratch and target is not got[2].payload]
    # all but what arrived with the head went straight into a payload buffer, held view or not: a
    # verified peer's one buffer; an unverified peer's grows (64 KiB, 256 KiB, then the whole 1.2 MB
    # rather than 1 MiB and one more growth), each growth copying what arrived (a third at most), no join
    assert sum(n for _, n in direct) >= len(body) - 65536
    buffers = list({id(target): target for target, _ in direct}.values())
    assert buffers[-1] is got[0].payload
    if trusted or len(body) <= 65536:
        assert len(buffers) == 1
    else:
        assert [len(b) for b in buffers] == [65536, 262144, len(body)]
        assert sum(len(b) for b in buffers[:-1]) <= len(body) / 3
    assert decode_envelope(got[0].payload).tensors["x"][-1] == count - 1


def test_parts_are_written_by_reference(connection):
    x = np.arange(100_000, dtype=np.float32)
    parts = [b"\xa1\x61x", memoryview(x).cast("B"), b"tail"]
    message = Message(code=Code.CONTENT)
    message.token = b"\x09"
    connection._send_message(message, parts)
    writes = connection._transport.writes
    assert b"".join(writes) == _serialize(Message(code=Code.CONTENT, payload=b"".join(parts), _token=b"\x09"))
    assert any(isinstance(w, memoryview) and np.shares_memory(np.frombuffer(w, np.uint8), x) for w in writes)
    small = Message(code=Code.CONTENT, payload=b"abc", _token=b"\x0a")
    connection._send_message(small)
    assert writes[-1] == _serialize(small)
