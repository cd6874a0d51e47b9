"""The worker's measurements on request: how fast it computes a stage, and its links.

``POST /profile`` times a stage (not installed: the current one is untouched) through the
worker's own runtime; ``POST /probe`` times the link to another worker's ``/echo``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from edgert.protocol import (
    ECHO,
    PROBE,
    PROFILE,
    ProfileOptions,
    StageAssignment,
    probe_target,
    read_request,
)
from edgert.stage import StageSession
from edgert.transport import BadRequest, Envelope, Request, TensorClient, TensorServer, TransportError
from edgert.transport.tls import COORDINATOR_ROLE
from edgert.transport.transfers import Admission
from edgert.worker.machine import memory_bytes, usable_cores
from edgert.worker.slowdown import SlowdownSchedule
from edgert.worker.stage_timer import measure_stage, probe_link


class Measurement:
    """/profile, /probe and /echo: a stage timed through the worker's own runtime, a link timed to a peer.

    ``read_stage`` reads a stage sent to be timed, admitted and vetted as an assigned one is (4.00,
    4.03); ``load`` opens its files in a folder of the worker's work folder (both the worker's).
    """

    def __init__(self, client: TensorClient, name: str, slowdown: SlowdownSchedule,
                 read_stage: Callable[..., tuple[StageAssignment, dict[str, bytes]]],
                 load: Callable[[StageAssignment, dict[str, bytes], str], StageSession],
                 admit_stage: Admission | None = None):
        self._client = client
        self._name = name
        self._slowdown = slowdown
        self._read_stage = read_stage
        self._load = load
        self._admit_stage = admit_stage  # a stage sent in pieces (its files written to disk as they arrive)

    def register(self, server: TensorServer) -> None:
        """Serve /profile and /probe (the coordinator's only, over TLS) and /echo (anyone's: the other end
        of a probe)."""
        boss = (COORDINATOR_ROLE,)
        server.add_resource(PROFILE, post=self._on_profile, rt="edgert.profile", kinds=("stage",), roles=boss,
                            pieces=self._admit_stage)
        server.add_resource(PROBE, post=self._on_probe, rt="edgert.probe", kinds=("control",), roles=boss)
        server.add_resource(ECHO, post=self._on_echo, rt="edgert.echo", envelope=False)

    async def _on_profile(self, request: Request) -> Envelope:
        """Measure a stage (not installed: the current one is untouched) at a micro-batch size."""
        assignment, files, options = self._read_profile(request.envelope)
        timing = await self._time_stage(assignment, files, options)
        return Envelope(kind="control", meta={"timing": timing, "cores": usable_cores(),
                                              "memory_bytes": memory_bytes(), "worker": self._name,
                                              "slowdown": str(self._slowdown)})

    def _read_profile(self, envelope: Envelope) -> tuple[StageAssignment, dict[str, bytes], ProfileOptions]:
        """The stage to time, admitted and vetted like an assigned one, and how to time it."""
        profile_fields = tuple(f.name for f in dataclasses.fields(ProfileOptions))
        assignment, files = self._read_stage(envelope, beside=profile_fields, purpose="profiling")
        return assignment, files, read_request(ProfileOptions.from_envelope, envelope)

    async def _time_stage(self, assignment: StageAssignment, files: dict[str, bytes],
                          options: ProfileOptions) -> dict:
        """The stage's times off the transport loop (4.00 for files ONNX Runtime refuses)."""
        def measure() -> dict:
            session = self._load(assignment, files, "profile")
            timing = measure_stage(session, options.micro_batch, options.repeats, slowdown=self._slowdown)
            return dataclasses.asdict(timing)

        try:
            return await asyncio.get_running_loop().run_in_executor(None, measure)
        except Exception as error:  # noqa: BLE001 - the files (ONNX Runtime's errors too), not this worker
            raise BadRequest(f"profiling refused: {type(error).__name__}: {error}") from None

    async def _on_probe(self, request: Request) -> Envelope:
        """Measure the link from this worker to ``meta.target`` (its ``/echo``)."""
        target = read_request(probe_target, request.envelope)
        try:
            result = await probe_link(self._client, target)
        except TransportError as error:
            raise BadRequest(f"{target} did not answer: {error}") from None
        return Envelope(kind="control", meta=result)

    async def _on_echo(self, request: Request) -> bytes:
        return b""

