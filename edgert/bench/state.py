"""``edgert bench state``: a stage state of hundreds of MB over ``coap+tcp`` in pieces, against raw TCP.

The receiver runs in a child process (its own core, as another device would) on loopback. In each
round, in rotating order, the same encoded state (a ``weights`` envelope of float32 tensors, as a
stage's parameters and optimizer state make it) goes

- ``raw-tcp``: as one stream (an 8-byte length, then the bytes from the arrays), received straight
  into one buffer of that size, acknowledged with 8 bytes: the link's speed for those bytes;
- ``coap-push``: ``PUT`` in pieces (docs/PROTOCOL.md §12, two in flight) to a resource that takes it
  into memory, checks its SHA-256 and decodes it, as a worker takes a peer's copy;
- ``coap-pull``: ``GET`` from a resource answering it in pieces, fetched into memory and checked, as a
  worker migrating a stage or the coordinator fetching a checkpoint does.

Each figure is a same-round ratio (raw time / CoAP time: the share of raw TCP's rate reached), with its
median and range over the rounds. The receiver's peak extra memory (its peak resident size during the
transfer, ``VmHWM`` reset before it, less its size before) is measured for every transfer.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgert.bench.harness import Column, Target, option, result, table, target_lines
from edgert.bench.transport import RawSink, parse_size, size_text
from edgert.transport import ClientConfig, Envelope, PieceOptions, Request, TensorClient, TensorServer
from edgert.transport.envelope import encode_envelope_parts
from edgert.transport.pieces import PIECE_BYTES, MemorySink

TENSOR_FLOATS = 4 * 1024 * 1024  # 16 MiB tensors, the size of a wide layer's weight or its Adam buffer
TARGETS = (
    Target("push_vs_raw", ">=", 0.7, "coap+tcp push in pieces vs raw TCP, same bytes, same rounds (median)"),
    Target("pull_vs_raw", ">=", 0.7, "coap+tcp pull in pieces vs raw TCP (median)"),
    Target("push_peak_over_bound", "<=", 1.0, "receiver's peak extra memory / (state + 2 pieces), push"),
    Target("pull_peak_over_bound", "<=", 1.0, "receiver's peak extra memory / (state + 2 pieces), pull"),
)


@dataclass(frozen=True)
class BenchConfig:
    """What ``edgert bench state`` moves and how often."""

    size: int = option(400 * 1000 * 1000, "Bytes of the state (float32 tensors).", parse=parse_size,
                       show=lambda n: str(n))
    rounds: int = option(5, "Rounds; each moves the state once per way, in rotating order.")

    def check(self) -> None:
        if self.size < 2 * PIECE_BYTES or self.rounds < 1:
            raise ValueError(f"--size must be at least {2 * PIECE_BYTES} bytes and --rounds at least 1")


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    config.check()
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=_server_main, args=(child, config.size), daemon=True)
    server.start()
    try:
        ports = parent.recv()
        rows = asyncio.run(_measure(config, ports))
    finally:
        parent.send("stop")
        server.join(30)
    return _summary(rows, config)


# -- the receiving side (a child process) ------------------------------------------------------------


def _server_main(conn, size: int) -> None:
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(_serve(conn, size))


class _RawStateSink(RawSink):
    """The raw-TCP baseline's server (8-byte length, the bytes straight into one buffer, 8 bytes back), its
    buffer an ``np.empty`` as a piece sink's (pages touched only as bytes land)."""

    def allocate(self, size: int) -> np.ndarray:
        return np.empty(size, np.uint8)


async def _serve(conn, size: int) -> None:
    loop = asyncio.get_running_loop()
    raw = await loop.create_server(_RawStateSink, "127.0.0.1", 0)
    held = _state(size)
    memory = _PeakMemory()

    def admit(request: Request, piece: Any) -> MemorySink:
        return MemorySink(piece.size)

    async def put(request: Request) -> None:
        return None  # taken, checked and decoded: dropped

    async def get(request: Request) -> Envelope:
        return held

    def mark(request: Request) -> None:
        memory.reset()

    def peak(request: Request) -> Envelope:
        return Envelope("control", meta={"extra": memory.extra()})

    server = TensorServer("coap+tcp://127.0.0.1:0")
    server.add_resource("state", put=put, get=get, rt="bench.state", kinds=("weights",), pieces=admit,
                        piece_answers=True)
    server.add_resource("mark", post=mark, rt="bench.mark", envelope=False)
    server.add_resource("peak", get=peak, rt="bench.peak")
    await server.start()
    conn.send({"raw": raw.sockets[0].getsockname()[1], "coap": server.url("coap+tcp")})
    await loop.run_in_executor(None, conn.recv)
    raw.close()
    await server.shutdown()


class _PeakMemory:
    """This process's peak resident size since :meth:`reset`, over its size then (Linux ``VmHWM``)."""

    def __init__(self) -> None:
        self._base = 0

    def reset(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self._base = _status("VmRSS")

    def extra(self) -> int:
        return _status("VmHWM") - self._base


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _state(size: int, seed: int = 0) -> Envelope:
    """A stage state of ``size`` bytes: float32 tensors of :data:`TENSOR_FLOATS` (the last one the rest)."""
    rng = np.random.default_rng(seed)
    floats, tensors, k = size // 4, {}, 0
    while floats > 0:
        n = min(TENSOR_FLOATS, floats)
        tensors[f"layer{k // 3}.weight" + ("", "#exp_avg", "#exp_avg_sq")[k % 3]] = \
            rng.standard_normal(n, dtype=np.float32)
        floats, k = floats - n, k + 1
    return Envelope("weights", run_id="bench", step=1, tensors=tensors)


# -- the sending side ------------------------------------------------------------------------------


async def _measure(config: BenchConfig, ports: dict[str, Any]) -> list[dict[str, Any]]:
    state = _state(config.size, seed=1)
    parts = encode_envelope_parts(state)
    wire = sum(map(len, parts))
    client = TensorClient(ClientConfig(timeout=600.0, retries=0))
    await client.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", ports["raw"])
    url = ports["coap"]
    own = _PeakMemory()

    async def raw() -> None:
        writer.write(wire.to_bytes(8, "big"))
        for part in parts:  # referenced, as coap+tcp's frames are (writelines would join them first)
            writer.write(part)
        await writer.drain()
        await reader.readexactly(8)

    async def push() -> None:
        await client.request("PUT", url, "state", state, pieces=PieceOptions(max_body=0))

    async def pull() -> None:
        response = await client.request("GET", url, "state", pieces=PieceOptions(max_body=2 * wire))
        response.envelope()  # decoded, as a receiver uses it

    ways = {"raw-tcp": raw, "coap-push": push, "coap-pull": pull}
    for way in ways.values():  # warm-up: connections, allocator
        await way()
    rows: list[dict[str, Any]] = []
    names = list(ways)
    for index in range(config.rounds):
        for name in names[index % 3:] + names[:index % 3]:
            await client.post(url, "mark")
            own.reset()
            started = time.perf_counter()
            await ways[name]()
            seconds = time.perf_counter() - started
            server_extra = (await client.get(url, "peak")).envelope().meta["extra"]
            receiver_extra = own.extra() if name == "coap-pull" else server_extra
            rows.append({"round": index, "way": name, "bytes": wire, "seconds": seconds,
                         "mb_per_s": wire / seconds / 1e6, "receiver_extra_bytes": receiver_extra})
    writer.close()
    await client.close()
    return rows


def _summary(rows: list[dict[str, Any]], config: BenchConfig) -> dict[str, Any]:
    by = {(row["round"], row["way"]): row for row in rows}
    wire = rows[0]["bytes"]
    bound = wire + 2 * PIECE_BYTES
    ratios: dict[str, Any] = {"state_bytes": wire, "piece_bytes": PIECE_BYTES, "rounds": config.rounds}
    for way, key in (("coap-push", "push"), ("coap-pull", "pull")):
        per_round = [by[(r, "raw-tcp")]["seconds"] / by[(r, way)]["seconds"] for r in range(config.rounds)]
        ratios[f"{key}_vs_raw"] = round(statistics.median(per_round), 3)
        ratios[f"{key}_vs_raw_range"] = [round(min(per_round), 3), round(max(per_round), 3)]
        peak = max(by[(r, way)]["receiver_extra_bytes"] for r in range(config.rounds))
        ratios[f"{key}_peak_extra_mb"] = round(peak / 1e6, 1)
        ratios[f"{key}_peak_over_bound"] = round(peak / bound, 3)
    ratios["raw_peak_extra_mb"] = round(max(by[(r, "raw-tcp")]["receiver_extra_bytes"]
                                            for r in range(config.rounds)) / 1e6, 1)
    return result(rows, ratios, size=config.size)


def format_table(outcome: dict[str, Any]) -> str:
    ratios = outcome["ratios"]
    columns = [Column("round", 6, "round"), Column("way", 10, "way"),
               Column("seconds", 9, "seconds", "{:.3f}"), Column("MB/s", 8, "mb_per_s", "{:.0f}"),
               Column("receiver +MB", 13, lambda row: row["receiver_extra_bytes"] / 1e6, "{:.1f}")]
    lines = [f"A stage state of {size_text(ratios['state_bytes'])} in pieces of {size_text(ratios['piece_bytes'])}"
             f" over loopback, {ratios['rounds']} rounds in rotating order", *table(columns, outcome["rows"]), ""]
    for key in ("push", "pull"):
        low, high = ratios[f"{key}_vs_raw_range"]
        lines.append(f"coap+tcp {key} vs raw TCP: {ratios[f'{key}_vs_raw']:.3f} of its rate (rounds: {low:.3f} to "
                     f"{high:.3f}); receiver's peak extra memory {ratios[f'{key}_peak_extra_mb']:.0f} MB "
                     f"(raw: {ratios['raw_peak_extra_mb']:.0f} MB)")
    lines.append("")
    lines += target_lines(TARGETS, ratios)
    return "\n".join(lines)
