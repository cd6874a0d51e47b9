"""The transport benchmark: raw TCP vs CoAP over TCP vs CoAP over UDP, large-message strategies, codecs.

Run by ``tools/bench_transport.py`` and ``edgert bench transport``. The servers
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
  4 MiB float32 activation tensor (ReLU, per-channel scales) or, for top-k, a gradient.
"""

from __future__ import annotations

import asyncio
import itertools
import json
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

from edgert.transport.client import ClientConfig, TensorClient
from edgert.transport.codec import measure
from edgert.transport.envelope import Envelope, decode_envelope, encode_envelope
from edgert.transport.limits import KiB, Limits, MiB
from edgert.transport.message import Request, Response
from edgert.transport.server import TensorServer
from edgert.transport.tls import TlsCredentials

SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
CODECS = {
    "fp16": "fp16",
    "int8": "int8",
    "int8_channel": "int8:axis=1",
    "int4": "int4",
    "int4_channel": "int4:axis=1",
    "topk": "topk:ratio=0.01",
}
CHUNK = 1 * MiB
BENCH_LIMITS = Limits(max_payload_bytes=80 * MiB, max_tensor_bytes=80 * MiB, max_decoded_bytes=160 * MiB)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; defaults reproduce the documented figures."""

    sizes: tuple[int, ...] = SIZES
    udp_max_bytes: int = 16 * MiB
    repeat: float = 1.0
    strategies: bool = True
    codecs: bool = True


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    """Run the whole benchmark; returns ``{"rows": [...], "ratios": {...}}``."""
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
        rows += measure_codecs()
    return {"rows": rows, "ratios": ratios(rows)}


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


class _RawSink(asyncio.BufferedProtocol):
    """The raw-TCP baseline's server: 8-byte length, then the bytes, received straight into
    one preallocated buffer (no StreamReader copies), acknowledged with the length."""

    def __init__(self) -> None:
        self._buffer = bytearray(8)
        self._filled = 0
        self._size: int | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled < len(self._buffer):
            return
        if self._size is None:
            self._size = int.from_bytes(self._buffer, "big")
            self._buffer, self._filled = bytearray(self._size), 0
            if self._size:
                return
        self._transport.write(self._size.to_bytes(8, "big"))
        self._buffer, self._filled, self._size = bytearray(8), 0, None


async def _serve(conn, tls: TlsCredentials) -> None:
    raw = await asyncio.get_running_loop().create_server(_RawSink, "127.0.0.1", 0)
    raw_tls = await asyncio.get_running_loop().create_server(_RawSink, "127.0.0.1", 0, ssl=tls.server_context)
    chunks: dict[str, list[Any]] = {}

    async def sink(request: Request) -> None:
        return None

    async def chunk(request: Request) -> Response:
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


def activation_tensor(nbytes: int = 4 * MiB, seed: int = 0) -> np.ndarray:
    """A ReLU activation batch [N, 64, 32, 32] with per-channel scale and shift (what int8 per channel is for)."""
    rng = np.random.default_rng(seed)
    count = nbytes // 4
    batch = max(1, count // (64 * 32 * 32))
    scale = rng.uniform(0.2, 3.0, 64).astype(np.float32).reshape(1, 64, 1, 1)
    shift = rng.uniform(-0.5, 1.0, 64).astype(np.float32).reshape(1, 64, 1, 1)
    x = rng.standard_normal((batch, 64, 32, 32), dtype=np.float32) * scale + shift
    return np.maximum(x, 0, out=x)


def gradient_tensor(nbytes: int = 4 * MiB, seed: int = 1) -> np.ndarray:
    """A gradient-like tensor: heavy-tailed (Student t, 3 dof) values of scale 1e-3."""
    rng = np.random.default_rng(seed)
    return (rng.standard_t(3, nbytes // 4) * 1e-3).astype(np.float32)


def measure_codecs(nbytes: int = 4 * MiB, reps: int = 7) -> list[dict[str, Any]]:
    """Codec rows: envelope encode+decode without a codec, then each codec's ratio, error and time."""
    rows = []
    activations = activation_tensor(nbytes)
    env = Envelope("activations", tensors={"x": activations})
    samples = []
    for _ in range(reps * 3):
        start = time.perf_counter()
        decode_envelope(encode_envelope(env), BENCH_LIMITS)
        samples.append(time.perf_counter() - start)
    rows.append({"section": "codec", "codec": "none", "tensor": "activations", "bytes": activations.nbytes,
                 "wire_bytes": len(encode_envelope(env)), "ratio": activations.nbytes / len(encode_envelope(env)),
                 "rel_rms": 0.0, "max_abs": 0.0, "ms": statistics.median(samples) * 1e3})
    for key, spec in CODECS.items():
        tensor = gradient_tensor(nbytes) if key == "topk" else activations
        stats = [measure(spec, tensor, BENCH_LIMITS) for _ in range(reps)]
        best = stats[0]
        rows.append({
            "section": "codec", "codec": key, "spec": spec, "tensor": "gradients" if key == "topk" else "activations",
            "bytes": tensor.nbytes, "wire_bytes": best.wire_bytes, "ratio": best.ratio, "rel_rms": best.rel_rms,
            "max_abs": best.max_abs, "ms": statistics.median(s.encode_ms + s.decode_ms for s in stats),
        })
    return rows


# -- summary --------------------------------------------------------------------


def _row(rows: list[dict[str, Any]], section: str, name: str, size: int) -> dict[str, Any] | None:
    for row in rows:
        if row["section"] == section and row.get("transport") == name and row["bytes"] == size:
            return row
    return None


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The headline figures (throughput ratios are time ratios for the same bytes)."""
    out: dict[str, float] = {}
    raw4 = _row(rows, "transport", "raw-tcp", 4 * MiB)
    for name, key in (("coap+tcp", "coap_tcp_vs_raw_4MiB"), ("coap-udp", "coap_udp_vs_raw_4MiB")):
        row = _row(rows, "transport", name, 4 * MiB)
        if raw4 and row:
            out[key] = raw4["rtt_ms_median"] / row["rtt_ms_median"]
    tcp4, tls4 = _row(rows, "transport", "coap+tcp", 4 * MiB), _row(rows, "transport", "coaps+tcp", 4 * MiB)
    if tcp4 and tls4:
        out["coaps_tcp_vs_coap_tcp_4MiB"] = tcp4["rtt_ms_median"] / tls4["rtt_ms_median"]
    raw_tls4 = _row(rows, "transport", "raw-tls", 4 * MiB)
    if raw4 and raw_tls4:  # what TLS itself costs a bare stream on this host: the ceiling of the ratio above
        out["raw_tls_vs_raw_tcp_4MiB"] = raw4["rtt_ms_median"] / raw_tls4["rtt_ms_median"]
    udp4, oscore4 = _row(rows, "transport", "coap-udp", 4 * KiB), _row(rows, "transport", "coap-udp+oscore", 4 * KiB)
    if udp4 and oscore4:
        out["oscore_udp_vs_coap_udp_4KiB"] = udp4["rtt_ms_median"] / oscore4["rtt_ms_median"]
    raw16, tcp16 = _row(rows, "transport", "raw-tcp", 16 * MiB), _row(rows, "transport", "coap+tcp", 16 * MiB)
    if raw16 and tcp16:
        out["coap_tcp_vs_raw_16MiB"] = raw16["rtt_ms_median"] / tcp16["rtt_ms_median"]
    small = _row(rows, "transport", "coap+tcp", 4 * KiB)
    if small:
        out["rtt_4KiB_ms"] = small["rtt_ms_median"]
    raw_small = _row(rows, "transport", "raw-tcp", 4 * KiB)
    if raw_small:
        out["raw_rtt_4KiB_ms"] = raw_small["rtt_ms_median"]
    for size, label in ((4 * MiB, "4MiB"), (16 * MiB, "16MiB")):
        single = _row(rows, "strategy", "single-message", size)
        for name, key in (("bert-1MiB", "bert"), ("chunked-1MiB", "chunked")):
            other = _row(rows, "strategy", name, size)
            if single and other:
                out[f"single_vs_{key}_{label}"] = other["rtt_ms_median"] / single["rtt_ms_median"]
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
    ("coap_tcp_vs_raw_4MiB", ">=", 0.5, "coap+tcp throughput / raw TCP, 4 MiB"),
    ("coaps_tcp_vs_coap_tcp_4MiB", ">=", 0.8, "protected (TLS) coap+tcp throughput / plaintext, 4 MiB"),
    ("rtt_4KiB_ms", "<=", 1.0, "coap+tcp round trip of a 4 KiB tensor, ms (median)"),
    ("codec_ms_4MiB", "<=", 2.0, "encode + decode of a 4 MiB float32 envelope, ms"),
    ("int8_channel_ratio", ">=", 3.9, "int8 per channel on activations, size ratio"),
    ("int8_channel_rel_rms", "<=", 0.01, "int8 per channel on activations, relative RMS error"),
)


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report."""
    rows, figures = result["rows"], result["ratios"]
    lines = ["Transport (loopback, server in a separate process; CoAP rows include envelope encode + decode)",
             f"{'transport':<16}{'tensor':>10}{'reps':>6}{'median ms':>12}{'p90 ms':>10}{'MB/s':>10}"]
    lines += [_transfer_line(row) for row in rows if row["section"] == "transport"]
    strategy = [row for row in rows if row["section"] == "strategy"]
    if strategy:
        lines += ["", "Large messages over coap+tcp (same encoded bytes)",
                  f"{'strategy':<16}{'tensor':>10}{'reps':>6}{'median ms':>12}{'p90 ms':>10}{'MB/s':>10}"]
        lines += [_transfer_line(row) for row in strategy]
    codecs = [row for row in rows if row["section"] == "codec"]
    if codecs:
        lines += ["", "Codecs (4 MiB float32; top-k on a gradient, the rest on ReLU activations)",
                  f"{'codec':<14}{'spec':<16}{'ratio':>8}{'rel RMS':>11}{'max abs':>10}{'enc+dec ms':>12}"]
        for row in codecs:
            lines.append(f"{row['codec']:<14}{row.get('spec', '-'):<16}{row['ratio']:>8.2f}{row['rel_rms']:>11.5f}"
                         f"{row['max_abs']:>10.4f}{row['ms']:>12.2f}")
    lines += ["", "Targets"]
    for key, op, bound, text in TARGETS:
        value = figures.get(key)
        if value is None:
            lines.append(f"  {text}: not measured")
            continue
        ok = value >= bound if op == ">=" else value <= bound
        lines.append(f"  {'PASS' if ok else 'FAIL'}  {text}: {value:.4g} (target {op} {bound:g})")
    if "raw_tls_vs_raw_tcp_4MiB" in figures:
        lines.append(f"  (TLS on a bare asyncio stream / the bare stream, 4 MiB: "
                     f"{figures['raw_tls_vs_raw_tcp_4MiB']:.4g}, the ceiling TLS itself sets here)")
    return "\n".join(lines)


def _transfer_line(row: dict[str, Any]) -> str:
    return (f"{row['transport']:<16}{_size(row['bytes']):>10}{row['reps']:>6}"
            f"{row['rtt_ms_median']:>12.3f}{row['rtt_ms_p90']:>10.3f}{row['mb_per_s']:>10.1f}")


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def parse_size(text: str) -> int:
    """'4K', '4KiB', '16M', '1048576' -> bytes."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    factor = {"K": KiB, "M": MiB}.get(value[-1:], 1)
    digits = value[:-1] if factor != 1 else value
    if not digits.isdigit() or int(digits) <= 0:
        raise ValueError(f"size {text!r} must look like 4K, 16M or a byte count")
    return int(digits) * factor


def main(argv: list[str] | None = None) -> int:
    """Command-line entry of tools/bench_transport.py."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help='print one JSON object {"rows": [...], "ratios": {...}}')
    parser.add_argument("--sizes", default=",".join(_size(s).replace(" ", "") for s in SIZES),
                        help="comma-separated tensor sizes (default 4KiB..16MiB)")
    parser.add_argument("--udp-max", default="16MiB", help="largest size also sent over CoAP/UDP (slow)")
    parser.add_argument("--repeat", type=float, default=1.0, help="scale the number of repetitions")
    parser.add_argument("--no-strategies", action="store_true", help="skip the large-message strategy comparison")
    parser.add_argument("--no-codecs", action="store_true", help="skip the codec measurements")
    args = parser.parse_args(argv)
    config = BenchConfig(sizes=tuple(parse_size(s) for s in args.sizes.split(",")),
                         udp_max_bytes=parse_size(args.udp_max), repeat=args.repeat,
                         strategies=not args.no_strategies, codecs=not args.no_codecs)
    result = run(config)
    print(json.dumps(result) if args.json else format_table(result))
    return 0
