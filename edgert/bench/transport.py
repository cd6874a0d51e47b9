"""The transport benchmark: raw TCP vs CoAP over TCP vs CoAP over UDP, large-message strategies, codecs.

Run by ``edgert bench transport`` (edgert/cli/bench.py). The servers
run in a child process (each side has its own core, as two devices would) on
loopback; the client measures each transport in rotating blocks so drift hits
all of them alike.

Sections:

- ``transport``: per tensor size, median round trip and throughput of (a) a raw
  asyncio TCP stream carrying the encoded envelope (length prefix, 8-byte ack), (a') the
  same stream over asyncio's TLS with the run's credentials (``raw-tls``: what TLS itself
  costs on this host, the ceiling of ``coaps+tcp`` against ``coap+tcp``),
  (b) ``coap+tcp``, (b') ``coaps+tcp`` (mutual TLS 1.3 with cluster credentials made for
  the run) and (c) ``coap`` (UDP) POSTing the envelope to a resource that
  decodes it; the CoAP rows include encoding on the client and decoding on the server.
  Each transport runs in blocks of at most five back-to-back requests, in rounds of
  rotating order (steady state; drift and other processes' bursts spread over all).
- ``strategy``: the same encoded bytes above 1 MiB sent as one CoAP message
  (CSM-negotiated Max-Message-Size), as BERT blocks of 1 MiB (peer advertising
  aiocoap's 1 MiB limit), and as 1 MiB chunks POSTed concurrently and reassembled
  by the resource (chunking at the application layer).
- ``codec``: ratio, relative RMS error and encode+decode time of each codec on a
  4 MiB float32 activation tensor (ReLU, per-channel scales) or, for top-k, a gradient
  (:mod:`edgert.bench.codecs`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiocoap.numbers.codes import Code

from edgert.bench.codecs import measure_codecs
from edgert.bench.harness import Column, Target, option, ratio, result, table, target_lines
from edgert.errors import EdgertError
from edgert.transport.client import ClientConfig, TensorClient
from edgert.transport.envelope import Envelope, decode_envelope, encode_envelope
from edgert.transport.limits import KiB, Limits, MiB
from edgert.transport.message import Request, Response
from edgert.transport.server import TensorServer
from edgert.transport.tls import TlsCredentials

SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
CHUNK = 1 * MiB
BENCH_LIMITS = Limits(max_payload_bytes=80 * MiB, max_tensor_bytes=80 * MiB, max_decoded_bytes=160 * MiB)


def parse_size(text: str) -> int:
    """'4K', '4KiB', '16M', '1048576' -> bytes."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    factor = {"K": KiB, "M": MiB}.get(value[-1:], 1)
    digits = value[:-1] if factor != 1 else value
    if not digits.isdigit() or int(digits) <= 0:
        raise ValueError(f"size {text!r} must look like 4K, 16M or a byte count")
    return int(digits) * factor


def size_text(nbytes: int, space: str = " ") -> str:
    """4194304 -> '4 MiB' (whole KiB or MiB, as the sizes measured are)."""
    return f"{nbytes // MiB}{space}MiB" if nbytes >= MiB else f"{nbytes // KiB}{space}KiB"


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; defaults reproduce the documented figures."""

    sizes: tuple[int, ...] = option(
        SIZES, "Comma-separated tensor sizes.", parse=lambda text: tuple(parse_size(s) for s in text.split(",")),
        show=lambda sizes: ",".join(size_text(s, "") for s in sizes))
    udp_max_bytes: int = option(16 * MiB, "Largest size also sent over CoAP/UDP (slow).", flag="--udp-max",
                                parse=parse_size, show=lambda size: size_text(size, ""))
    repeat: float = option(1.0, "Scale the number of repetitions.")
    strategies: bool = option(True, "Compare large-message strategies.")
    codecs: bool = option(True, "Measure the compression codecs.")

    def check(self) -> None:
        if self.repeat <= 0:
            raise EdgertError(f"--repeat must be > 0, got {self.repeat}")


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    """Run the whole benchmark; returns ``{"rows": [...], "ratios": {...}}``."""
    config.check()
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    keys = tempfile.TemporaryDirectory(prefix="edgert-bench-keys-")
    server_credential, client_credential = _bench_credentials(Path(keys.name))
    process = context.Process(target=_server_main, args=(child, server_credential), name="edgert-bench-server",
                              daemon=True)
    process.start()
    try:
        urls = parent.recv()
        rows = asyncio.run(_measure_transports(config, urls, TlsCredentials.load(client_credential)))
    finally:
        parent.send("stop")
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join()
        keys.cleanup()  # after the server saved its OSCORE state there
    if config.codecs:
        rows += measure_codecs(BENCH_LIMITS)
    return result(rows, ratios(rows))


# -- server process -------------------------------------------------------------


def _bench_credentials(folder: Path) -> tuple[Path, Path]:
    """A throw-away cluster: an enrolled device (the server) and the coordinator (the client), for the
    ``coaps+tcp`` and ``coap-udp+oscore`` rows."""
    from edgert.security.keystore import local_cluster_keys  # host side; needs only cryptography

    (server,) = local_cluster_keys(folder, ["bench-server"], cluster="bench")
    return server, folder / "cluster" / "coordinator.pem"


def _server_main(conn, credential: Path) -> None:
    logging.basicConfig(level=logging.ERROR)
    for name in ("coap", "coap-server", "edgert.transport.server", "edgert.transport.oscore"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    asyncio.run(_serve(conn, TlsCredentials.load(credential)))


class RawSink(asyncio.BufferedProtocol):
    """The raw-TCP baseline's server: 8-byte length, then the bytes, received straight into
    one preallocated buffer (no StreamReader copies), acknowledged with the length."""

    def __init__(self) -> None:
        self._buffer = bytearray(8)
        self._filled = 0
        self._size: int | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def allocate(self, size: int) -> bytearray | np.ndarray:
        """The buffer the bytes go into."""
        return bytearray(size)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled < len(self._buffer):
            return
        if self._size is None:
            self._size = int.from_bytes(self._buffer, "big")
            self._buffer, self._filled = self.allocate(self._size), 0
            if self._size:
                return
        self._transport.write(self._size.to_bytes(8, "big"))
        self._buffer, self._filled, self._size = bytearray(8), 0, None


async def _serve(conn, tls: TlsCredentials) -> None:
    raw = await asyncio.get_running_loop().create_server(RawSink, "127.0.0.1", 0)
    raw_tls = await asyncio.get_running_loop().create_server(RawSink, "127.0.0.1", 0, ssl=tls.server_context)
    chunks: dict[str, list[Any]] = {}

    def sink(request: Request) -> None:  # a plain handler, as a worker's /act and /grad are
        return None

    def chunk(request: Request) -> Response:
        transfer, offset, total = request.query["t"], int(request.query["o"]), int(request.query["n"])
        entry = chunks.setdefault(transfer, [bytearray(total), 0])
        entry[0][offset:offset + len(request.payload)] = request.payload
        entry[1] += len(request.payload)
        if entry[1] < total:
            return Response(code=Code.CHANGED, payload=b"partial")
        del chunks[transfer]
        decode_envelope(entry[0], BENCH_LIMITS)
        return Response(code=Code.CHANGED, payload=b"done")

    main = TensorServer("coap+tcp://127.0.0.1:0", "coap://127.0.0.1:0", "coaps+tcp://127.0.0.1:0",
                        limits=BENCH_LIMITS, tls=tls)
    main.add_resource("sink", post=sink, rt="edgert.bench")
    main.add_resource("chunk", post=chunk, rt="edgert.bench", envelope=False)
    udp = TensorServer("coap://127.0.0.1:0", limits=BENCH_LIMITS)  # plaintext UDP (main's is OSCORE)
    udp.add_resource("sink", post=sink, rt="edgert.bench")
    bert = TensorServer("coap+tcp://127.0.0.1:0",
                        limits=Limits(**{**BENCH_LIMITS.__dict__, "tcp_message_bytes": 1 * MiB}))
    bert.add_resource("sink", post=sink, rt="edgert.bench")
    await main.start()
    await udp.start()
    await bert.start()
    loop = asyncio.get_running_loop()
    conn.send({"raw": raw.sockets[0].getsockname()[1], "raw_tls": raw_tls.sockets[0].getsockname()[1],
               "tcp": main.url("coap+tcp"), "udp": udp.url("coap"),
               "oscore": main.url("coap").replace("coap://", f"coap://{tls.identity.name}@"),
               "tls": main.url("coaps+tcp"), "bert": bert.url("coap+tcp")})
    await loop.run_in_executor(None, conn.recv)
    raw.close()
    raw_tls.close()
    await main.shutdown()
    await udp.shutdown()
    await bert.shutdown()


# -- client measurements ----------------------------------------------------------


def _reps(size: int, repeat: float) -> int:
    for limit, count in ((4 * KiB, 300), (64 * KiB, 100), (1 * MiB, 30), (4 * MiB, 30)):
        if size <= limit:
            return max(1, round(count * repeat))
    return max(1, round(12 * repeat))


def _payload(size: int) -> tuple[Envelope, bytes]:
    tensor = np.random.default_rng(size).standard_normal(size // 4).astype(np.float32)
    env = Envelope("activations", run_id="bench", step=1, microbatch=0, stage=0, tensors={"x": tensor})
    return env, encode_envelope(env)


async def _measure_transports(config: BenchConfig, urls: dict[str, Any],
                              tls: TlsCredentials) -> list[dict[str, Any]]:
    client = TensorClient(ClientConfig(timeout=600.0, retries=0), BENCH_LIMITS, tls=tls)
    await client.start()
    plain = TensorClient(ClientConfig(timeout=600.0, retries=0), BENCH_LIMITS)  # coap:// without OSCORE
    streams = {"raw-tcp": await asyncio.open_connection("127.0.0.1", urls["raw"]),
               "raw-tls": await asyncio.open_connection("127.0.0.1", urls["raw_tls"], ssl=tls.client_context,
                                                        server_hostname="")}
    transfer_ids = itertools.count()

    async def raw_over(name: str, data: bytes) -> None:
        reader, writer = streams[name]
        writer.write(len(data).to_bytes(8, "big"))
        writer.write(memoryview(data))  # as coap+tcp does: asyncio slices (copies) the unsent rest of a bytes
        await reader.readexactly(8)

    async def raw(env: Envelope, data: bytes) -> None:
        await raw_over("raw-tcp", data)

    async def raw_tls(env: Envelope, data: bytes) -> None:
        await raw_over("raw-tls", data)

    async def coap_tcp(env: Envelope, data: bytes) -> None:
        await client.send(urls["tcp"], "sink", env)

    async def coaps_tcp(env: Envelope, data: bytes) -> None:
        await client.send(urls["tls"], "sink", env)

    async def coap_udp(env: Envelope, data: bytes) -> None:
        await plain.send(urls["udp"], "sink", env)

    async def coap_oscore(env: Envelope, data: bytes) -> None:
        await client.send(urls["oscore"], "sink", env)

    async def single(env: Envelope, data: bytes) -> None:
        await client.post(urls["tcp"], "sink", data, content_format=60)

    async def bert(env: Envelope, data: bytes) -> None:
        await client.post(urls["bert"], "sink", data, content_format=60)

    async def chunked(env: Envelope, data: bytes) -> None:
        transfer = str(next(transfer_ids))
        view = memoryview(data)
        await asyncio.gather(*(
            client.post(urls["tcp"], "chunk", view[offset:offset + CHUNK],
                        query={"t": transfer, "o": str(offset), "n": str(len(data))})
            for offset in range(0, len(data), CHUNK)))

    rows: list[dict[str, Any]] = []
    try:
        for size in config.sizes:
            env, data = _payload(size)
            plan = {"raw-tcp": raw, "raw-tls": raw_tls, "coap+tcp": coap_tcp, "coaps+tcp": coaps_tcp}
            if size <= config.udp_max_bytes:
                plan["coap-udp"], plan["coap-udp+oscore"] = coap_udp, coap_oscore
            reps = {name: _reps(size, config.repeat) for name in plan}
            for name in ("coap-udp", "coap-udp+oscore"):
                if name in reps and size > 64 * KiB:
                    reps[name] = 1
            rows += await _interleave("transport", size, plan, reps, env, data)
            if config.strategies and size > 1 * MiB:
                plan = {"single-message": single, "bert-1MiB": bert, "chunked-1MiB": chunked}
                rows += await _interleave("strategy", size, plan, {n: _reps(size, config.repeat) for n in plan},
                                          env, data)
    finally:
        for _, writer in streams.values():
            writer.close()
        await client.close()
        await plain.close()
    return rows


async def _interleave(section: str, size: int, plan: dict[str, Any], reps: dict[str, int],
                      env: Envelope, data: bytes, block: int = 5) -> list[dict[str, Any]]:
    """Measure each transport in rounds of blocks of up to ``block`` back-to-back requests, rotating the order.

    Blocks keep each measurement in steady state (on a VM, a request after the
    peer sat idle pays extra wake-up latency); at least three rounds, in rotating
    order, spread drift and bursts of other load over all transports.
    """
    rounds = max(3, -(-max(reps.values()) // block))
    times: dict[str, list[float]] = {name: [] for name in plan}
    names = list(plan)
    for name in names:  # warm-up: connections, caches
        await plan[name](env, data)
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            count = reps[name] // rounds + (1 if round_index < reps[name] % rounds else 0)
            for _ in range(count):
                start = time.perf_counter()
                await plan[name](env, data)
                times[name].append(time.perf_counter() - start)
    rows = []
    for name, samples in times.items():
        median = statistics.median(samples)
        rows.append({
            "section": section, "transport": name, "bytes": size, "wire_bytes": len(data), "reps": len(samples),
            "rtt_ms_median": median * 1e3,
            "rtt_ms_p90": sorted(samples)[min(len(samples) - 1, int(0.9 * len(samples)))] * 1e3,
            "mb_per_s": len(data) / median / 1e6,
        })
    return rows


# -- summary --------------------------------------------------------------------


def _row(rows: list[dict[str, Any]], section: str, name: str, size: int) -> dict[str, Any] | None:
    for row in rows:
        if row["section"] == section and row.get("transport") == name and row["bytes"] == size:
            return row
    return None


# (figure, section, baseline, other, size): the baseline's median round trip / the other's, the same bytes
TIME_RATIOS = (
    ("coap_tcp_vs_raw_4MiB", "transport", "raw-tcp", "coap+tcp", 4 * MiB),
    ("coap_udp_vs_raw_4MiB", "transport", "raw-tcp", "coap-udp", 4 * MiB),
    ("coaps_tcp_vs_coap_tcp_4MiB", "transport", "coap+tcp", "coaps+tcp", 4 * MiB),
    # what TLS itself costs a bare stream on this host: the ceiling of the ratio above
    ("raw_tls_vs_raw_tcp_4MiB", "transport", "raw-tcp", "raw-tls", 4 * MiB),
    ("oscore_udp_vs_coap_udp_4KiB", "transport", "coap-udp", "coap-udp+oscore", 4 * KiB),
    ("coap_tcp_vs_raw_16MiB", "transport", "raw-tcp", "coap+tcp", 16 * MiB),
    ("single_vs_bert_4MiB", "strategy", "bert-1MiB", "single-message", 4 * MiB),
    ("single_vs_chunked_4MiB", "strategy", "chunked-1MiB", "single-message", 4 * MiB),
    ("single_vs_bert_16MiB", "strategy", "bert-1MiB", "single-message", 16 * MiB),
    ("single_vs_chunked_16MiB", "strategy", "chunked-1MiB", "single-message", 16 * MiB),
)


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The headline figures (throughput ratios are time ratios for the same bytes)."""
    def ms(section: str, name: str, size: int) -> float | None:
        row = _row(rows, section, name, size)
        return row["rtt_ms_median"] if row else None

    out: dict[str, float] = {}
    for key, section, baseline, other, size in TIME_RATIOS:
        value = ratio(ms(section, baseline, size), ms(section, other, size))
        if value is not None:
            out[key] = value
    for key, name in (("rtt_4KiB_ms", "coap+tcp"), ("raw_rtt_4KiB_ms", "raw-tcp")):
        if ms("transport", name, 4 * KiB) is not None:
            out[key] = ms("transport", name, 4 * KiB)
    for row in rows:
        if row["section"] != "codec":
            continue
        if row["codec"] == "none":
            out["codec_ms_4MiB"] = row["ms"]
        else:
            out[f"{row['codec']}_ratio"] = row["ratio"]
            out[f"{row['codec']}_rel_rms"] = row["rel_rms"]
    return out


TARGETS = (
    Target("coap_tcp_vs_raw_4MiB", ">=", 0.5, "coap+tcp throughput / raw TCP, 4 MiB"),
    Target("coaps_tcp_vs_coap_tcp_4MiB", ">=", 0.8, "protected (TLS) coap+tcp throughput / plaintext, 4 MiB"),
    Target("rtt_4KiB_ms", "<=", 1.0, "coap+tcp round trip of a 4 KiB tensor, ms (median)"),
    Target("codec_ms_4MiB", "<=", 2.0, "encode + decode of a 4 MiB float32 envelope, ms"),
    Target("int8_channel_ratio", ">=", 3.9, "int8 per channel on activations, size ratio"),
    Target("int8_channel_rel_rms", "<=", 0.01, "int8 per channel on activations, relative RMS error"),
)


def _transfer_columns(first: str) -> list[Column]:
    return [Column(first, 16, "transport", left=True), Column("tensor", 10, lambda row: size_text(row["bytes"])),
            Column("reps", 6, "reps"), Column("median ms", 12, "rtt_ms_median", "{:.3f}"),
            Column("p90 ms", 10, "rtt_ms_p90", "{:.3f}"), Column("MB/s", 10, "mb_per_s", "{:.1f}")]


CODEC_COLUMNS = (Column("codec", 14, "codec", left=True), Column("spec", 16, "spec", left=True),
                 Column("ratio", 8, "ratio", "{:.2f}"), Column("rel RMS", 11, "rel_rms", "{:.5f}"),
                 Column("max abs", 10, "max_abs", "{:.4f}"), Column("enc+dec ms", 12, "ms", "{:.2f}"))


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report."""
    rows, figures = result["rows"], result["ratios"]
    lines = ["Transport (loopback, server in a separate process; CoAP rows include envelope encode + decode)",
             *table(_transfer_columns("transport"), [row for row in rows if row["section"] == "transport"])]
    strategy = [row for row in rows if row["section"] == "strategy"]
    if strategy:
        lines += ["", "Large messages over coap+tcp (same encoded bytes)",
                  *table(_transfer_columns("strategy"), strategy)]
    codecs = [row for row in rows if row["section"] == "codec"]
    if codecs:
        lines += ["", "Codecs (4 MiB float32; top-k on a gradient, the rest on ReLU activations)",
                  *table(CODEC_COLUMNS, codecs)]
    lines += ["", *target_lines(TARGETS, figures)]
    if "raw_tls_vs_raw_tcp_4MiB" in figures:
        lines.append(f"  (TLS on a bare asyncio stream / the bare stream, 4 MiB: "
                     f"{figures['raw_tls_vs_raw_tcp_4MiB']:.4g}, the ceiling TLS itself sets here)")
    return "\n".join(lines)
