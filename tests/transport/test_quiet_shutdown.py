"""Closing a client leaves no failed task behind: nothing for asyncio to log as "never retrieved".

A worker that is told to stop closes its client while connections are closing (a TLS peer
said goodbye) or being opened (a request given up on): issue 15, C5.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket

import pytest

from edgert.security.keystore import local_cluster_keys
from edgert.transport import ClientConfig, PeerUnreachable, TensorClient, TensorServer
from edgert.transport.tls import TlsCredentials

NEVER_RETRIEVED = "never retrieved"


@pytest.fixture(scope="module")
def credentials(tmp_path_factory) -> list[TlsCredentials]:
    paths = local_cluster_keys(tmp_path_factory.mktemp("keys"), ["w0", "w1"])
    return [TlsCredentials.load(path) for path in paths]


def _asyncio_errors(caplog) -> list[str]:
    gc.collect()  # asyncio logs an unretrieved task exception when the task is collected
    return [r.getMessage() for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]


def test_closing_a_client_whose_tls_connection_is_closing(credentials, caplog):
    async def main():
        server = TensorServer("coaps+tcp://127.0.0.1:0", tls=credentials[0])
        server.add_resource("echo", post=_echo, envelope=False, rt="test.echo")
        await server.start()
        client = TensorClient(tls=credentials[1])
        await client.post(server.url(), "echo", b"hello")
        for connection in list(client._pool("coaps+tcp")._pool.values()):
            connection._transport.close()  # TLS says goodbye first: the connection is closing, still pooled
        await client.close()
        await server.shutdown()

    caplog.set_level(logging.ERROR, logger="asyncio")
    asyncio.run(main())
    assert not [m for m in _asyncio_errors(caplog) if NEVER_RETRIEVED in m]


def test_a_connection_attempt_everyone_gave_up_on(caplog):
    with socket.socket() as probe:  # a port nobody listens on: the attempt fails once it runs
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def main():
        client = TensorClient(ClientConfig(retries=0))
        await client.start()
        request = asyncio.ensure_future(client.post(f"coap+tcp://127.0.0.1:{port}", "echo", b"x"))
        await asyncio.sleep(0)  # the request has started connecting
        request.cancel()  # a send cancelled as its worker shuts down
        with pytest.raises((asyncio.CancelledError, PeerUnreachable)):
            await request
        await asyncio.sleep(0.2)  # the attempt fails (connection refused) with nobody waiting for it
        await client.close()

    caplog.set_level(logging.ERROR, logger="asyncio")
    asyncio.run(main())
    assert not [m for m in _asyncio_errors(caplog) if NEVER_RETRIEVED in m]


async def _echo(request):
    return request.payload
