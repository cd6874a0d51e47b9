"""Fixtures for transport tests: a live TensorServer and clients on loopback, on a loop in a thread.

Tests stay plain functions: ``live.client`` is a :class:`SyncClient` and ``live.call``
runs any coroutine on the server's loop. Ports are always 0 (picked by the OS).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest
from aiocoap.numbers.codes import Code

from edgert.transport import (
    ClientConfig,
    Envelope,
    Limits,
    Request,
    Response,
    ServiceUnavailable,
    SyncClient,
    TensorClient,
    TensorServer,
)
from edgert.transport.limits import MiB

#: Limits of the live test server: small enough to provoke 4.13 cheaply, above aiocoap's 1 MiB.
TEST_LIMITS = Limits(max_payload_bytes=8 * MiB, max_tensor_bytes=8 * MiB, max_decoded_bytes=16 * MiB,
                     max_tensors=64)


class Live:
    """A running server with the standard test resources, and clients, on one background loop."""

    def __init__(self, limits: Limits = TEST_LIMITS) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="live-transport", daemon=True)
        self.thread.start()
        self.received: list[Envelope] = []
        self.attempts: dict[str, int] = {}
        self.server = TensorServer("coap+tcp://127.0.0.1:0", "coap://127.0.0.1:0", limits=limits)
        self._register()
        self.call(self.server.start())
        self.tcp = self.server.url("coap+tcp")
        self.udp = self.server.url("coap")
        self.aclient = TensorClient(ClientConfig(timeout=10.0, retries=0), limits)
        self.client = SyncClient(self.aclient, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        """Run ``coroutine`` on the live loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def _register(self) -> None:
        server = self.server

        async def echo(request: Request) -> Envelope:
            self.received.append(request.envelope)
            return request.envelope

        async def sink(request: Request) -> None:
            self.received.append(request.envelope)

        async def raw(request: Request) -> Response:
            return Response(code=Code.CHANGED, payload=str(len(request.payload)).encode())

        async def weights(request: Request) -> Envelope:
            size = int(request.query.get("bytes", "64"))
            return Envelope("weights", tensors={"w": np.arange(size // 4, dtype=np.float32)})

        async def slow(request: Request) -> bytes:
            self.attempts["slow"] = self.attempts.get("slow", 0) + 1
            await asyncio.sleep(float(request.query.get("s", "0.5")))
            return b"late"

        async def flaky(request: Request) -> bytes:
            key = request.query.get("key", "flaky")
            self.attempts[key] = self.attempts.get(key, 0) + 1
            if self.attempts[key] <= int(request.query.get("fail", "2")):
                raise ServiceUnavailable("busy, try again")
            return b"ok"

        async def boom(request: Request) -> None:
            raise RuntimeError("handler exploded")

        async def bad_return(request: Request) -> Any:
            return 42

        server.add_resource("echo", post=echo, rt="edgert.test.echo")
        server.add_resource("sink", post=sink, put=sink, rt="edgert.activations", kinds=("activations",))
        server.add_resource("raw", post=raw, rt="edgert.test.raw", envelope=False)
        server.add_resource("weights", get=weights, rt="edgert.weights", title="stage weights")
        server.add_resource("slow", get=slow, rt="edgert.test.slow", envelope=False)
        server.add_resource("flaky", get=flaky, rt="edgert.test.flaky", envelope=False)
        server.add_resource("boom", post=boom, rt="edgert.test.boom")
        server.add_resource("bad-return", get=bad_return, rt="edgert.test.bad", envelope=False)
        self.health = server.add_observable("health", rt="edgert.health",
                                            initial=Envelope("health", meta={"seq": 0}))

    def close(self) -> None:
        """Stop client, server and loop."""
        try:
            self.call(self.aclient.close())
            self.call(self.server.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()


@pytest.fixture(scope="module")
def live():
    """One live server per test module."""
    harness = Live()
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture
def still_serving(live):
    """``still_serving()`` asserts a valid request over each scheme is still answered correctly."""

    def check() -> None:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        for url in (live.tcp, live.udp):
            back = live.client.post(url, "echo", Envelope("activations", "alive", 1, 2, 3, {"x": x})).envelope()
            assert back.run_id == "alive" and np.array_equal(back.tensors["x"], x)

    return check
