"""``edgert worker``: the on-device runtime. Serves CoAP resources, trains its stage.

Two threads share the work: the transport loop answers requests (stage assignment, tensors
from the neighbours, commands from the coordinator) and sends tensors on; the compute
thread walks the schedule (edgert.worker.executor) and blocks only on the inbox. A bad message is
answered with an error code and changes nothing; the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgert.errors import EdgertError, ProtocolError
from edgert.protocol import (
    ACT,
    BATCH,
    DATA_KINDS,
    ECHO,
    GRAD,
    HEALTH,
    JOIN,
    MIGRATE,
    PROBE,
    PROFILE,
    REPLICA,
    REPORT,
    RUN,
    STAGE,
    STOP,
    WEIGHTS,
    Health,
    Hold,
    JoinRequest,
    Segment,
    StageAssignment,
    StepReport,
    Truncate,
    failure_envelope,
    read_request,
    reports_to_envelope,
    run_command,
    stop_reason,
)
from edgert.providers import DEFAULT_PROVIDERS
from edgert.replica import SELF_ORIGIN, CopyStore
from edgert.schedule import Key, Window
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
    TransportError,
    get_codec,
)
from edgert.transport.coap_tcp import DEFAULT_PORT
from edgert.transport.errors import Forbidden, UnsupportedContentFormat
from edgert.transport.limits import DEFAULT_LIMITS, Limits
from edgert.transport.message import TEXT
from edgert.transport.tls import COORDINATOR_ROLE, TlsCredentials
from edgert.transport.urls import parse_url
from edgert.weights import StageState
from edgert.worker.errors import InboxAborted
from edgert.worker.executor import StageExecutor
from edgert.worker.inbox import Inbox
from edgert.worker.inputs import InputResources
from edgert.worker.measure import MeasureResources
from edgert.worker.outbox import Outbox
from edgert.worker.slowdown import SlowdownEmulator, SlowdownSchedule
from edgert.worker.state import StateResources

log = logging.getLogger("edgert.worker.worker")
REPORT_INTERVAL = 0.02  # seconds: step reports are sent together at most this often, and before any wait
KEPT_SEGMENTS = 8


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


class Worker(InputResources, StateResources, MeasureResources):
    """One device's runtime: a CoAP server, a stage session and a compute thread."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.server = TensorServer(config.listen, limits=config.limits, tls=config.tls)
        self.client = TensorClient(ClientConfig(timeout=config.send_timeout, retries=3), config.limits,
                                   tls=config.tls)
        self.admission = None if config.tls is None else Admission(config.tls.cluster_pem,
                                                                     config.tls.revocations)
        self.inbox = Inbox()
        self.health = Health(name=config.name, state="idle", slowdown=str(config.slowdown))
        self._emulator = SlowdownEmulator(config.slowdown)  # for state copies; each stage has its own
        self.assignment: StageAssignment | None = None
        self.session: StageSession | None = None
        self.executor: StageExecutor | None = None
        self._windows: queue.Queue[tuple[Window, bool] | None] = queue.Queue()
        self._segments: collections.deque[Segment] = collections.deque(maxlen=KEPT_SEGMENTS)
        self._unsent_reports: list[StepReport] = []
        self._last_report = 0.0
        self.outbox = Outbox(self.client, config.name)
        self._idle = threading.Event()  # the compute thread waits for work (no window running)
        self._activity = ""  # overrides the executor's while replicating or migrating
        self._loop: asyncio.AbstractEventLoop | None = None
        self._compute: threading.Thread | None = None
        self._workdir = Path(config.workdir) if config.workdir else Path(tempfile.mkdtemp(prefix="edgert-worker-"))
        self._owns_workdir = config.workdir is None
        self._codecs: dict[str, object] = {}
        self._previous: StageState | None = None
        self.copies = CopyStore()
        self._load_lock = asyncio.Lock()
        self._register_resources()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind the server and start the compute thread; returns the URL it listens on."""
        self._loop = asyncio.get_running_loop()
        self.outbox.start(self._loop)
        await self.server.start()
        await self.client.start()
        self._compute = threading.Thread(target=self._compute_loop, name="edgert-compute", daemon=True)
        self._compute.start()
        if self.config.join:
            await self._announce(self.config.join)
        return self.url

    async def _announce(self, coordinator: str) -> None:
        """Tell a running coordinator this worker is available (``--join``)."""
        message = JoinRequest(self.url, self.config.name).to_envelope()
        try:
            await self.client.post(coordinator, JOIN, message, timeout=10.0, retries=3)
        except TransportError as error:
            raise EdgertError(f"could not join {coordinator}: {error}") from None

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
        await self._stop_run("worker is shutting down")
        self._windows.put(None)
        if self._compute is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._compute.join, 10)
        await self.outbox.wait_closed()
        await self.server.shutdown()
        await self.client.close()
        if self._owns_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def _register_resources(self) -> None:
        server = self.server
        boss = (COORDINATOR_ROLE,)  # over TLS, only the coordinator may command a worker
        server.add_observable(HEALTH, rt="edgert.health", get=self._on_health, title="worker health")
        server.add_resource(STAGE, put=self._on_stage, rt="edgert.stage", kinds=("stage",), roles=boss)
        server.add_resource(RUN, post=self._on_run, rt="edgert.run", kinds=("control",), roles=boss)
        server.add_resource(BATCH, post=self._on_batch, rt="edgert.batch", kinds=("batch",), roles=boss)
        server.add_resource(STOP, post=self._on_stop, rt="edgert.stop", envelope=False, roles=boss)
        server.add_resource(WEIGHTS, get=self._on_weights_get, put=self._on_weights_put,
                            fetch=self._on_weights_fetch, rt="edgert.weights", kinds=("weights", "control"),
                            roles={"GET": boss, "PUT": boss})
        server.add_resource(MIGRATE, post=self._on_migrate, rt="edgert.migrate", kinds=("control",), roles=boss)
        server.add_resource(REPLICA, put=self._on_replica_put, get=self._on_replica_get,
                            rt="edgert.replica", kinds=("weights",), roles={"GET": boss})
        server.add_resource(PROFILE, post=self._on_profile, rt="edgert.profile", kinds=("stage",), roles=boss)
        server.add_resource(PROBE, post=self._on_probe, rt="edgert.probe", kinds=("control",), roles=boss)
        server.add_resource(ECHO, post=self._on_echo, rt="edgert.echo", envelope=False)
        for path, kind in DATA_KINDS.items():
            server.add_resource(path, post=self._data_handler(path), rt=f"edgert.{kind}", kinds=(kind,))

    # -- resources ---------------------------------------------------------------------------

    async def _on_health(self, request: Request) -> Envelope:
        self.health.activity = self._activity or (self.executor.activity if self.executor else "idle")
        return self.health.to_envelope()

    def _admit(self, envelope: Envelope) -> None:
        """With a credential, refuse (4.03) a stage the cluster did not sign."""
        if self.admission is None:
            return
        try:
            self.admission.check_assignment(envelope)
        except AdmissionRefused as error:
            raise Forbidden(str(error)) from None

    async def _on_stage(self, request: Request) -> Envelope:
        self._admit(request.envelope)
        try:
            assignment, files = StageAssignment.from_envelope(request.envelope)
            if not assignment.peers.coordinator:
                raise ProtocolError("stage assignment names no coordinator (meta.peers.coordinator)")
            vet_stage_files(assignment, files)  # before the running job is touched
        except ProtocolError as error:
            raise BadRequest(str(error)) from None
        except GraphRefused as error:
            raise Forbidden(f"stage refused: {error}") from None
        except EdgertError as error:
            raise BadRequest(f"stage refused: {error}") from None
        async with self._load_lock:
            await self._stop_run("a new stage was assigned")
            await self._until_idle()
            started = time.perf_counter()
            self._activity = "loading"
            try:
                session = await asyncio.get_running_loop().run_in_executor(None, self._load, assignment, files)
                # an emulated slower device also loads more slowly
                await asyncio.sleep(self.config.slowdown.extra(max(self.health.step, 0),
                                                               time.perf_counter() - started))
            except Exception as error:  # noqa: BLE001 - the files (ONNX Runtime's errors too), not this worker
                raise BadRequest(f"stage {assignment.entry.index} refused: {type(error).__name__}: {error}") \
                    from None
            finally:
                self._activity = ""
            self._install(assignment, session)
        load_ms = (time.perf_counter() - started) * 1000
        log.info("%s: loaded stage %d of run %s in %.0f ms", self.config.name, assignment.entry.index,
                 assignment.run_id, load_ms)
        return Envelope(kind="control", run_id=assignment.run_id, stage=assignment.entry.index,
                        meta={"loaded": True, "load_ms": load_ms, "worker": self.config.name})

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
                            settings.memory_mode, self.config.providers)

    def _install(self, assignment: StageAssignment, session: StageSession) -> None:
        if self.session is not None and self.assignment.run_id == assignment.run_id:
            # Kept for the workers that take over this stage's blocks (re-partitioning).
            self._previous = StageState(parameters=self.session.parameters(),
                                        optimizer=self.session.optimizer_state(), stage=self.session.entry.index)
        else:
            self._previous = None
        if self.assignment is None or self.assignment.run_id != assignment.run_id:
            self.copies.clear()
        self.outbox.new_generation()
        self._unsent_reports = []
        self.outbox.forget()
        self.inbox.reset()
        self.assignment, self.session = assignment, session
        settings = assignment.settings
        self._codecs = {"forward": get_codec(settings.forward_codec), "backward": get_codec(settings.backward_codec)}
        self.executor = StageExecutor(session, assignment.entry.index, self.inbox, self._send_forward,
                                      self._send_backward, self.config.slowdown, settings.wait_timeout,
                                      before_wait=self._flush_reports)
        self.health = Health(name=self.config.name, state="loaded", run_id=assignment.run_id,
                             stage=assignment.entry.index, slowdown=str(self.config.slowdown))

    async def _on_run(self, request: Request) -> Envelope | None:
        self._check_run(request.envelope)
        command = read_request(run_command, request.envelope)
        if isinstance(command, Hold):
            begun, committed = self.executor.gate.hold()
            return Envelope(kind="control", run_id=self.assignment.run_id, step=max(begun, 0),
                            meta={"command": "hold", "begun": begun, "committed": committed,
                                  "worker": self.config.name})
        if isinstance(command, Truncate):
            self._truncate(command.last_step)
            return None
        segment = command
        if segment.stages != self.assignment.stages:
            raise BadRequest(f"run command is for {segment.stages} stages; this run has {self.assignment.stages}")
        self._segments.append(segment)
        self.health.state = "running"
        windows = segment.windows()
        for k, window in enumerate(windows):
            self._windows.put((window, k == len(windows) - 1))

    def _truncate(self, last_step: int) -> None:
        """Stop after ``last_step``: later steps are dropped, the pipeline drains (re-planning)."""
        self.inbox.truncate(last_step)
        self.executor.gate.open()
        kept = []
        while not self._windows.empty():
            item = self._windows.get_nowait()
            if item is not None and min(item[0].steps) <= last_step:
                kept.append(item)
        for item in kept:
            self._windows.put(item)

    async def _on_stop(self, request: Request) -> str:
        if request.content_format not in (None, TEXT):
            raise UnsupportedContentFormat(f"/{STOP} takes text (Content-Format {TEXT}), got {request.content_format}")
        await self._stop_run(read_request(stop_reason, request.payload))
        return "stopped"

    async def _stop_run(self, reason: str) -> None:
        self.inbox.abort(reason)
        if self.executor is not None:
            self.executor.gate.open()
        while not self._windows.empty():
            self._windows.get_nowait()
        self._segments.clear()
        if self.health.state == "running":
            self.health.state = "loaded"

    def _check_run(self, envelope: Envelope) -> None:
        self._require_session()
        if envelope.run_id != self.assignment.run_id:
            raise BadRequest(f"message for run {envelope.run_id!r}; this worker is in run {self.assignment.run_id!r}")

    def _require_session(self) -> StageSession:
        if self.session is None:
            raise BadRequest("no stage assigned to this worker yet (PUT /stage first)")
        return self.session

    # -- compute thread ----------------------------------------------------------------------

    async def _until_idle(self, timeout: float = 30.0) -> None:
        """Wait until the compute thread has left its window (it was told to stop)."""
        deadline = time.monotonic() + timeout
        while not self._idle.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def _compute_loop(self) -> None:
        while True:
            self._idle.set()
            try:  # waiting for a window flushes reports, which may raise an earlier send's failure
                item = self._next_window()
                self._idle.clear()
                if item is None:
                    return
                window, ends_segment = item
                self.executor.run_window(window, on_step=self._step_done)
                if ends_segment:
                    self._flush_reports()
                if self._windows.empty():
                    self.health.state = "loaded"
            except Exception as error:  # noqa: BLE001 - reported to the coordinator, not swallowed
                self._unsent_reports.clear()
                self.executor.reset()
                if isinstance(error, InboxAborted) or self.outbox.closed:
                    log.info("%s: window abandoned: %s", self.config.name, error)
                else:
                    self._fail_stage(error)

    def _fail_stage(self, error: Exception) -> None:
        """Tell the coordinator this stage failed (it recovers); sends still in flight are history now."""
        log.exception("%s: stage failed", self.config.name)
        self.health.state, self.health.detail = "failed", f"{type(error).__name__}: {error}"
        self.outbox.new_generation()  # their failures, like the one that failed the stage, raise no more
        self._report(failure_envelope(self.assignment.run_id, self.assignment.entry.index,
                                      self.config.name, self.health.detail))

    def _next_window(self) -> tuple[Window, bool] | None:
        """The next window; the step reports gathered so far go out before waiting for one."""
        try:
            return self._windows.get_nowait()
        except queue.Empty:
            self._flush_reports()
            return self._windows.get()

    def _step_done(self, report: StepReport) -> None:
        self.health.step = report.step
        self._replicate(report)
        self._unsent_reports.append(report)
        if time.monotonic() - self._last_report >= REPORT_INTERVAL:
            self._flush_reports()

    def _flush_reports(self) -> None:
        if self._unsent_reports:
            self._report(reports_to_envelope(self.assignment.run_id, self.assignment.entry.index,
                                             self.config.name, self._unsent_reports))
            self._unsent_reports = []
        self._last_report = time.monotonic()

    def _replicate(self, report: StepReport) -> None:
        """Every ``replicate_every`` steps: keep a snapshot, send it to the next workers (and the coordinator,
        every ``central_every`` steps and after the segment's ``checkpoint_steps``)."""
        every, central = self.assignment.settings.replicate_every, self.assignment.settings.central_every
        to_peers = every and (report.step + 1) % every == 0
        to_coordinator = (central and (report.step + 1) % central == 0) or any(
            report.step in segment.checkpoint_steps for segment in tuple(self._segments))
        if not (to_peers or to_coordinator):
            return
        started, cpu = time.perf_counter(), time.thread_time()
        self._activity = f"replicating {report.step}"
        state = StageState(parameters=self.session.parameters(), optimizer=self.session.optimizer_state(),
                           step=report.step, stage=self.assignment.entry.index)
        # an emulated slower device also copies its state more slowly
        self._emulator.emulate(report.step, "replicate", time.perf_counter() - started, time.thread_time() - cpu)
        self.copies.put(state, SELF_ORIGIN)
        envelope = state.to_envelope(self.assignment.run_id)
        envelope = Envelope(kind=envelope.kind, run_id=envelope.run_id, step=envelope.step, stage=envelope.stage,
                            tensors=envelope.tensors, meta={"origin": self.url})
        targets = list(self.assignment.replica_targets) if to_peers else []
        if to_coordinator:
            targets.append(self.assignment.peers.coordinator)
        for target in targets:
            self.outbox.submit(target, REPLICA, envelope, None, method="PUT", must_arrive=False)
        report.replication_ms += (time.perf_counter() - started) * 1000
        report.replicated_bytes += state.bytes * len(targets)
        self._activity = ""

    def _report(self, envelope: Envelope) -> None:
        self.outbox.submit(self.assignment.peers.coordinator, REPORT, envelope, None, must_arrive=False)

    def _send_forward(self, key: Key, tensors: dict[str, np.ndarray]) -> None:
        self._send_data(self.assignment.peers.next, ACT, key, tensors, +1, self._codecs["forward"])

    def _send_backward(self, key: Key, tensors: dict[str, np.ndarray]) -> None:
        self._send_data(self.assignment.peers.previous, GRAD, key, tensors, -1, self._codecs["backward"])

    def _send_data(self, url: str | None, path: str, key: Key, tensors, direction: int, codec) -> None:
        if url is None:
            raise EdgertError(f"stage {self.assignment.entry.index} has no peer to send {path} to")
        envelope = Envelope(kind=DATA_KINDS[path], run_id=self.assignment.run_id, step=key[0], microbatch=key[1],
                            stage=self.assignment.entry.index + direction, tensors=tensors)
        self.outbox.submit(url, path, envelope, codec)
