"""What a device written in another language meets on the wire (docs/PROTOCOL.md, sections 1 and 1.4).

Its credential file and ``cluster.pem`` are all it needs; TLS speaks ALPN ``coap``; certificates
carry no subjectAltName, so clients must not check host names; every 4.01 says Max-Age 0;
a URL without a port means the worker's port.
"""

from __future__ import annotations

import asyncio
import ssl
import threading

import aiocoap
import pytest
from aiocoap.numbers.codes import Code

from edgert.transport import Envelope, TensorServer
from edgert.transport.coap_tcp import DEFAULT_PORT
from edgert.transport.server import parse_url
from edgert.worker.worker import WorkerConfig
from tests.transport.raw_peer import RawPeer, anonymous_tls

pytestmark = pytest.mark.timeout(60)


def device_tls(credential, cluster_pem) -> ssl.SSLContext:
    """A client context built the way another TLS stack would: the credential file and cluster.pem, nothing else."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_cert_chain(credential)  # its key and its certificate (the first of the file's two)
    context.load_verify_locations(cluster_pem)
    context.check_hostname = False
    context.set_alpn_protocols(["coap"])
    return context


@pytest.fixture
def worker_like(cluster):
    """A coaps+tcp and coap:// server with w0's credential, on a loop in another thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(30)

    server = TensorServer("coaps+tcp://127.0.0.1:0", "coap://127.0.0.1:0", tls=cluster.tls(cluster.workers[0]))

    async def health(request):
        return Envelope("health", meta={"name": "w0"})

    server.add_resource("health", get=health, rt="edgert.health")
    call(server.start())
    yield call, server
    call(server.shutdown())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_a_device_needs_only_its_credential_file_and_cluster_pem(cluster, worker_like):
    _, server = worker_like
    context = device_tls(cluster.workers[1], cluster.keys / "cluster.pem")
    peer = RawPeer(server.url(), tls=context)
    assert peer.sock.selected_alpn_protocol() == "coap"
    assert "subjectAltName" not in peer.sock.getpeercert()  # nothing a host-name check could match
    assert peer.request(Code.GET, ("health",), b"\x01").code == Code.CONTENT
    peer.close()
    strict = device_tls(cluster.workers[1], cluster.keys / "cluster.pem")
    strict.check_hostname = True
    with pytest.raises(ssl.SSLCertVerificationError, match="match"):
        RawPeer(server.url(), tls=strict)


def test_every_401_carries_max_age_0(cluster, worker_like):
    call, server = worker_like
    stranger = RawPeer(server.url(), tls=anonymous_tls(cluster.coordinator.cluster_pem))
    over_tls = stranger.request(Code.GET, ("health",), b"\x01")
    assert (over_tls.code, over_tls.opt.max_age) == (Code.UNAUTHORIZED, 0)
    stranger.close()

    async def plain_udp() -> aiocoap.Message:  # a stock CoAP client, no OSCORE option
        context = await aiocoap.Context.create_client_context()
        try:
            return await context.request(aiocoap.Message(code=Code.GET, uri=server.url("coap") + "/health")).response
        finally:
            await context.shutdown()

    over_udp = call(plain_udp())
    assert (over_udp.code, over_udp.opt.max_age) == (Code.UNAUTHORIZED, 0)
    assert b"OSCORE" in over_udp.payload


def test_a_url_without_a_port_means_the_workers_port():
    assert DEFAULT_PORT == 5701
    for scheme in ("coaps+tcp", "coap+tcp", "coap"):
        assert parse_url(f"{scheme}://10.0.0.2")[2] == DEFAULT_PORT
    assert parse_url(WorkerConfig().listen)[2] == DEFAULT_PORT
