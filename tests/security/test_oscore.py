"""coap:// with OSCORE (RFC 8613) between real UDP sockets: what is on the wire, who gets in, replays, restarts."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from aiocoap import Message
from aiocoap.numbers.codes import Code

from edgert.security.keystore import HostSecurity, Keystore, local_cluster_keys
from edgert.transport import Envelope, PeerUnreachable, TensorClient, TensorServer
from edgert.transport.errors import CredentialError, Forbidden, Unauthorized
from edgert.transport.oscore_keys import OscoreKeys, state_dir
from edgert.transport.tls import OSCORE_LABEL, TlsCredentials

MARKER = "plaintext-marker-7f3a"


class Counting:
    """A coap:// server with an open resource and a coordinator-only one, counting what reached the handlers."""

    def __init__(self, tls) -> None:
        self.tls = tls
        self.calls = 0
        self.server = TensorServer("coap://127.0.0.1:0", tls=tls)
        self.server.add_resource("echo", post=self._echo, rt="test.echo", kinds=("control", "activations"))
        self.server.add_resource("command", post=self._echo, rt="test.command", kinds=("control",),
                                 roles=("coordinator",))

    async def _echo(self, request):
        self.calls += 1
        return Envelope("control", tensors=request.envelope.tensors, meta={"peer": str(request.identity)})

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def __aenter__(self) -> Counting:
        await self.server.start()
        self.url = self.server.url("coap")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.shutdown()


class _Side(asyncio.DatagramProtocol):
    def __init__(self, receive) -> None:
        self.receive = receive

    def datagram_received(self, data: bytes, addr) -> None:
        self.receive(data, addr)


class UdpProxy:
    """Relays datagrams between a client and a server port, recording what the client sent."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sent: list[bytes] = []
        self._client = None

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self.front, _ = await loop.create_datagram_endpoint(lambda: _Side(self._from_client),
                                                            local_addr=("127.0.0.1", 0))
        self.back, _ = await loop.create_datagram_endpoint(lambda: _Side(self._from_server),
                                                           remote_addr=("127.0.0.1", self.port))
        return self.front.get_extra_info("sockname")[1]

    def _from_client(self, data: bytes, addr) -> None:
        self._client = addr
        self.sent.append(data)
        self.back.sendto(data)

    def _from_server(self, data: bytes, addr) -> None:
        self.front.sendto(data, self._client)

    def close(self) -> None:
        self.front.close()
        self.back.close()


async def replay(datagrams: list[bytes], port: int) -> list[Message]:
    """Send captured datagrams from a fresh socket (as an attacker would) and collect the answers."""
    answers: list[Message] = []
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: _Side(lambda d, a: answers.append(Message.decode(d))),
                                                       remote_addr=("127.0.0.1", port))
    for data in datagrams:
        transport.sendto(data)
    for _ in range(100):
        if len(answers) >= len(datagrams):
            break
        await asyncio.sleep(0.02)
    transport.close()
    return answers


def partial_ivs(datagrams: list[bytes]) -> list[int]:
    """The OSCORE sequence numbers (Partial IV) of captured requests."""
    numbers = []
    for data in datagrams:
        option = Message.decode(data).opt.oscore
        numbers.append(int.from_bytes(option[1:1 + (option[0] & 7)], "big"))
    return numbers


@pytest.fixture(scope="module")
def host(cluster):
    """The coordinator's credentials as `edgert train` loads them (the keystore's revocation list applied)."""
    return lambda: HostSecurity.open(cluster.keys).tls


def test_coordinator_and_device_talk_and_nothing_travels_in_clear(cluster, host):
    async def main():
        async with Counting(cluster.tls(cluster.workers[0])) as worker:
            proxy = UdpProxy(worker.port)
            port = await proxy.start()
            tensor = np.arange(3000, dtype=np.float32)  # 12 kB: inner blockwise, each block protected
            async with TensorClient(tls=host()) as boss:
                url = f"coap://w0@127.0.0.1:{port}"
                reply = (await boss.send(url, "echo", Envelope("activations", tensors={"x": tensor},
                                                               meta={"note": MARKER}))).envelope()
                assert reply.meta["peer"] == "coordinator 'coordinator'"
                np.testing.assert_array_equal(reply.tensors["x"], tensor)
                await boss.send(url, "command", Envelope("control"))  # role from the OSCORE context
                links = await boss.discover(url)
                assert {link.href for link in links} == {"/echo", "/command"}
            assert worker.calls == 2
            assert len(proxy.sent) > 12
            for data in proxy.sent:
                message = Message.decode(data)
                assert message.opt.oscore is not None and message.code in (Code.POST, Code.FETCH)
                assert message.opt.uri_path == ()  # the path travels encrypted
                assert MARKER.encode() not in data and b"echo" not in data and b"activations" not in data
                assert tensor.tobytes()[4000:4032] not in data
            proxy.close()

        async with Counting(host()) as boss_server, TensorClient(tls=cluster.tls(cluster.workers[1])) as device:
            reply = await device.send(boss_server.url, "echo", Envelope("control"))
            assert reply.envelope().meta["peer"] == "worker 'w1'"
            with pytest.raises(Forbidden, match="worker 'w1' may not POST /command"):
                await device.send(boss_server.url, "command", Envelope("control"))
            assert boss_server.calls == 1

    asyncio.run(main())


@pytest.mark.parametrize("who", ["plaintext", "stranger", "another worker"])
def test_unprotected_and_unknown_peers_get_401_for_everything(cluster, host, who):
    async def main():
        client_tls = {"plaintext": None, "stranger": cluster.tls(cluster.stranger),
                      "another worker": cluster.tls(cluster.workers[1])}[who]
        expected = {"plaintext": "takes OSCORE-protected requests only", "stranger": "no OSCORE context",
                    "another worker": "from its cluster's coordinator only"}[who]
        async with Counting(cluster.tls(cluster.workers[0])) as worker, TensorClient(tls=client_tls) as client:
            for method, path in (("POST", "echo"), ("POST", "command"), ("GET", ".well-known/core"),
                                 ("GET", "no/such/thing"), ("DELETE", "echo")):
                with pytest.raises(Unauthorized, match=expected):
                    await client.request(method, worker.url, path, Envelope("control") if method == "POST" else None)
            assert worker.calls == 0
            async with TensorClient(tls=host()) as boss:  # and it keeps serving
                await boss.send(f"coap://w0@127.0.0.1:{worker.port}", "echo", Envelope("control"))
            assert worker.calls == 1
        if who == "stranger":  # the coordinator does not know another cluster's device either
            async with Counting(host()) as boss_server, TensorClient(tls=client_tls) as client:
                with pytest.raises(Unauthorized, match="not enrolled in this cluster"):
                    await client.send(boss_server.url, "echo", Envelope("control"))
                assert boss_server.calls == 0

    asyncio.run(main())


def test_a_revoked_device_gets_401_and_is_not_reached(cluster, host):
    async def main():
        async with Counting(host()) as boss_server:
            async with TensorClient(tls=cluster.tls(cluster.revoked)) as gone:
                for method, path in (("POST", "echo"), ("GET", ".well-known/core"), ("GET", "no/such/thing")):
                    with pytest.raises(Unauthorized, match="the credential of worker 'gone' is revoked"):
                        await gone.request(method, boss_server.url, path,
                                           Envelope("control") if method == "POST" else None)
            assert boss_server.calls == 0
            async with TensorClient(tls=cluster.tls(cluster.workers[3])) as w3:
                await w3.send(boss_server.url, "echo", Envelope("control"))
                assert boss_server.calls == 1
                # revoked while running (what a newer revocation list does): refused from the next request on
                boss_server.tls.revocations.update([cluster.tls(cluster.workers[3]).identity.serial], number=99)
                with pytest.raises(Unauthorized, match="worker 'w3' is revoked"):
                    await w3.send(boss_server.url, "echo", Envelope("control"))
                assert boss_server.calls == 1
        async with Counting(cluster.tls(cluster.revoked)) as revoked_server, TensorClient(tls=host()) as boss:
            with pytest.raises(CredentialError, match="no live enrolment named 'gone'"):
                await boss.send(f"coap://gone@127.0.0.1:{revoked_server.port}", "echo", Envelope("control"))
            with pytest.raises(CredentialError, match="by name: coap://NAME@host:port"):
                await boss.send("coap://127.0.0.1:9", "echo", Envelope("control"))
            assert revoked_server.calls == 0

    asyncio.run(main())


def test_the_coordinator_observes_a_device_over_oscore(cluster, host):
    async def main():
        server = TensorServer("coap://127.0.0.1:0", tls=cluster.tls(cluster.workers[0]))
        health = server.add_observable("health", rt="edgert.health", initial=Envelope("health", meta={"n": 0}))
        async with server, TensorClient(tls=host()) as boss:
            port = int(server.url("coap").rsplit(":", 1)[1])
            observation = boss.observe(f"coap://w0@127.0.0.1:{port}", "health")
            seen = [(await observation.__anext__()).envelope().meta["n"]]
            for n in (1, 2):
                health.notify(Envelope("health", meta={"n": n}))
                seen.append((await asyncio.wait_for(observation.__anext__(), 5)).envelope().meta["n"])
            assert seen == [0, 1, 2] and health.observers == 1
            observation.cancel()
            for n in range(3, 10):  # the next notification is answered with RST
                health.notify(Envelope("health", meta={"n": n}))
                await asyncio.sleep(0.1)
                if health.observers == 0:
                    break
            assert health.observers == 0

    asyncio.run(main())


def test_a_replayed_datagram_is_rejected_also_after_a_restart_or_a_crash(cluster, host):
    credential = cluster.workers[2]

    async def main():
        async with Counting(cluster.tls(credential)) as worker:
            proxy = UdpProxy(worker.port)
            port = await proxy.start()
            async with TensorClient(tls=host()) as boss:
                await boss.send(f"coap://w2@127.0.0.1:{port}", "echo", Envelope("control", meta={"n": 1}))
            proxy.close()
            capture = proxy.sent
            assert worker.calls == 1 and len(capture) == 1
            for _ in range(3):
                answers = await replay(capture, worker.port)
                assert [a.code for a in answers] == [Code.UNAUTHORIZED]
                assert b"replayed request" in answers[0].payload and answers[0].opt.oscore is None
            assert worker.calls == 1
            state = next(state_dir(credential).iterdir()) / "sequence.json"
            crashed = state.read_text()  # while it runs the window on disk is "unknown": as after a crash
            assert '"unknown"' in crashed

        async with Counting(cluster.tls(credential)) as worker:  # clean restart: the window was saved
            answers = await replay(capture, worker.port)
            assert [a.code for a in answers] == [Code.UNAUTHORIZED] and b"replayed" in answers[0].payload
            assert worker.calls == 0

        state.write_text(crashed)
        async with Counting(cluster.tls(credential)) as worker:  # after a crash: freshness by Echo (B.1.2)
            answers = await replay(capture, worker.port)
            # a protected 4.01 with an Echo challenge (outer code 2.04) that only the key holder can answer
            assert len(answers) == 1 and answers[0].opt.oscore is not None and answers[0].code == Code.CHANGED
            assert worker.calls == 0
            async with TensorClient(tls=host()) as boss:  # an honest client answers it and gets through
                reply = await boss.send(f"coap://w2@127.0.0.1:{worker.port}", "echo", Envelope("control"))
                assert reply.envelope().meta["peer"] == "coordinator 'coordinator'"
            assert worker.calls == 1
            answers = await replay(capture, worker.port)
            assert b"replayed request" in answers[0].payload
            assert worker.calls == 1

    asyncio.run(main())


def test_sequence_numbers_are_never_reused_across_restarts_or_crashes(cluster, host):
    async def main():
        async with Counting(cluster.tls(cluster.workers[1])) as worker:
            proxy = UdpProxy(worker.port)
            port = await proxy.start()
            for run in range(4):  # coordinator processes one after another; the third one crashes
                async with TensorClient(tls=host()) as boss:
                    for _ in range(4):
                        await boss.send(f"coap://w1@127.0.0.1:{port}", "echo", Envelope("control"))
                    state = next(p for p in state_dir(host().path).iterdir() if p.name.startswith("w1-"))
                    on_disk = (state / "sequence.json").read_text()
                if run == 2:
                    (state / "sequence.json").write_text(on_disk)  # as if it had died before saving
            proxy.close()
            numbers = partial_ivs(proxy.sent)
            assert len(numbers) == 16 and numbers == sorted(set(numbers)), numbers
            assert worker.calls == 16

    asyncio.run(main())


def test_one_process_per_oscore_state(cluster, host):
    keys = OscoreKeys(host())
    try:
        keys.for_peer("w0")  # holds the coordinator's state for w0
        code = (f"from edgert.security.keystore import HostSecurity\n"
                f"from edgert.transport.oscore_keys import OscoreKeys\n"
                f"OscoreKeys(HostSecurity.open({str(cluster.keys)!r}).tls).for_peer('w0')\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and "in use by another process" in result.stderr
    finally:
        keys.close()
    assert not list(state_dir(host().path).glob("*/lock"))  # released: the next process may use it


def test_plaintext_udp_without_credentials_and_credentials_without_oscore(cluster, tmp_path):
    async def main():
        async with TensorServer("coap://127.0.0.1:0") as server, TensorClient() as client:  # --insecure
            server.add_resource("echo", post=lambda r: _async(Envelope("control")), rt="test.echo")
            await client.send(server.url("coap"), "echo", Envelope("control"))

        old = tmp_path / "old.pem"  # a credential from before OSCORE: no OSCORE block
        data = cluster.workers[0].read_bytes()
        old.write_bytes(data[:data.index(f"-----BEGIN {OSCORE_LABEL}".encode())])
        os.chmod(old, 0o600)
        tls = TlsCredentials.load(old)
        assert tls.oscore is None
        with pytest.raises(CredentialError, match="holds no OSCORE keys"):
            await TensorServer("coap://127.0.0.1:0", tls=tls).start()
        async with TensorClient(tls=tls) as client:
            with pytest.raises(PeerUnreachable, match="needs OSCORE keys"):
                await client.get("coap://127.0.0.1:9", "health", retries=0)

    asyncio.run(main())


async def _async(value):
    return value


def test_a_keystore_from_before_oscore_gains_a_root_secret(tmp_path):
    (device,) = local_cluster_keys(tmp_path, ["w0"])
    coordinator = tmp_path / "cluster" / "coordinator.pem"
    data = coordinator.read_bytes()
    coordinator.write_bytes(data[:data.index(f"-----BEGIN {OSCORE_LABEL}".encode())])
    assert TlsCredentials.load(coordinator).oscore is None
    store = Keystore.open(tmp_path / "cluster")
    fresh = tmp_path / "w1.pem"
    fresh.write_bytes(store.enroll("w1"))
    os.chmod(fresh, 0o600)
    assert TlsCredentials.load(coordinator).oscore is not None  # the root secret was added

    async def main():
        async with Counting(HostSecurity.open(tmp_path / "cluster").tls) as boss_server:
            async with TensorClient(tls=TlsCredentials.load(fresh)) as w1:
                await w1.send(boss_server.url, "echo", Envelope("control"))
            async with TensorClient(tls=TlsCredentials.load(device)) as w0:  # keys from the old root: gone
                with pytest.raises(Unauthorized, match="fails OSCORE verification"):
                    await w0.send(boss_server.url, "echo", Envelope("control"))
            assert boss_server.calls == 1

    asyncio.run(main())


def test_the_worker_command_serves_coap_with_oscore(cluster, host):
    credential = cluster.workers[3]
    process = subprocess.Popen([sys.executable, "-m", "edgert", "worker", "--credential", str(credential),
                                "--listen", "coap://127.0.0.1:0", "--name", "w3"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert "listening on coap://127.0.0.1:" in line, line + process.stderr.read()
        url = line.split("listening on ", 1)[1].split()[0]

        async def main():
            async with TensorClient(tls=host()) as boss:
                links = await boss.discover(url.replace("coap://", "coap://w3@"), rt="edgert.health")
                assert [link.href for link in links] == ["/health"]
            async with TensorClient() as stranger:
                with pytest.raises(Unauthorized):
                    await stranger.get(url, "health")

        asyncio.run(main())
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert state_dir(credential).is_dir()


def test_state_lives_beside_the_credential_readable_by_its_owner_only(cluster):
    folder = state_dir(Path(cluster.workers[0]))
    assert folder.is_dir() and folder.stat().st_mode & 0o077 == 0
