"""Live server and client on loopback: round trips, large messages, discovery, observe, timeouts, threads."""

import asyncio
import threading
import time

import aiocoap
import aiocoap.resource
import numpy as np
import pytest
from aiocoap.numbers.codes import Code

from edgert.transport import (
    DTYPES,
    ClientConfig,
    Envelope,
    Limits,
    PeerUnreachable,
    RequestTimeout,
    ServiceUnavailable,
    SyncClient,
    TensorClient,
    TensorServer,
    encode_envelope,
)
from edgert.transport.client import _body
from edgert.transport.limits import MiB

pytestmark = pytest.mark.timeout(60)


def values(dtype, shape):
    count = int(np.prod(shape))
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    base = np.arange(count) % 200 - (0 if info is not None and info.min == 0 else 100)
    return base.astype(dtype).reshape(shape)


@pytest.mark.parametrize("scheme", ["tcp", "udp"])
def test_every_dtype_round_trips(live, scheme):
    url = getattr(live, scheme)
    tensors = {dtype: values(dtype, (3, 5)) for dtype in DTYPES}
    tensors["scalar"] = np.array(2.5, np.float64)
    tensors["empty"] = np.zeros((0, 4), np.int32)
    sent = Envelope("activations", "run", 5, 1, 2, tensors, {"note": scheme})
    back = live.client.post(url, "echo", sent).envelope()
    assert (back.kind, back.run_id, back.step, back.microbatch, back.stage) == ("activations", "run", 5, 1, 2)
    assert back.meta == {"note": scheme}
    for name, array in tensors.items():
        assert back.tensors[name].dtype == array.dtype and np.array_equal(back.tensors[name], array), name


@pytest.mark.parametrize("scheme", ["tcp", "udp"])
@pytest.mark.parametrize("spec, tolerance", [("none", 0), ("fp16", 2e-3), ("int8", 0.02), ("int8:axis=1", 0.02),
                                             ("int4", 0.3), ("int4:axis=1", 0.3), ("topk:ratio=0.25", None)])
def test_every_codec_round_trips(live, scheme, spec, tolerance):
    x = np.random.default_rng(3).standard_normal((4, 8, 6)).astype(np.float32)
    live.client.send(getattr(live, scheme), "sink", Envelope("activations", tensors={"x": x}), codec=spec)
    received = live.received[-1]
    assert received.codecs["x"] == spec.split(":")[0]
    got = received.tensors["x"]
    assert got.shape == x.shape and got.dtype == x.dtype
    if tolerance is None:
        kept = got != 0
        assert kept.sum() == x.size // 4 and np.array_equal(got[kept], x[kept])
    else:
        assert np.abs(got - x).max() <= tolerance * np.abs(x).max()


def test_large_messages_travel_as_one_message(live):
    x = np.random.default_rng(1).standard_normal(5 * MiB // 4).astype(np.float32)  # beyond aiocoap's 1 MiB
    live.client.send(live.tcp, "sink", Envelope("activations", tensors={"x": x}))
    assert np.array_equal(live.received[-1].tensors["x"], x)
    weights = live.client.fetch(live.tcp, "weights", query={"bytes": str(6 * MiB)})
    assert weights.tensors["w"].nbytes == 6 * MiB and weights.tensors["w"][-1] == 6 * MiB // 4 - 1


def test_envelope_bodies_reference_tensor_data_instead_of_copying_it():
    x = np.arange(100_000, dtype=np.float32)
    env = Envelope("activations", tensors={"x": x})
    parts, content_format = _body(env, None, None)
    assert content_format == 60 and b"".join(parts) == encode_envelope(env)
    assert any(isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), x) for p in parts)


def test_bert_when_the_server_advertises_a_small_message_size(live):
    async def scenario():
        got = []

        async def sink(request):
            got.append(request.envelope)

        server = TensorServer("coap+tcp://127.0.0.1:0", limits=Limits(max_payload_bytes=8 * MiB,
                                                                      tcp_message_bytes=1 * MiB))
        server.add_resource("sink", post=sink, rt="edgert.test")
        async with server:
            x = np.arange(3 * MiB // 4, dtype=np.float32)
            await live.aclient.send(server.url(), "sink", Envelope("activations", tensors={"x": x}))
            return got, x

    got, x = live.call(scenario())
    assert np.array_equal(got[0].tensors["x"], x)


def test_large_responses_to_a_client_with_a_small_limit_use_block2(live):
    async def scenario():
        async with TensorClient(limits=Limits(tcp_message_bytes=1 * MiB)) as client:
            return await client.fetch(live.tcp, "weights", query={"bytes": str(3 * MiB)})

    weights = live.call(scenario())
    assert weights.tensors["w"].nbytes == 3 * MiB and weights.tensors["w"][-1] == 3 * MiB // 4 - 1


def test_interop_with_stock_aiocoap_both_ways(live):
    class Length(aiocoap.resource.Resource):
        async def render_post(self, request):
            return aiocoap.Message(code=Code.CHANGED, payload=str(len(request.payload)).encode())

    async def scenario():
        payload = bytes(3 * MiB)
        stock = await aiocoap.Context.create_client_context(transports=["tcpclient"])
        try:  # stock client (1 MiB messages, BERT) -> our server
            request = aiocoap.Message(code=Code.POST, uri=f"{live.tcp}/raw", payload=payload)
            response = await stock.request(request).response
            assert response.code == Code.CHANGED and response.payload == str(len(payload)).encode()
        finally:
            await stock.shutdown()
        site = aiocoap.resource.Site()
        site.add_resource(["len"], Length())
        server = TensorServer("coap+tcp://127.0.0.1:0")  # borrow a free port for the stock server
        await server.start()
        port = int(server.url().rsplit(":", 1)[1])
        await server.shutdown()
        stock_server = await aiocoap.Context.create_server_context(site, bind=("127.0.0.1", port),
                                                                   transports=["tcpserver"])
        try:  # our client -> stock server (advertises 1 MiB: our client sends BERT)
            response = await live.aclient.post(f"coap+tcp://127.0.0.1:{port}", "len", payload)
            assert response.payload == str(len(payload)).encode()
        finally:
            await stock_server.shutdown()

    live.call(scenario())


def test_udp_carries_blockwise_payloads(live):
    x = np.arange(16 * 1024, dtype=np.float32)  # 64 KiB: 64 Block1 blocks
    back = live.client.post(live.udp, "echo", Envelope("activations", tensors={"x": x})).envelope()
    assert np.array_equal(back.tensors["x"], x)


@pytest.mark.parametrize("scheme", ["tcp", "udp"])
def test_discovery(live, scheme):
    url = getattr(live, scheme)
    links = {link.href: link for link in live.client.discover(url)}
    assert "/.well-known/core" not in links
    assert links["/sink"].rt == ("edgert.activations",) and links["/sink"].ct == (60,)
    assert links["/health"].observable and links["/weights"].get("title") == "stage weights"
    assert [link.href for link in live.client.discover(url, rt="edgert.health")] == ["/health"]
    assert {link.href for link in live.client.discover(url, rt="edgert.test.*")} >= {"/echo", "/raw", "/slow"}


@pytest.mark.parametrize("scheme", ["tcp", "udp"])
def test_observe_health(live, scheme):
    async def scenario():
        observation = live.aclient.observe(getattr(live, scheme), "health")
        first = await observation.__anext__()
        seqs = [first.envelope().meta["seq"]]
        for seq in range(1, 4):
            live.health.notify(Envelope("health", meta={"seq": seq}))
            note = await asyncio.wait_for(observation.__anext__(), 5)
            seqs.append(note.envelope().meta["seq"])
        assert live.health.observers >= 1
        observation.cancel()
        with pytest.raises(StopAsyncIteration):
            await observation.__anext__()
        return seqs

    seqs = live.call(scenario())
    assert seqs[1:] == [1, 2, 3] and seqs[0] in (0, 3)


def test_timeouts_are_explicit_and_retried(live):
    live.attempts.clear()
    start = time.monotonic()
    with pytest.raises(RequestTimeout, match="no response within 0.2 s .attempt 2 of 2."):
        live.client.get(live.tcp, "slow", query={"s": "1"}, timeout=0.2, retries=1)
    assert 0.35 < time.monotonic() - start < 1.5
    assert live.attempts["slow"] == 2
    assert live.client.get(live.tcp, "slow", query={"s": "0"}, timeout=2).payload == b"late"


@pytest.mark.parametrize("scheme", ["tcp", "udp"])
def test_service_unavailable_is_retried(live, scheme):
    key = f"flaky-{scheme}"
    response = live.client.get(getattr(live, scheme), "flaky", query={"key": key, "fail": "2"}, retries=2)
    assert response.payload == b"ok" and live.attempts[key] == 3
    with pytest.raises(ServiceUnavailable, match="busy, try again"):
        live.client.get(getattr(live, scheme), "flaky", query={"key": key + "x", "fail": "5"}, retries=1)


def test_unreachable_peer(live):
    async def scenario():
        server = TensorServer("coap+tcp://127.0.0.1:0")
        await server.start()
        url = server.url()
        await server.shutdown()
        client = TensorClient(ClientConfig(timeout=2, retries=1, backoff=0.01))
        try:
            with pytest.raises(PeerUnreachable, match="attempt 2 of 2"):
                await client.get(url, "x")
        finally:
            await client.close()

    live.call(scenario())


def test_sync_client_from_worker_threads(live):
    results, errors = [], []

    def worker(index):
        try:
            x = np.full(10, index, np.float32)
            back = live.client.post(live.tcp, "echo", Envelope("activations", microbatch=index, tensors={"x": x}))
            results.append(back.envelope().tensors["x"][0] == index)
        except Exception as exc:  # collected and re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and results == [True] * 8
    with SyncClient.start(ClientConfig(timeout=5)) as own:
        assert own.fetch(live.tcp, "weights").tensors["w"].shape == (16,)
        assert own.get(live.udp, "weights").ok


def test_servers_on_port_zero_get_distinct_ports_and_shut_down_cleanly():
    async def scenario():
        servers = [TensorServer("coap+tcp://127.0.0.1:0", "coap://127.0.0.1:0") for _ in range(3)]
        for server in servers:
            server.add_resource("x", get=lambda request: asyncio.sleep(0, b"x"), rt="t", envelope=False)
            await server.start()
        urls = [url for server in servers for url in server.urls]
        assert len(set(urls)) == 6
        async with TensorClient(ClientConfig(timeout=2, retries=0)) as client:
            assert (await client.get(servers[0].url("coap"), "x")).payload == b"x"
            for server in servers:
                await server.shutdown()
                await server.shutdown()  # idempotent
            with pytest.raises(PeerUnreachable):
                await client.get(urls[0], "x")

    asyncio.run(scenario())


def test_bad_configuration_is_refused_up_front():
    with pytest.raises(ValueError, match="scheme must be one of"):
        TensorServer("http://127.0.0.1:0")
    with pytest.raises(ValueError, match="at least one bind URL"):
        TensorServer()
    server = TensorServer("coap+tcp://127.0.0.1:0")
    with pytest.raises(ValueError, match="needs at least one handler"):
        server.add_resource("x", rt="t")
    server.add_resource("x", get=lambda r: None, rt="t")
    with pytest.raises(ValueError, match="already registered at /x"):
        server.add_resource("/x/", post=lambda r: None, rt="t")
    with pytest.raises(ValueError, match="ClientConfig.timeout must be a positive number"):
        ClientConfig(timeout=0)
    with pytest.raises(ValueError, match="unsupported method 'PATCHY'"):
        asyncio.run(TensorClient().request("PATCHY", "coap+tcp://127.0.0.1:1"))
    with pytest.raises(ValueError, match="Limits.max_tensors must be >= 1"):
        Limits(max_tensors=0)


def test_notify_from_another_thread_reaches_observers(live):
    registered = threading.Event()

    async def observe_two():
        observation = live.aclient.observe(live.tcp, "health")
        await observation.__anext__()
        registered.set()
        note = await asyncio.wait_for(observation.__anext__(), 5)
        observation.cancel()
        return note.envelope().meta["seq"]

    future = asyncio.run_coroutine_threadsafe(observe_two(), live.loop)
    assert registered.wait(5)
    live.health.notify(Envelope("health", meta={"seq": 42}))  # from the test thread, not the loop
    assert future.result(10) == 42


def test_sync_client_refuses_to_deadlock_its_own_loop(live):
    async def inside_the_loop():
        coroutine = live.aclient.get(live.tcp, "weights")
        try:
            live.client.call(coroutine)
        finally:
            coroutine.close()

    with pytest.raises(RuntimeError, match="would deadlock"):
        live.call(inside_the_loop())


def test_cancel_deregisters_over_tcp(live):
    async def scenario():
        before = live.health.observers
        observation = live.aclient.observe(live.tcp, "health")
        await observation.__anext__()
        registered = live.health.observers
        observation.cancel()
        for _ in range(100):
            if live.health.observers < registered:
                break
            await asyncio.sleep(0.01)
        return before, registered, live.health.observers

    before, registered, after = live.call(scenario())
    assert registered == before + 1 and after == before


def test_resources_can_be_removed(live):
    async def gone(request):
        return b"here"

    live.server.add_resource("temporary", get=gone, rt="edgert.test.tmp", envelope=False)
    assert live.client.get(live.tcp, "temporary").payload == b"here"
    live.server.remove_resource("temporary")
    response = live.client.get(live.tcp, "temporary", raise_for_status=False)
    assert response.code == Code.NOT_FOUND
    assert "/temporary" not in {link.href for link in live.client.discover(live.tcp)}
    with pytest.raises(KeyError, match="no removable resource"):
        live.server.remove_resource(".well-known/core")


def test_handlers_that_suspend_finish_in_a_task_and_can_be_cancelled():
    async def scenario():
        gate = asyncio.Event()
        started = []

        async def waits(request):
            started.append(request.query["n"])
            await gate.wait()
            if request.query["n"] == "boom":
                raise ValueError("after suspending")
            return b"done " + request.query["n"].encode()

        async def never(request):
            await asyncio.Event().wait()

        server = TensorServer("coap+tcp://127.0.0.1:0")
        server.add_resource("waits", get=waits, rt="edgert.test", envelope=False)
        server.add_resource("never", get=never, rt="edgert.test", envelope=False)
        await server.start()
        async with TensorClient(ClientConfig(timeout=5, retries=0)) as client:
            calls = [asyncio.ensure_future(client.get(server.url(), "waits", query={"n": n}, raise_for_status=False))
                     for n in ("1", "2", "boom")]
            hanging = asyncio.ensure_future(client.get(server.url(), "never", retries=0, timeout=5))
            while len(started) < 3 or len(server._tasks) < 4:  # each suspended handler goes on in a task
                await asyncio.sleep(0.01)
            assert not any(call.done() for call in calls)
            gate.set()
            answers = await asyncio.gather(*calls)
            await server.shutdown()  # cancels the handler still waiting
            with pytest.raises(PeerUnreachable):
                await hanging
        return answers, len(server._tasks)

    answers, left = asyncio.run(scenario())
    assert [a.payload for a in answers[:2]] == [b"done 1", b"done 2"]
    assert answers[2].code == Code.INTERNAL_SERVER_ERROR and b"after suspending" in answers[2].payload
    assert left == 0
