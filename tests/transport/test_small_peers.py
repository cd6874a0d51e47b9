"""A peer that announces a small Max-Message-Size (a constrained device) gets responses in Block2 blocks that fit.

RFC 8323 section 5.3.1: no message larger than the peer's Max-Message-Size may be sent to it;
RFC 7959: a large response travels as Block2 blocks that the client asks for one by one.
"""

import pytest
from aiocoap.numbers.codes import Code

from tests.transport.raw_peer import RawPeer

pytestmark = pytest.mark.timeout(30)

WELL_KNOWN_CORE, WEIGHTS = ((".well-known", "core"), ()), (("weights",), ("bytes=6000",))


def fetch_blockwise(peer: RawPeer, path: tuple[str, ...], query: tuple[str, ...]) -> tuple[bytes, set[int]]:
    """GET ``path``, then every further Block2 block it announces; returns the body and the block sizes."""
    body, sizes, block2 = b"", set(), None
    for number in range(1000):
        response = peer.request(Code.GET, path, bytes((0x40, number % 256)), query=query, block2=block2)
        assert response.code == Code.CONTENT
        block = response.opt.block2
        if block is None:
            return body + response.payload, sizes
        assert block.block_number == number and block.start == len(body)
        body += response.payload
        sizes.add(len(response.payload))
        if not block.more:
            return body, sizes
        block2 = (number + 1, False, block.size_exponent)
    raise AssertionError("no last block")


@pytest.mark.parametrize("resource, max_size, block", [
    (WELL_KNOWN_CORE, 200, 64), (WEIGHTS, 300, 128), (WEIGHTS, 700, 512), (WEIGHTS, 1151, 512), (WEIGHTS, 1152, 1024)],
    ids=["well-known-core-200", "weights-300", "weights-700", "weights-1151", "weights-1152"])
def test_responses_fit_a_small_max_message_size(live, resource, max_size, block):
    path, query = resource
    whole = RawPeer(live.tcp)  # announces 1 MiB: one message
    expected = whole.request(Code.GET, path, b"\x01", query=query)
    assert expected.opt.block2 is None and len(expected.payload) > max_size
    small = RawPeer(live.tcp, max_message_size=max_size)
    body, sizes = fetch_blockwise(small, path, query)
    assert body == expected.payload
    assert max(small.sizes[1:]) <= max_size, f"a {max(small.sizes[1:])}-byte frame to a peer that takes {max_size}"
    assert max(sizes) == block
    whole.close()
    small.close()


def test_an_error_diagnostic_is_shortened_to_fit(live):
    small = RawPeer(live.tcp, max_message_size=200)
    path = ("x" * 250,)
    refusal = small.request(Code.GET, path, b"\x02")
    assert refusal.code == Code.NOT_FOUND and refusal.payload.startswith(b"no resource at /xxx")
    assert max(small.sizes[1:]) <= 200
    small.close()
