"""An idle hop: a compute thread's tensor to the peer's waiting compute thread, over the worker's own path.

Two processes on loopback ping-pong an activation-sized envelope. Each side is a worker's
parts: a :class:`~edgert.transport.TensorServer` whose ``/act`` handler puts the tensors in an
:class:`~edgert.worker.inbox.Inbox`, a compute thread that waits on that inbox and answers
through an :class:`~edgert.worker.outbox.Outbox` (``TensorClient.request`` on the transport
loop). A hop is half a round trip: compute thread -> CoAP -> the peer's inbox -> the peer's
compute thread. Beside it, half a round trip of the same bytes over a blocking TCP socket
pair: the floor a hop cannot go under on this host.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import statistics
import threading
import time

import numpy as np

from edgert.protocol import ACT, DATA_KINDS
from edgert.transport import Envelope, TensorClient, TensorServer, encode_envelope
from edgert.worker.inbox import Inbox
from edgert.worker.outbox import Outbox

HOP_BYTES = 8192  # an 8 KiB activation (a micro-batch of 16 rows x 128 floats)


class _Side:
    """One side's worker parts: a server filling an inbox, a client sending through an outbox."""

    def __init__(self, name: str):
        self.inbox = Inbox()
        self.server = TensorServer("coap+tcp://127.0.0.1:0")
        self.server.add_resource(ACT, post=self._on_act, rt="edgert.activations", kinds=(DATA_KINDS[ACT],))
        self.client = TensorClient()
        self.outbox = Outbox(self.client, name)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def _on_act(self, request) -> None:
        envelope = request.envelope
        self.inbox.put((ACT, envelope.step, 0), dict(envelope.tensors))

    def start(self) -> str:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(self.client.start(), self.loop).result(10)
        return self.server.urls[0]

    def send(self, url: str, step: int, value: np.ndarray) -> None:
        envelope = Envelope(DATA_KINDS[ACT], step=step, microbatch=0, stage=0, tensors={"x": value})
        self.outbox.submit(url, ACT, envelope, None)

    def take(self, step: int) -> np.ndarray:
        return self.inbox.take((ACT, step, 0), timeout=30)[0]["x"]

    def close_client(self) -> None:
        """Stop sending (both sides do before either stops serving: no connection is cut under a send)."""
        self.outbox.close()
        asyncio.run_coroutine_threadsafe(self._close_client(), self.loop).result(10)

    async def _close_client(self) -> None:
        await self.outbox.wait_closed()
        await self.client.close()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _echo(conn, hops: int) -> None:
    """The peer: answer every activation with itself, from its compute thread."""
    side = _Side("peer")
    conn.send(side.start())
    url = conn.recv()
    for step in range(hops):
        side.send(url, step, side.take(step))
    conn.recv()
    side.close_client()
    conn.send("closed")
    conn.recv()
    side.stop()


def _raw_echo(conn, hops: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    peer, _ = listener.accept()
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(hops):
        peer.sendall(_recv_exactly(peer, HOP_BYTES))
    peer.close()
    listener.close()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(left)
        if not part:
            raise ConnectionError("the peer closed the socket")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def idle_hop(hops: int = 400, skip: int = 40) -> dict[str, float]:
    """Median and 10th percentile of an idle hop (ms), and of half a raw TCP round trip of the same bytes."""
    context = multiprocessing.get_context("spawn")
    value = np.ones(HOP_BYTES // 4, np.float32)
    mine, theirs = context.Pipe()
    peer = context.Process(target=_echo, args=(theirs, hops), daemon=True)
    peer.start()
    side = _Side("bench")
    try:
        mine.send(side.start())
        url = mine.recv()
        times = []
        for step in range(hops):
            started = time.perf_counter()
            side.send(url, step, value)
            side.take(step)
            times.append((time.perf_counter() - started) * 500)  # half the round trip, in ms
        side.close_client()
        mine.send("close")
        mine.recv()
    finally:
        side.stop()
        mine.send("done")
        peer.join(10)
    raw = _raw_hops(context, hops)
    hop = sorted(times[skip:])
    floor = sorted(raw[skip:])
    return {"hop_median_ms": statistics.median(hop), "hop_p10_ms": hop[len(hop) // 10],
            "raw_tcp_median_ms": statistics.median(floor), "envelope_bytes": len(encode_envelope(
                Envelope(DATA_KINDS[ACT], step=0, microbatch=0, stage=0, tensors={"x": value})))}


def _raw_hops(context, hops: int) -> list[float]:
    mine, theirs = context.Pipe()
    peer = context.Process(target=_raw_echo, args=(theirs, hops), daemon=True)
    peer.start()
    sock = socket.create_connection(("127.0.0.1", mine.recv()))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, times = b"\0" * HOP_BYTES, []
    for _ in range(hops):
        started = time.perf_counter()
        sock.sendall(payload)
        _recv_exactly(sock, HOP_BYTES)
        times.append((time.perf_counter() - started) * 500)
    sock.close()
    peer.join(10)
    return times
