"""``edgert worker``: the on-device runtime. Serves CoAP resources, trains its stage.

Two threads share the work: the transport loop answers requests (stage assignment, tensors
from the neighbours, commands from the coordinator) and sends tensors on; the compute
thread (edgert.worker.compute_thread) walks the schedule and blocks only on the inbox. A bad
message is answered with an error code and changes nothing; the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgert.errors import EdgertError, ProtocolError
from edgert.protocol import (
    HEALTH,
    MAX_STAGE_BYTES,
    RUN,
    STAGE,
    STOP,
    Hold,
    Segment,
    StageAssignment,
    Truncate,
    read_request,
    run_command,
    stop_reason,
)
from edgert.providers import DEFAULT_PROVIDERS
from edgert.security.admission import Admission, vet_stage_files
from edgert.security.errors import AdmissionRefused, GraphRefused
from edgert.stage import StageSession, Threads
from edgert.transport import (
    BadRequest,
    ClientConfig,
    Envelope,
    Request,
    TensorClient,
    TensorServer,
    TooLarge,
    get_codec,
)
from edgert.transport.coap_tcp import DEFAULT_PORT
from edgert.transport.errors import Forbidden, UnsupportedContentFormat
from edgert.transport.limits import DEFAULT_LIMITS, Limits
from edgert.transport.message import TEXT
from edgert.transport.pieces import FileSink, Piece, Sink
from edgert.transport.tls import COORDINATOR_ROLE, TlsCredentials
from edgert.transport.urls import parse_url
from edgert.worker.compute_thread import ComputeThread
from edgert.worker.current_stage import CurrentStage
from edgert.worker.executor import StageExecutor
from edgert.worker.inputs import StageInputs
from edgert.worker.joining import Joining
from edgert.worker.measurement import Measurement
from edgert.worker.outbox import Outbox
from edgert.worker.slowdown import SlowdownSchedule
from edgert.worker.stage_weights import StageWeights

log = logging.getLogger("edgert.worker.worker")
DISK_RESERVE = 64 << 20  # free disk space a stage sent in pieces leaves


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker listens and how fast it pretends to be."""

    listen: str = f"coap+tcp://0.0.0.0:{DEFAULT_PORT}"
    name: str = "worker"
    slowdown: SlowdownSchedule = field(default_factory=SlowdownSchedule)
    workdir: Path | None = None
    limits: Limits = DEFAULT_LIMITS
    send_timeout: float = 30.0
    join: str | None = None  # a coordinator to announce this worker to (joining a running job)
    advertise: str | None = None  # the host others reach this worker at (default: the listen host)
    tls: TlsCredentials | None = None  # this device's cluster credential (None: plaintext, --insecure)
    providers: tuple[str, ...] = DEFAULT_PROVIDERS  # onnxruntime execution providers, CPU last


class Worker:
    """One device's runtime: a CoAP server, the stage it is assigned and the compute thread that trains it.

    The worker installs stages and answers the coordinator's commands (/stage, /run, /stop, /health);
    its parts each serve the resources of the state they own: :class:`StageInputs` the inbox (/batch,
    /act, /grad), :class:`StageWeights` the stage's state and the copies (/weights, /replica,
    /migrate), :class:`Measurement` the timings (/profile, /probe, /echo). :class:`CurrentStage` is
    what they share: the stage installed, the segments announced, the health.
    """

    def __init__(self, config: WorkerConfig, say: Callable[[str], None] | None = None):
        self.config = config
        self.say = say or (lambda line: log.warning("%s: %s", config.name, line))  # its console
        self.server = TensorServer(config.listen, limits=config.limits, tls=config.tls)
        self.client = TensorClient(ClientConfig(timeout=config.send_timeout, retries=3), config.limits,
                                   tls=config.tls)
        self.admission = None if config.tls is None else Admission(config.tls.cluster_pem,
                                                                     config.tls.revocations)
        self.outbox = Outbox(self.client, config.name)
        self.current = CurrentStage(config.name, config.slowdown)
        self.inputs = StageInputs(self.current)
        self.weights = StageWeights(self.current, self.client, self.outbox, config.slowdown, config.limits,
                                    own_url=lambda: self.url)
        self.measurement = Measurement(self.client, config.name, config.slowdown, read_stage=self._read_stage,
                                       load=self._load, admit_stage=self._admit_stage)
        self.compute = ComputeThread(self.current, self.outbox, config.name, after_step=self.weights.replicate)
        self._workdir = Path(config.workdir) if config.workdir else Path(tempfile.mkdtemp(prefix="edgert-worker-"))
        self._owns_workdir = config.workdir is None
        self._load_lock = asyncio.Lock()
        self.joining = (None if config.join is None else
                        Joining(self.client, config.join, lambda: self.url, config.name, self.say))
        self._register_resources()

    def _register_resources(self) -> None:
        """The worker's own resources; each part registers those of the state it owns."""
        server = self.server
        boss = (COORDINATOR_ROLE,)  # over TLS, only the coordinator may command a worker
        server.add_observable(HEALTH, rt="edgert.health", get=self._on_health, title="worker health")
        server.add_resource(STAGE, put=self._on_stage, rt="edgert.stage", kinds=("stage",), roles=boss,
                            pieces=self._admit_stage)
        server.add_resource(RUN, post=self._on_run, rt="edgert.run", kinds=("control",), roles=boss)
        server.add_resource(STOP, post=self._on_stop, rt="edgert.stop", envelope=False, roles=boss)
        self.inputs.register(server)
        self.weights.register(server)
        self.measurement.register(server)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind the server and start the compute thread; returns the URL it listens on."""
        await self.server.start()
        await self.client.start()
        self.compute.start()
        if self.joining is not None:
            self.joining.start()
        return self.url

    @property
    def url(self) -> str:
        url = self.server.urls[0]
        if self.config.advertise:
            scheme, _, port = parse_url(url)
            return f"{scheme}://{self.config.advertise}:{port}"
        return url

    async def shutdown(self) -> None:
        """Stop computing, end the sends in flight, stop serving, remove the work folder.

        A worker told to stop has no failure to report: its peers may be stopping too, so a
        send that fails now ends the window quietly, and every send task is awaited here
        rather than left to fail after the loop is gone.
        """
        self.outbox.close()
        if self.joining is not None:
            await self.joining.close()
        await self._stop_run("worker is shutting down")
        await self.compute.stop()
        await self.outbox.wait_closed()
        await self.server.shutdown()
        await self.client.close()
        if self._owns_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    async def _on_health(self, request: Request) -> Envelope:
        return self.current.health_now().to_envelope()

    # -- installing a stage ------------------------------------------------------------------

    async def _on_stage(self, request: Request) -> Envelope:
        assignment, files = self._read_stage(request.envelope)
        async with self._load_lock:
            await self._stop_run("a new stage was assigned")
            await self.compute.until_idle()
            started = time.perf_counter()
            session = await self._open(assignment, files, started)
            self._install(assignment, session)
        load_ms = (time.perf_counter() - started) * 1000
        settings = assignment.settings
        log.info("%s: loaded stage %d of run %s in %.0f ms (ORT threads %d forward, %d backward, %s%s)",
                 self.config.name, assignment.entry.index, assignment.run_id, load_ms, settings.forward_threads,
                 settings.backward_threads, "side by side" if settings.side_by_side else "one after the other",
                 ", weight gradients once a step" if session.splits else "")
        if self.joining is not None:
            self.say(f"given stage {assignment.entry.index} of run {assignment.run_id} "
                     f"({len(assignment.entry.blocks)} blocks, loaded in {load_ms:.0f} ms)")
        return Envelope(kind="control", run_id=assignment.run_id, stage=assignment.entry.index,
                        meta={"loaded": True, "load_ms": load_ms, "worker": self.config.name})

    def _admit_stage(self, request: Request, piece: Piece) -> Sink:
        """A stage assignment (``PUT /stage``, ``POST /profile``) in pieces: written to this worker's disk as it
        arrives (removed once read), up to :data:`MAX_STAGE_BYTES` and the free space there."""
        self._workdir.mkdir(parents=True, exist_ok=True)
        room = min(MAX_STAGE_BYTES, shutil.disk_usage(self._workdir).free - DISK_RESERVE)
        if piece.size > room:
            raise TooLarge(f"a stage assignment of {piece.size} bytes; this worker takes at most {max(room, 0)} "
                           f"(MAX_STAGE_BYTES, or its free disk space less {DISK_RESERVE >> 20} MiB)",
                           size1=max(room, 0))
        return FileSink(self._workdir / "incoming" / f"stage-{piece.transfer}.cbor", keep=False)

    def _read_stage(self, envelope: Envelope, beside: tuple[str, ...] = (),
                    purpose: str = "stage") -> tuple[StageAssignment, dict[str, bytes]]:
        """A stage sent to be run (``purpose`` "stage") or timed ("profiling"), with its files, admitted and
        vetted before anything is touched; ``beside``: other fields its meta may hold."""
        self._admit(envelope)
        try:
            assignment, files = StageAssignment.from_envelope(envelope, beside)
            if purpose == "stage" and not assignment.peers.coordinator:
                raise ProtocolError("stage assignment names no coordinator (meta.peers.coordinator)")
            vet_stage_files(assignment, files)
        except ProtocolError as error:
            raise BadRequest(str(error)) from None
        except GraphRefused as error:
            raise Forbidden(f"{purpose} refused: {error}") from None
        except EdgertError as error:
            raise BadRequest(f"{purpose} refused: {error}") from None
        return assignment, files

    def _admit(self, envelope: Envelope) -> None:
        """With a credential, refuse (4.03) a stage the cluster did not sign."""
        if self.admission is None:
            return
        try:
            self.admission.check_assignment(envelope)
        except AdmissionRefused as error:
            raise Forbidden(str(error)) from None

    async def _open(self, assignment: StageAssignment, files: dict[str, bytes], started: float) -> StageSession:
        """Load the stage off the transport loop (4.00 for files ONNX Runtime refuses), as slowly as emulated."""
        self.current.activity = "loading"
        try:
            session = await asyncio.get_running_loop().run_in_executor(None, self._load, assignment, files)
            # an emulated slower device also loads more slowly
            await asyncio.sleep(self.config.slowdown.extra(max(self.current.health.step, 0),
                                                           time.perf_counter() - started))
        except Exception as error:  # noqa: BLE001 - the files (ONNX Runtime's errors too), not this worker
            raise BadRequest(f"stage {assignment.entry.index} refused: {type(error).__name__}: {error}") \
                from None
        finally:
            self.current.activity = ""
        return session

    def _load(self, assignment: StageAssignment, files: dict[str, bytes], folder_name: str = "") -> StageSession:
        """Write the files and open the sessions; callers have checked them with :func:`vet_stage_files`
        (hashes, graphs), so they are not read back and hashed again here."""
        entry = assignment.entry
        folder = self._workdir / assignment.run_id / (folder_name or f"stage{entry.index}-{'-'.join(entry.blocks)}")
        folder.mkdir(parents=True, exist_ok=True)
        for artifact in assignment.artifacts:
            (folder / Path(artifact.path).name).write_bytes(files[artifact.role])
        local = dataclasses.replace(entry, artifacts=tuple(
            dataclasses.replace(a, path=Path(a.path).name) for a in entry.artifacts))
        settings = assignment.settings
        return StageSession(local, folder, settings.training, Threads(settings.forward_threads,
                                                                      settings.backward_threads),
                            settings.memory_mode, self.config.providers, settings.split_backward)

    def _install(self, assignment: StageAssignment, session: StageSession) -> None:
        """Make ``session`` the current stage: what was sent, received or queued for the last one is dropped."""
        self.weights.new_assignment(assignment)
        self.outbox.new_generation()
        self.outbox.forget()
        self.inputs.inbox.reset()
        self.compute.new_stage({"forward": get_codec(assignment.forward_codec),
                                "backward": get_codec(assignment.backward_codec)})
        executor = StageExecutor(session, assignment.entry.index, self.inputs.inbox,
                                 self.compute.send_forward, self.compute.send_backward,
                                 self.config.slowdown, assignment.settings.wait_timeout,
                                 before_wait=self.compute.flush_reports, routing=assignment.routing,
                                 send_group=self.compute.send_group,
                                 group_codec=get_codec(assignment.group_codec),
                                 side_by_side=assignment.settings.side_by_side)
        self.current.install(assignment, session, executor)

    # -- running it --------------------------------------------------------------------------

    async def _on_run(self, request: Request) -> Envelope | None:
        self.current.check_run(request.envelope)
        command = read_request(run_command, request.envelope)
        if isinstance(command, Hold):
            return self._hold()
        if isinstance(command, Truncate):
            self._truncate(command.last_step)
            return None
        self._start_segment(command)
        return None

    def _hold(self) -> Envelope:
        """Hold the stage at the next step boundary; say which steps it has begun and committed (re-planning)."""
        begun, committed = self.current.executor.gate.hold()
        return Envelope(kind="control", run_id=self.current.run_id, step=max(begun, 0),
                        meta={"command": "hold", "begun": begun, "committed": committed,
                              "worker": self.config.name})

    def _truncate(self, last_step: int) -> None:
        """Stop after ``last_step``: later steps are dropped, the pipeline drains (re-planning)."""
        self.inputs.inbox.truncate(last_step)
        self.current.executor.gate.open()
        self.compute.truncate(last_step)

    def _start_segment(self, segment: Segment) -> None:
        """Queue a segment's windows for the compute thread; what arrives for its steps is let in from now on."""
        stages = self.current.assignment.stages
        if segment.stages != stages:
            raise BadRequest(f"run command is for {segment.stages} stages; this run has {stages}")
        self.current.announce(segment)
        self.weights.training_resumed()
        self.compute.queue_segment(segment)

    async def _on_stop(self, request: Request) -> str:
        if request.content_format not in (None, TEXT):
            raise UnsupportedContentFormat(f"/{STOP} takes text (Content-Format {TEXT}), got {request.content_format}")
        await self._stop_run(read_request(stop_reason, request.payload))
        return "stopped"

    async def _stop_run(self, reason: str) -> None:
        """Abort what the compute thread waits for and forget the run's segments; the stage stays loaded."""
        self.inputs.inbox.abort(reason)
        if self.current.executor is not None:
            self.current.executor.gate.open()
        self.compute.drop_windows()
        self.current.forget_segments()
