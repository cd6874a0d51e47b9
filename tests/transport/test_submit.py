"""The tensor path: requests submitted from another thread (or awaited on the client's loop) without a
task, answered by plain handlers from the protocol callback; every way a request can fail ends it as
the attempts' path would."""

import asyncio
import threading
import time

import numpy as np
import pytest
from aiocoap.numbers.codes import Code

from edgert.transport import (
    BadRequest,
    ClientConfig,
    Envelope,
    Limits,
    NotFound,
    PeerUnreachable,
    RequestTimeout,
    ServiceUnavailable,
    TensorClient,
    TensorServer,
)
from edgert.transport.limits import MiB
from edgert.transport.submission import ARM_INTERVAL

pytestmark = pytest.mark.timeout(60)


class Peers:
    """A server with plain and coroutine handlers, and a client, each on its own loop thread."""

    def __init__(self, config: ClientConfig = ClientConfig(timeout=5, retries=2, backoff=0.01),
                 client_limits: Limits = Limits()) -> None:
        self.server_loop, self.client_loop = _loop_thread(), _loop_thread()
        self.seen: list[tuple[int, bool]] = []  # (microbatch, answered inside a task)
        self.attempts: dict[str, int] = {}
        self.server = TensorServer("coap+tcp://127.0.0.1:0")
        self.server.add_resource("act", post=self._act, rt="edgert.test", kinds=("activations",))
        self.server.add_resource("echo", post=self._echo, rt="edgert.test")
        self.server.add_resource("busy", post=self._busy, rt="edgert.test", envelope=False)
        self.server.add_resource("hang", post=self._hang, rt="edgert.test", envelope=False)
        self.server.add_resource("broken", post=self._broken, rt="edgert.test", envelope=False)
        _run(self.server.start(), self.server_loop)
        self.url = self.server.url()
        self.client = TensorClient(config, client_limits)
        _run(self.client.start(), self.client_loop)
        self.slow_paths = 0
        attempts = self.client._attempts

        async def counted(*args, **kwargs):  # a spy: which submissions left the lean path
            self.slow_paths += 1
            return await attempts(*args, **kwargs)

        self.client._attempts = counted

    def _act(self, request):
        self.seen.append((request.envelope.microbatch, asyncio.current_task() is not None))

    def _echo(self, request):
        return request.envelope

    def _busy(self, request):
        key, fail = bytes(request.payload).decode().split(":")  # which request, and how often it is refused
        self.attempts[key] = self.attempts.get(key, 0) + 1
        if self.attempts[key] <= int(fail):
            raise ServiceUnavailable("inbox full, try again")
        return b"taken"

    async def _hang(self, request):
        self.attempts["hang"] = self.attempts.get("hang", 0) + 1
        await asyncio.sleep(30)

    def _broken(self, request):
        raise RuntimeError("plain handler exploded")

    def submit(self, path, payload=None, **kwargs):
        """Submit from this (test) thread, as a worker's compute thread does."""
        return self.client.submit("POST", self.url, path, payload, **kwargs)

    def close(self):
        _run(self.client.close(), self.client_loop)
        _run(self.server.shutdown(), self.server_loop)
        for loop in (self.client_loop, self.server_loop):
            loop.call_soon_threadsafe(loop.stop)


def _loop_thread() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def _run(coroutine, loop):
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result(30)


@pytest.fixture
def peers():
    pair = Peers()
    try:
        yield pair
    finally:
        pair.close()


def _activations(index: int, rows: int = 4) -> Envelope:
    return Envelope("activations", step=1, microbatch=index, tensors={"x": np.full((rows, 8), index, np.float32)})


def test_submissions_over_an_open_connection_take_no_task_on_either_side(peers):
    first = peers.submit("act", _activations(0))
    assert first.result(10).code == Code.CHANGED
    assert peers.slow_paths == 1  # no connection yet: the first goes the whole way
    futures = [peers.submit("act", _activations(i)) for i in range(1, 50)]
    assert all(future.result(10).code == Code.CHANGED for future in futures)
    assert peers.slow_paths == 1
    assert sorted(index for index, _ in peers.seen) == list(range(50))
    assert not any(in_task for _, in_task in peers.seen)  # plain handlers answer from the protocol callback
    assert not peers.client.submissions and not peers.server._tasks


def test_a_submitted_response_carries_the_handlers_answer_and_its_error_codes(peers):
    peers.submit("act", _activations(0)).result(10)
    back = peers.submit("echo", _activations(7, rows=3)).result(10).envelope()
    assert back.microbatch == 7 and np.array_equal(back.tensors["x"], np.full((3, 8), 7, np.float32))
    with pytest.raises(BadRequest, match="takes envelope kind.s. activations, got 'gradients'"):
        peers.submit("act", Envelope("gradients", tensors={"g": np.zeros(2, np.float32)})).result(10)
    with pytest.raises(NotFound, match="no resource at /nowhere"):
        peers.submit("nowhere", b"x").result(10)
    broken = peers.client.submit("POST", peers.url, "broken", b"x", retries=0)
    with pytest.raises(Exception, match="plain handler exploded") as failure:
        broken.result(10)
    assert failure.value.code == Code.INTERNAL_SERVER_ERROR
    assert peers.slow_paths == 1 and peers.submit("act", _activations(1)).result(10).ok  # the server goes on


def test_a_503_is_retried_with_backoff_then_raised(peers):
    peers.submit("act", _activations(0)).result(10)
    assert peers.submit("busy", b"a:2").result(10).payload == b"taken" and peers.attempts["a"] == 3
    refused = peers.submit("busy", b"b:9", retries=1)
    with pytest.raises(ServiceUnavailable, match="inbox full, try again"):
        refused.result(10)
    assert peers.attempts["b"] == 2


def test_no_response_in_time_is_retried_then_raised(peers):
    peers.submit("act", _activations(0)).result(10)
    future = peers.client.submit("POST", peers.url, "hang", b"x", timeout=0.2, retries=1)
    with pytest.raises(RequestTimeout, match=r"POST .*/hang: no response within 0.2 s \(attempt 2 of 2\)"):
        future.result(10)
    assert peers.attempts["hang"] == 2


def test_a_lost_connection_fails_the_submission_without_hanging(peers):
    peers.submit("act", _activations(0)).result(10)
    future = peers.client.submit("POST", peers.url, "hang", b"x", retries=0)
    while not peers.attempts.get("hang"):
        threading.Event().wait(0.01)
    _run(peers.server.shutdown(), peers.server_loop)
    with pytest.raises(PeerUnreachable, match=r"POST .*/hang: .*lost.* \(attempt 1 of 1\)"):
        future.result(10)
    later = peers.client.submit("POST", peers.url, "act", _activations(1), retries=1)
    with pytest.raises(PeerUnreachable, match=r"\(attempt 2 of 2\)"):
        later.result(10)
    assert not peers.client.submissions


def test_cancelled_submissions_stop_waiting_and_retrying(peers):
    peers.submit("act", _activations(0)).result(10)
    hanging = peers.client.submit("POST", peers.url, "hang", b"x", timeout=0.2, retries=5)
    while peers.attempts.get("hang", 0) < 2:  # the lean attempt timed out; the retries run in a task
        threading.Event().wait(0.01)
    assert hanging.cancel()
    threading.Event().wait(0.5)
    assert peers.attempts["hang"] == 2  # cancelling stopped the attempts
    waiting = peers.client.submit("POST", peers.url, "hang", b"x")
    while peers.attempts["hang"] < 3:
        threading.Event().wait(0.01)
    _run(peers.client.cancel_submissions(), peers.client_loop)
    assert waiting.cancelled() and not peers.client.submissions


def test_a_large_response_to_a_submission_is_completed_with_block2():
    pair = Peers(client_limits=Limits(tcp_message_bytes=1 * MiB))
    try:
        pair.submit("act", _activations(0)).result(10)
        x = np.arange(3 * MiB // 4, dtype=np.float32)
        back = pair.submit("echo", Envelope("activations", tensors={"x": x})).result(20).envelope()
        assert np.array_equal(back.tensors["x"], x)
        assert pair.slow_paths == 1  # the request went lean; only its response came in blocks
    finally:
        pair.close()


def test_submitting_before_the_client_started_is_refused():
    with pytest.raises(RuntimeError, match="start the client on its loop before submitting"):
        TensorClient().submit("POST", "coap+tcp://127.0.0.1:9", "act", b"x")


def test_awaited_requests_over_an_open_connection_go_lean_with_the_same_outcomes(peers):
    client, url = peers.client, peers.url

    async def calls():
        assert (await client.send(url, "act", _activations(0))).code == Code.CHANGED  # first contact
        for index in range(1, 20):
            assert (await client.send(url, "act", _activations(index))).code == Code.CHANGED
        assert peers.slow_paths == 1
        back = (await client.send(url, "echo", _activations(5, rows=2))).envelope()
        assert back.microbatch == 5 and np.array_equal(back.tensors["x"], np.full((2, 8), 5, np.float32))
        with pytest.raises(NotFound, match="no resource at /nowhere"):
            await client.post(url, "nowhere", b"x")
        missing = await client.post(url, "nowhere", b"x", raise_for_status=False)
        assert missing.code == Code.NOT_FOUND and not missing.ok
        assert peers.slow_paths == 1
        assert (await client.post(url, "busy", b"c:2")).payload == b"taken" and peers.attempts["c"] == 3
        with pytest.raises(RequestTimeout, match=r"POST .*/hang: no response within 0.2 s \(attempt 2 of 2\)"):
            await client.post(url, "hang", b"x", timeout=0.2, retries=1)
        slow = peers.slow_paths
        await client.post(url, "echo", _activations(1), query={"q": "1"})  # Uri-Query: the attempts' path
        assert peers.slow_paths == slow + 1
        assert not client.submissions

    _run(calls(), peers.client_loop)
    assert sorted(index for index, _ in peers.seen) == list(range(20))


def test_a_cancelled_awaited_request_stops_waiting_and_a_closing_client_fails_the_rest(peers):
    client, url = peers.client, peers.url
    _run(client.send(url, "act", _activations(0)), peers.client_loop)

    async def cancel_one():
        waiting = asyncio.ensure_future(client.post(url, "hang", b"x", timeout=20, retries=3))
        while not peers.attempts.get("hang"):
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)  # the future's done callbacks
        assert not client.submissions
        assert not any(connection._pending for connection in client._tcp._pool.values())

    _run(cancel_one(), peers.client_loop)
    left = asyncio.run_coroutine_threadsafe(client.post(url, "hang", b"x", timeout=20), peers.client_loop)
    while peers.attempts["hang"] < 2:
        threading.Event().wait(0.01)
    _run(client.close(), peers.client_loop)
    with pytest.raises(PeerUnreachable, match=r"POST .*/hang: the client is closing"):
        left.result(10)
    assert peers.attempts["hang"] == 2


def _connection(peers):
    (connection,) = peers.client._tcp._pool.values()
    return connection


def test_threads_write_their_frames_themselves_and_frames_never_interleave(peers):
    peers.submit("act", _activations(0)).result(10)  # first contact
    connection = _connection(peers)
    written = []
    write = connection.write_from_thread

    def spy(*args):
        written.append(write(*args))
        return written[-1]

    connection.write_from_thread = spy
    results: dict[int, np.ndarray] = {}

    def sender(first: int):
        futures = {i: peers.submit("echo", _activations(i, rows=1 + i % 5)) for i in range(first, first + 25)}
        for i, future in futures.items():
            results[i] = future.result(10).envelope().tensors["x"]

    async def from_the_loop():  # the loop's own writes (Uri-Query: the attempts' path) between the threads'
        for i in range(100, 125):
            back = await peers.client.post(peers.url, "echo", _activations(i), query={"n": str(i)})
            results[i] = back.envelope().tensors["x"]

    threads = [threading.Thread(target=sender, args=(k * 25,)) for k in range(4)]
    for thread in threads:
        thread.start()
    _run(from_the_loop(), peers.client_loop)
    for thread in threads:
        thread.join(30)
    assert sorted(results) == list(range(100)) + list(range(100, 125))
    for i, x in results.items():
        rows = 4 if i >= 100 else 1 + i % 5
        assert np.array_equal(x, np.full((rows, 8), i, np.float32))
    assert written.count(True) == 100 and peers.slow_paths == 1 + 25
    assert not peers.client.submissions and not connection._pending and connection._handoff is None


class _Trickle:
    """The connection's socket as a full send buffer makes it: it takes at most ``most`` bytes a call."""

    def __init__(self, sock, most: int):
        self._sock, self._most = sock, most
        self.partial = 0

    def send(self, data):
        taken = self._sock.send(bytes(data[:self._most]))
        self.partial += taken < len(data)
        return taken

    def close(self):
        self._sock.close()


def test_what_the_socket_did_not_take_is_written_by_the_loop_before_anything_else(peers):
    peers.submit("act", _activations(0)).result(10)
    connection = _connection(peers)
    trickle = connection._socket = _Trickle(connection._socket, 100)
    futures = [peers.submit("echo", _activations(i, rows=6)) for i in range(1, 30)]
    loop_side = asyncio.run_coroutine_threadsafe(
        peers.client.post(peers.url, "echo", _activations(77), query={"n": "1"}), peers.client_loop)
    for i, future in enumerate(futures, start=1):
        assert np.array_equal(future.result(10).envelope().tensors["x"], np.full((6, 8), i, np.float32))
    assert loop_side.result(10).envelope().microbatch == 77
    assert trickle.partial >= 1  # frames went out in part from the thread, the rest from the loop
    assert connection._handoff is None and not peers.client.submissions


def test_thread_written_requests_wake_the_loop_once_a_round_and_their_timers_count_from_the_write(peers):
    peers.submit("act", _activations(0)).result(10)  # first contact
    wakes = []
    call_soon_threadsafe = peers.client_loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):
        wakes.append(callback)
        return call_soon_threadsafe(callback, *args, **kwargs)

    peers.client_loop.call_soon_threadsafe = counted
    try:
        futures = [peers.submit("act", _activations(i)) for i in range(1, 41)]
        for future in futures:
            future.result(10)
        threading.Event().wait(3 * ARM_INTERVAL)  # the rounds run dry and stop
        assert len(peers.seen) == 41 and 1 <= len(wakes) <= 3, wakes  # not one wake per request
        assert not peers.client._written._scheduled and not peers.client.submissions
        started = time.monotonic()
        with pytest.raises(RequestTimeout, match=r"no response within 0.3 s \(attempt 1 of 1\)"):
            peers.client.submit("POST", peers.url, "hang", b"x", timeout=0.3, retries=0).result(10)
        assert 0.3 <= time.monotonic() - started < 0.3 + ARM_INTERVAL + 0.2
    finally:
        peers.client_loop.call_soon_threadsafe = call_soon_threadsafe


def test_closing_ends_thread_written_requests_whose_timers_are_not_armed_yet(peers):
    peers.submit("act", _activations(0)).result(10)
    waiting = [peers.client.submit("POST", peers.url, "hang", b"x") for _ in range(3)]
    _run(peers.client.cancel_submissions(), peers.client_loop)
    assert all(future.cancelled() for future in waiting) and not peers.client.submissions
