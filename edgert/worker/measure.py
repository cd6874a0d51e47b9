"""The worker's measurement resources: how fast it computes a stage, and its links.

``POST /profile`` times a stage (not installed: the current one is untouched) through the
worker's own runtime; ``POST /probe`` times the link to another worker's ``/echo``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

from edgert.errors import EdgertError, ProtocolError
from edgert.protocol import ProfileOptions, StageAssignment, probe_target, read_request
from edgert.security.admission import vet_stage_files
from edgert.security.errors import GraphRefused
from edgert.transport import BadRequest, Envelope, Request, TransportError
from edgert.transport.errors import Forbidden
from edgert.worker.stage_timer import measure_stage, probe_link


class MeasureResources:
    """Mixin of :class:`edgert.worker.worker.Worker`: the handlers of /profile, /probe and /echo."""

    async def _on_profile(self, request: Request) -> Envelope:
        """Measure a stage (not installed: the current one is untouched) at a micro-batch size."""
        self._admit(request.envelope)
        try:
            profile_fields = tuple(f.name for f in dataclasses.fields(ProfileOptions))
            assignment, files = StageAssignment.from_envelope(request.envelope, beside=profile_fields)
            vet_stage_files(assignment, files)
            options = ProfileOptions.from_envelope(request.envelope)
        except ProtocolError as error:
            raise BadRequest(str(error)) from None
        except GraphRefused as error:
            raise Forbidden(f"profiling refused: {error}") from None
        except EdgertError as error:
            raise BadRequest(f"profiling refused: {error}") from None
        micro_batch, repeats = options.micro_batch, options.repeats

        def measure() -> dict:
            session = self._load(assignment, files, folder_name="profile")
            return dataclasses.asdict(measure_stage(session, micro_batch, repeats, slowdown=self.config.slowdown))

        try:
            timing = await asyncio.get_running_loop().run_in_executor(None, measure)
        except Exception as error:  # noqa: BLE001 - the files (ONNX Runtime's errors too), not this worker
            raise BadRequest(f"profiling refused: {type(error).__name__}: {error}") from None
        return Envelope(kind="control", meta={"timing": timing, "cores": os.cpu_count() or 1,
                                              "memory_bytes": _available_memory(), "worker": self.config.name,
                                              "slowdown": str(self.config.slowdown)})

    async def _on_probe(self, request: Request) -> Envelope:
        """Measure the link from this worker to ``meta.target`` (its ``/echo``)."""
        target = read_request(probe_target, request.envelope)
        try:
            result = await probe_link(self.client, target)
        except TransportError as error:
            raise BadRequest(f"{target} did not answer: {error}") from None
        return Envelope(kind="control", meta=result)

    async def _on_echo(self, request: Request) -> bytes:
        return b""


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes), 0 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
