"""coaps+tcp between real sockets: who gets in (4.01/4.03), replays, and what still works afterwards."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edgert.transport import Envelope, PeerUnreachable, TensorClient, TensorServer
from edgert.transport.errors import Forbidden, Unauthorized


class Counting:
    """A server with an open resource and a coordinator-only one, counting what reached the handlers."""

    def __init__(self, tls) -> None:
        self.calls = 0
        self.server = TensorServer("coaps+tcp://127.0.0.1:0", tls=tls)
        self.server.add_resource("echo", post=self._echo, rt="test.echo", kinds=("control", "activations"))
        self.server.add_resource("command", post=self._echo, rt="test.command", kinds=("control",),
                                 roles=("coordinator",))

    async def _echo(self, request):
        self.calls += 1
        return Envelope("control", meta={"peer": str(request.identity)})

    async def __aenter__(self) -> Counting:
        await self.server.start()
        self.url = self.server.url()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.shutdown()


def test_enrolled_peers_talk_and_know_each_other(cluster):
    async def main():
        async with Counting(cluster.tls(cluster.workers[0])) as live, \
                TensorClient(tls=cluster.tls(cluster.workers[1])) as client:
            tensor = np.arange(300_000, dtype=np.float32)  # > one TLS slice
            reply = await client.send(live.url, "echo", Envelope("activations", tensors={"x": tensor}))
            assert reply.envelope().meta["peer"] == "worker 'w1'"
            with pytest.raises(Forbidden, match="worker 'w1' may not POST /command"):
                await client.send(live.url, "command", Envelope("control"))
            async with TensorClient(tls=cluster.coordinator) as boss:
                reply = await boss.send(live.url, "command", Envelope("control"))
                assert reply.envelope().meta["peer"] == "coordinator 'coordinator'"

    asyncio.run(main())


@pytest.mark.parametrize("who", ["anonymous", "revoked"])
def test_unauthenticated_and_revoked_peers_get_401_for_everything(cluster, who):
    async def main():
        server_tls = cluster.tls(cluster.workers[0])
        server_tls.revocations.update(
            [cluster.tls(cluster.revoked).identity.serial], number=7)  # what a signed CRL would do
        client_tls = cluster.anonymous() if who == "anonymous" \
            else cluster.tls(cluster.revoked)
        async with Counting(server_tls) as live, TensorClient(tls=client_tls) as client:
            for method, path in (("POST", "echo"), ("POST", "command"), ("GET", ".well-known/core"),
                                 ("GET", "no/such/thing"), ("DELETE", "echo")):
                with pytest.raises(Unauthorized, match="no cluster credential" if who == "anonymous"
                                   else "revoked"):
                    await client.request(method, live.url, path, Envelope("control") if method == "POST" else None)
            assert live.calls == 0
            async with TensorClient(tls=cluster.tls(cluster.workers[2])) as good:
                await good.send(live.url, "echo", Envelope("control"))
            assert live.calls == 1

    asyncio.run(main())


def test_another_clusters_device_fails_the_handshake_both_ways(cluster):
    async def main():
        async with Counting(cluster.tls(cluster.workers[0])) as live:
            async with TensorClient(tls=cluster.tls(cluster.stranger)) as stranger:
                with pytest.raises(PeerUnreachable, match="TLS handshake|connection"):
                    await stranger.send(live.url, "echo", Envelope("control"), retries=0, timeout=5)
            assert live.calls == 0
        async with Counting(cluster.tls(cluster.stranger)) as fake, \
                TensorClient(tls=cluster.tls(cluster.workers[1])) as client:
            with pytest.raises(PeerUnreachable):  # a worker will not talk to a server outside its cluster
                await client.send(fake.url, "echo", Envelope("control"), retries=0, timeout=5)
            assert fake.calls == 0

    asyncio.run(main())


def test_a_client_refuses_a_revoked_server(cluster):
    async def main():
        client_tls = cluster.tls(cluster.workers[1])
        client_tls.revocations.update([cluster.tls(cluster.revoked).identity.serial], number=3)
        async with Counting(cluster.tls(cluster.revoked)) as live, TensorClient(tls=client_tls) as client:
            with pytest.raises(PeerUnreachable, match="revoked"):
                await client.send(live.url, "echo", Envelope("control"), retries=0)
            assert live.calls == 0

    asyncio.run(main())


class _RecordingProxy:
    """Forwards one TCP connection to ``target`` and records what the client sent."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sent = bytearray()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader, writer) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def pump(source, sink, record: bool) -> None:
            while data := await source.read(65536):
                if record:
                    self.sent += data
                sink.write(data)
                await sink.drain()
            sink.close()

        await asyncio.gather(pump(reader, upstream_writer, True), pump(upstream_reader, writer, False),
                             return_exceptions=True)


def test_a_replayed_capture_is_rejected(cluster):
    async def main():
        async with Counting(cluster.tls(cluster.workers[0])) as live:
            port = int(live.url.rsplit(":", 1)[1])
            proxy = _RecordingProxy(port)
            proxy_port = await proxy.start()
            async with TensorClient(tls=cluster.tls(cluster.workers[1])) as client:
                await client.send(f"coaps+tcp://127.0.0.1:{proxy_port}", "echo", Envelope("control"))
            assert live.calls == 1 and len(proxy.sent) > 500
            for _ in range(3):  # the whole capture, replayed on fresh connections
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(bytes(proxy.sent))
                await writer.drain()
                try:
                    await asyncio.wait_for(reader.read(65536), 5)
                except (ConnectionError, TimeoutError):
                    pass
                writer.close()
            await asyncio.sleep(0.2)
            assert live.calls == 1  # nothing replayed reached a handler
            async with TensorClient(tls=cluster.tls(cluster.workers[2])) as client:
                await client.send(live.url, "echo", Envelope("control"))
            assert live.calls == 2
            proxy.server.close()

    asyncio.run(main())


def test_plaintext_needs_no_credentials_and_coaps_needs_them():
    with pytest.raises(ValueError, match="needs TLS credentials"):
        TensorServer("coaps+tcp://127.0.0.1:0")

    async def main():
        async with TensorClient() as client:
            with pytest.raises(PeerUnreachable, match="needs TLS credentials"):
                await client.get("coaps+tcp://127.0.0.1:9", "health", retries=0)

    asyncio.run(main())
