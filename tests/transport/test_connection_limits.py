"""What a peer without a credential can make a CoAP-over-TCP server hold: connections, bytes, time.

A live server on loopback with small limits (docs/SECURITY.md, "Bounded resources"), and
hand-rolled RFC 8323 peers that declare large frames, hold them, stay silent, or crowd in.
"""

import time

import pytest
from aiocoap import Message
from aiocoap.numbers.codes import PONG, Code
from aiocoap.transports.tcp import _serialize

from edgert.transport import Limits
from edgert.transport.limits import HEAD_SLACK, KiB, MiB
from tests.transport.conftest import Live
from tests.transport.raw_peer import RawPeer, head

pytestmark = pytest.mark.timeout(60)

LIMITS = Limits(max_payload_bytes=8 * MiB, max_tensor_bytes=8 * MiB, max_decoded_bytes=16 * MiB,
                max_connections=6, max_unverified_bytes=1 * MiB, frame_timeout=0.5, idle_timeout=0.5)

#: How long a timeout may take to act on this shared, loaded machine (the limits above are 0.5 s).
PROMPTLY = 5.0


@pytest.fixture(scope="module")
def guarded():
    harness = Live(LIMITS)
    try:
        yield harness
    finally:
        harness.close()


def wait_for(condition, limit: float = PROMPTLY) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def budget_used(live: Live) -> int:
    return live.server._guard.budget.used


def test_a_held_incomplete_frame_is_aborted_after_the_frame_timeout(guarded):
    peer = RawPeer(guarded.tcp)
    peer.send(head(Code.POST, b"\x01", ("raw",), 4 * MiB) + b"x" * 1000)
    seconds, data = peer.closed_after(10 * PROMPTLY)
    assert seconds < PROMPTLY, "a frame that stopped arriving kept its connection"
    assert b"incomplete message: nothing received for 0.5 s" in data


def test_a_connection_that_never_sends_its_csm_is_aborted(guarded):
    peer = RawPeer(guarded.tcp, send_csm=False)
    seconds, _ = peer.closed_after(10 * PROMPTLY)
    assert seconds < PROMPTLY


def test_an_idle_connection_is_pinged_and_kept_only_if_it_answers(guarded):
    silent, answering = RawPeer(guarded.tcp), RawPeer(guarded.tcp)
    start = time.monotonic()
    pings = 0
    while time.monotonic() - start < 4 * (LIMITS.idle_timeout + LIMITS.frame_timeout):
        ping = answering.read_until(Code.PING)
        answering.send(_serialize(Message(code=PONG, token=ping.token)))
        pings += 1
    assert pings >= 2
    seconds, data = silent.closed_after(PROMPTLY)
    assert seconds < PROMPTLY and b"no answer to Ping" in data
    assert answering.request(Code.GET, ("weights",), b"\x07").code == Code.CONTENT


def test_connections_beyond_the_cap_are_aborted_at_once(guarded):
    assert wait_for(lambda: guarded.server.unverified_connections == 0, 3 * PROMPTLY)  # earlier tests' peers gone
    peers = [RawPeer(guarded.tcp) for _ in range(LIMITS.max_connections)]
    try:
        for k, peer in enumerate(peers):
            assert peer.request(Code.GET, ("weights",), bytes([k + 1])).code == Code.CONTENT
        extra = RawPeer(guarded.tcp)
        seconds, data = extra.closed_after(PROMPTLY)
        assert seconds < 1.0 and b"too many connections" in data
        peers.pop().close()
        assert wait_for(lambda: guarded.server.unverified_connections < LIMITS.max_connections)
        late = RawPeer(guarded.tcp)
        assert late.request(Code.GET, ("weights",), b"\x09").code == Code.CONTENT
        late.close()
    finally:
        for peer in peers:
            peer.close()


def test_a_refused_request_is_answered_from_its_head_and_its_payload_never_stored(guarded):
    peer = RawPeer(guarded.tcp)
    declared = 6 * MiB
    peer.send(head(Code.POST, b"\x01", ("nowhere",), declared))
    refusal = peer.read_until(Code.NOT_FOUND)  # before a payload byte was sent
    assert refusal.token == b"\x01" and b"no resource at /nowhere" in refusal.payload
    peer.send(b"\0" * declared)  # the payload, skipped as it arrives
    peer.send(head(Code.PUT, b"\x02", ("raw",), declared))
    assert peer.read_until(Code.METHOD_NOT_ALLOWED).token == b"\x02"
    assert budget_used(guarded) == 0
    peer.send(b"\0" * declared)
    assert peer.request(Code.POST, ("raw",), b"\x03", payload=b"abc").payload == b"3"


def test_options_longer_than_the_head_slack_get_413(guarded):
    message = Message(code=Code.GET, uri_path=("weights",), uri_query=tuple("q" * 250 for _ in range(20)))
    message.token = b"\x05"
    data = _serialize(message)
    assert len(data) > HEAD_SLACK
    peer = RawPeer(guarded.tcp)
    peer.send(data)
    refusal = peer.read_until(Code.REQUEST_ENTITY_TOO_LARGE)
    assert refusal.token == b"\x05" and b"options longer than 4096 bytes" in refusal.payload
    assert peer.request(Code.GET, ("weights",), b"\x06").code == Code.CONTENT


def test_unverified_bytes_are_capped_per_server_and_given_back(guarded):
    size = 900 * KiB
    first, second = RawPeer(guarded.tcp), RawPeer(guarded.tcp)
    first.send(head(Code.POST, b"\x01", ("raw",), size) + b"a" * (size - 1))
    assert wait_for(lambda: budget_used(guarded) == size)
    second.send(head(Code.POST, b"\x02", ("raw",), size) + b"b" * (200 * KiB))
    busy = second.read_until(Code.SERVICE_UNAVAILABLE)
    assert busy.token == b"\x02" and b"busy" in busy.payload and busy.opt.max_age == 1
    first.send(b"a")
    done = first.read_until(Code.CHANGED)
    assert done.payload == str(size).encode()
    assert wait_for(lambda: budget_used(guarded) == 0)
    second.send(b"b" * (size - 200 * KiB))  # the rest of the refused frame, skipped
    assert second.request(Code.POST, ("raw",), b"\x03", payload=b"b" * size).payload == str(size).encode()
    holder = RawPeer(guarded.tcp)
    holder.send(head(Code.POST, b"\x04", ("raw",), size) + b"c" * (size // 2))
    assert wait_for(lambda: budget_used(guarded) > 0)
    holder.close()  # what a closed connection held is given back at once
    assert wait_for(lambda: budget_used(guarded) == 0, 1.0)


def test_a_payload_buffer_grows_with_the_bytes_not_the_declared_size(guarded):
    peer = RawPeer(guarded.tcp)
    peer.send(head(Code.POST, b"\x01", ("raw",), 8 * MiB - HEAD_SLACK) + b"x" * 1000)
    assert wait_for(lambda: budget_used(guarded) > 0)
    assert budget_used(guarded) == 64 * KiB  # the first buffer, not 8 MiB
    peer.close()
    assert wait_for(lambda: budget_used(guarded) == 0, 1.0)

