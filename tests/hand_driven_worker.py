"""Helpers for tests that drive a real worker by hand, standing in for its coordinator and neighbours."""

from __future__ import annotations

import asyncio

from edgert.protocol import ACT, DATA_KINDS, GRAD, GROUP_GRAD, GROUP_GRAD_KIND, REPORT, STOP
from edgert.transport import Envelope, TensorClient, TensorServer, TransportError


class StandIn:
    """A stand-in for every other party (the neighbours, the other member, the coordinator): records what it gets."""

    def __init__(self) -> None:
        self.server = TensorServer("coap+tcp://127.0.0.1:0")
        self.received: dict[str, list[Envelope]] = {ACT: [], GRAD: [], GROUP_GRAD: []}
        self.arrived = asyncio.Event()
        for path, kind in ((ACT, DATA_KINDS[ACT]), (GRAD, DATA_KINDS[GRAD]), (GROUP_GRAD, GROUP_GRAD_KIND)):
            self.server.add_resource(path, post=self._recorder(path), rt=f"edgert.{kind}", kinds=(kind,))
        self.server.add_resource(REPORT, post=self._ignore, rt="edgert.report", kinds=("report",))

    def _recorder(self, path):
        async def record(request):
            self.received[path].append(request.envelope)
            self.arrived.set()
        return record

    async def _ignore(self, request):
        return None

    async def wait(self, path: str, count: int) -> list[Envelope]:
        for _ in range(600):
            if len(self.received[path]) >= count:
                return self.received[path]
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        raise AssertionError(f"no {count} /{path} message(s) arrived: {self.received}")


async def end_hand_driven_run(client: TensorClient, worker: str, stand_in: TensorServer) -> None:
    """Stop the worker's run (it may have stopped already, or be gone), close the client, shut the stand-in down."""
    try:
        await client.post(worker, STOP, b"test over")
    except TransportError:
        pass
    await client.close()
    await stand_in.shutdown()
