"""``edgert worker --join``: a worker keeps offering itself, with bounded backoff, until a coordinator
accepts or refuses it (real CoAP servers on loopback, a real worker process for the refusal)."""

import asyncio
import subprocess
import sys
import time

import pytest

from edgert.protocol import JOIN, JoinRequest, read_request
from edgert.transport import BadRequest, ClientConfig, TensorClient, TensorServer
from edgert.transport.errors import ServiceUnavailable
from edgert.worker.joining import MAX_DELAY_S, Joining, join_delays
from tests.running_coordinator import free_port

pytestmark = pytest.mark.timeout(120)
WORKER_URL = "coap+tcp://127.0.0.1:5999"


def test_the_waits_double_from_half_a_second_up_to_thirty_and_never_end():
    waits = join_delays(draw=lambda low, high: 1.0)
    assert [next(waits) for _ in range(9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    jittered = [next(join_delays()) for _ in range(50)]
    assert all(0.4 <= wait <= 0.6 for wait in jittered) and len(set(jittered)) > 1
    assert MAX_DELAY_S == 30.0


class Coordinator:
    """A stand-in coordinator's /join: answers each offer with the next of ``answers`` (an error or "joined")."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.offers = []
        self.server = None

    async def start(self, port):
        self.server = TensorServer(f"coap+tcp://127.0.0.1:{port}")
        self.server.add_resource(JOIN, post=self.on_join, rt="edgert.join", kinds=("control",))
        await self.server.start()

    async def on_join(self, request):
        self.offers.append(read_request(JoinRequest.from_envelope, request.envelope))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


async def offer(coordinator: Coordinator, port: int, until, start_server_after: float = 0.0, timeout: float = 20):
    """Run a :class:`Joining` against ``port`` until ``until(joining)``; returns it and what it said."""
    said = []
    client = TensorClient(ClientConfig(timeout=5.0))
    await client.start()
    joining = Joining(client, f"coap+tcp://127.0.0.1:{port}", lambda: WORKER_URL, "board-7", said.append)
    try:
        if not start_server_after:
            await coordinator.start(port)
        joining.start()
        if start_server_after:
            await asyncio.sleep(start_server_after)
            await coordinator.start(port)
        deadline = time.monotonic() + timeout
        while not until(joining) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return joining, said
    finally:
        await joining.close()
        await client.close()
        await coordinator.server.shutdown()


def test_a_worker_started_before_its_coordinator_joins_once_it_is_up():
    coordinator = Coordinator(["joined"])
    joining, said = asyncio.run(offer(coordinator, free_port(), lambda j: j.accepted, start_server_after=1.2))
    assert joining.accepted and joining.refusal is None
    assert joining.tries >= 2  # the first try (and the second, 0.5 s later) found nobody
    assert [o.url for o in coordinator.offers] == [WORKER_URL] and coordinator.offers[0].name == "board-7"
    assert any(line.startswith("could not join") and "trying again in" in line for line in said)
    assert said[-1].startswith("joined ") and "accepted" in said[-1]


def test_a_coordinator_that_is_still_starting_is_asked_again():
    coordinator = Coordinator([ServiceUnavailable("the run is starting"), "joined"])
    joining, said = asyncio.run(offer(coordinator, free_port(), lambda j: j.accepted))
    assert joining.accepted and joining.tries == 2 and len(coordinator.offers) == 2
    assert "5.03" in said[0] and "the run is starting" in said[0]


def test_a_refusal_ends_the_offers_with_its_reason():
    coordinator = Coordinator([BadRequest("this run cannot place a worker that joins")])
    joining, said = asyncio.run(offer(coordinator, free_port(), lambda j: j.refused.is_set()))
    assert not joining.accepted and joining.tries == 1 and len(coordinator.offers) == 1
    assert "refused to let board-7 join" in joining.refusal and "4.00" in joining.refusal
    assert "cannot place a worker that joins" in joining.refusal


def test_a_refused_worker_process_exits_with_one_line():
    """``edgert worker --join`` against a coordinator that refuses it: exit status 2 (an edgert error), the reason
    as one ``error:`` line on stderr."""
    port = free_port()

    async def refuse_one():
        coordinator = Coordinator([BadRequest("this run cannot place a worker that joins")])
        await coordinator.start(port)
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edgert", "worker", "--listen", "coap+tcp://127.0.0.1:0", "--insecure",
            "--name", "refused", "--join", f"coap+tcp://127.0.0.1:{port}",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(worker.communicate(), 60)
        finally:
            await coordinator.server.shutdown()
        return worker.returncode, out.decode(), err.decode()

    code, out, err = asyncio.run(refuse_one())
    assert code == 2, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("error: ") and "refused to let refused join" in line]
    assert len(errors) == 1 and "4.00" in errors[0], err
    assert "Traceback" not in err
