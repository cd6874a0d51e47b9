"""``edgert worker``: the on-device runtime. Serves CoAP resources, trains its stage.

Two threads share the work: the transport loop answers requests (stage assignment, tensors
from the neighbours, commands from the coordinator) and sends tensors on; the compute
thread walks the schedule (edgert.executor) and blocks only on the inbox. A bad message is
answered with an error code and changes nothing; the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgert.assignment import SELF
from edgert.errors import EdgertError
from edgert.executor import Key, StageExecutor, StepReport, Window
from edgert.inbox import Inbox, InboxAborted, InboxFull
from edgert.manifest import BoundaryTensor, needed_roles, verify_file
from edgert.profiler import measure_stage, probe_link
from edgert.protocol import (
    ACT,
    BATCH,
    DATA_KINDS,
    ECHO,
    GRAD,
    HEALTH,
    LABELS,
    MIGRATE,
    PROBE,
    PROFILE,
    REPORT,
    RUN,
    STAGE,
    STOP,
    WEIGHTS,
    Health,
    ProtocolError,
    Segment,
    StageAssignment,
    failure_envelope,
    reports_to_envelope,
)
from edgert.slowdown import SlowdownSchedule
from edgert.stage import StageSession, Threads
from edgert.transport import (
    BadRequest,
    ClientConfig,
    Envelope,
    Request,
    ServiceUnavailable,
    TensorClient,
    TensorServer,
    TransportError,
    get_codec,
)
from edgert.transport.limits import DEFAULT_LIMITS, Limits
from edgert.weights import StageState

log = logging.getLogger("edgert.worker")
MAX_PENDING_SENDS = 16
REPORT_INTERVAL = 0.02  # seconds: step reports are sent together at most this often
KEPT_SEGMENTS = 8


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker listens and how fast it pretends to be."""

    listen: str = "coap+tcp://0.0.0.0:5701"
    name: str = "worker"
    slowdown: SlowdownSchedule = field(default_factory=SlowdownSchedule)
    workdir: Path | None = None
    limits: Limits = DEFAULT_LIMITS
    send_timeout: float = 30.0


class Worker:
    """One device's runtime: a CoAP server, a stage session and a compute thread."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.server = TensorServer(config.listen, limits=config.limits)
        self.client = TensorClient(ClientConfig(timeout=config.send_timeout, retries=3), config.limits)
        self.inbox = Inbox()
        self.health = Health(name=config.name, state="idle", slowdown=str(config.slowdown))
        self.assignment: StageAssignment | None = None
        self.session: StageSession | None = None
        self.executor: StageExecutor | None = None
        self._windows: queue.Queue[tuple[Window, bool] | None] = queue.Queue()
        self._segments: collections.deque[Segment] = collections.deque(maxlen=KEPT_SEGMENTS)
        self._unsent_reports: list[StepReport] = []
        self._last_report = 0.0
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._compute: threading.Thread | None = None
        self._workdir = Path(config.workdir) if config.workdir else Path(tempfile.mkdtemp(prefix="edgert-worker-"))
        self._owns_workdir = config.workdir is None
        self._codecs: dict[str, object] = {}
        self._previous: StageState | None = None
        self._load_lock = asyncio.Lock()
        self._register_resources()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind the server and start the compute thread; returns the URL it listens on."""
        self._loop = asyncio.get_running_loop()
        await self.server.start()
        await self.client.start()
        self._compute = threading.Thread(target=self._compute_loop, name="edgert-compute", daemon=True)
        self._compute.start()
        return self.url

    @property
    def url(self) -> str:
        return self.server.urls[0]

    async def shutdown(self) -> None:
        """Stop computing, stop serving, remove the work folder."""
        self.inbox.abort("worker is shutting down")
        self._windows.put(None)
        if self._compute is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._compute.join, 10)
        await self.server.shutdown()
        await self.client.close()
        if self._owns_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def _register_resources(self) -> None:
        server = self.server
        server.add_observable(HEALTH, rt="edgert.health", get=self._on_health, title="worker health")
        server.add_resource(STAGE, put=self._on_stage, rt="edgert.stage", kinds=("stage",))
        server.add_resource(RUN, post=self._on_run, rt="edgert.run", kinds=("control",))
        server.add_resource(BATCH, post=self._on_batch, rt="edgert.batch", kinds=("batch",))
        server.add_resource(STOP, post=self._on_stop, rt="edgert.stop", envelope=False)
        server.add_resource(WEIGHTS, get=self._on_weights_get, put=self._on_weights_put, fetch=self._on_weights_fetch,
                            rt="edgert.weights", kinds=("weights", "control"))
        server.add_resource(MIGRATE, post=self._on_migrate, rt="edgert.migrate", kinds=("control",))
        server.add_resource(PROFILE, post=self._on_profile, rt="edgert.profile", kinds=("stage",))
        server.add_resource(PROBE, post=self._on_probe, rt="edgert.probe", kinds=("control",))
        server.add_resource(ECHO, post=self._on_echo, rt="edgert.echo", envelope=False)
        for path, kind in DATA_KINDS.items():
            server.add_resource(path, post=self._data_handler(path), rt=f"edgert.{kind}", kinds=(kind,))

    # -- resources ---------------------------------------------------------------------------

    async def _on_health(self, request: Request) -> Envelope:
        return self.health.to_envelope()

    async def _on_stage(self, request: Request) -> Envelope:
        try:
            assignment, files = StageAssignment.from_envelope(request.envelope)
        except ProtocolError as error:
            raise BadRequest(str(error)) from None
        async with self._load_lock:
            if self.health.state == "running":
                await self._stop_run("a new stage was assigned")
            started = time.perf_counter()
            try:
                session = await asyncio.get_running_loop().run_in_executor(None, self._load, assignment, files)
            except EdgertError as error:
                raise BadRequest(f"stage {assignment.entry.index} refused: {error}") from None
            self._install(assignment, session)
        load_ms = (time.perf_counter() - started) * 1000
        log.info("%s: loaded stage %d of run %s in %.0f ms", self.config.name, assignment.entry.index,
                 assignment.run_id, load_ms)
        return Envelope(kind="control", run_id=assignment.run_id, stage=assignment.entry.index,
                        meta={"loaded": True, "load_ms": load_ms, "worker": self.config.name})

    def _load(self, assignment: StageAssignment, files: dict[str, bytes], folder_name: str = "") -> StageSession:
        """Check every file against the manifest entry's sha256, write it, open the sessions."""
        entry = assignment.entry
        folder = self._workdir / assignment.run_id / (folder_name or f"stage{entry.index}-{'-'.join(entry.blocks)}")
        folder.mkdir(parents=True, exist_ok=True)
        roles = needed_roles(entry, assignment.memory_mode)
        missing = [role for role in roles if role not in files]
        if missing:
            raise EdgertError(f"artifact(s) {', '.join(missing)} missing from the assignment")
        for artifact in entry.artifacts:
            if artifact.role not in roles:
                continue
            path = folder / Path(artifact.path).name
            path.write_bytes(files[artifact.role])
            verify_file(path, artifact.sha256, f"stage {entry.index} {artifact.role}")
        local = dataclasses.replace(entry, artifacts=tuple(
            dataclasses.replace(a, path=Path(a.path).name) for a in entry.artifacts))
        threads = Threads(assignment.forward_threads, assignment.backward_threads)
        return StageSession(local, folder, assignment.training, threads, assignment.memory_mode)

    def _install(self, assignment: StageAssignment, session: StageSession) -> None:
        if self.session is not None and self.assignment.run_id == assignment.run_id:
            # Kept for the workers that take over this stage's blocks (re-partitioning).
            self._previous = StageState(parameters=self.session.parameters(),
                                        optimizer=self.session.optimizer_state(), stage=self.session.entry.index)
        else:
            self._previous = None
        self.inbox.reset()
        self.assignment, self.session = assignment, session
        self._codecs = {"forward": get_codec(assignment.forward_codec),
                        "backward": get_codec(assignment.backward_codec)}
        self.executor = StageExecutor(session, assignment.entry.index, self.inbox, self._send_forward,
                                      self._send_backward, self.config.slowdown, assignment.wait_timeout)
        self.health = Health(name=self.config.name, state="loaded", run_id=assignment.run_id,
                             stage=assignment.entry.index, slowdown=str(self.config.slowdown))

    async def _on_run(self, request: Request) -> None:
        self._check_run(request.envelope)
        try:
            segment = Segment.from_envelope(request.envelope)
        except ProtocolError as error:
            raise BadRequest(str(error)) from None
        if segment.stages != self.assignment.stages:
            raise BadRequest(f"run command is for {segment.stages} stages; this run has {self.assignment.stages}")
        self._segments.append(segment)
        self.health.state = "running"
        windows = segment.windows()
        for k, window in enumerate(windows):
            self._windows.put((window, k == len(windows) - 1))

    async def _on_batch(self, request: Request) -> None:
        """A whole step's inputs (first stage) and/or labels (last stage), split into micro-batches here."""
        envelope = request.envelope
        self._check_run(envelope)
        entry = self.session.entry
        expected = (list(entry.inputs) if entry.index == 0 else []) + list(entry.labels)
        _check_tensors(envelope, expected, BATCH)
        segment = next((s for s in self._segments if s.first_step <= envelope.step <= s.last_step), None)
        if segment is None:
            raise BadRequest(f"batch for step {envelope.step}, which no run command covers")
        size = len(next(iter(envelope.tensors.values())))
        if size != segment.batch_size:
            raise BadRequest(f"batch of {size} samples; the run command says {segment.batch_size}")
        inputs = {t.name for t in entry.inputs} if entry.index == 0 else set()
        start = 0
        try:
            for micro in segment.microbatches(envelope.step):
                part = slice(start, start + micro.size)
                start += micro.size
                values = {name: value[part] for name, value in envelope.tensors.items()}
                if inputs:
                    self.inbox.put((ACT, micro.step, micro.index), {n: v for n, v in values.items() if n in inputs})
                if entry.is_last:
                    self.inbox.put((LABELS, micro.step, micro.index),
                                   {n: v for n, v in values.items() if n not in inputs})
        except InboxFull as error:
            raise ServiceUnavailable(str(error)) from None

    async def _on_stop(self, request: Request) -> str:
        await self._stop_run(request.payload.decode("utf-8", "replace") or "stopped by the coordinator")
        return "stopped"

    async def _stop_run(self, reason: str) -> None:
        self.inbox.abort(reason)
        while not self._windows.empty():
            self._windows.get_nowait()
        self._segments.clear()
        if self.health.state == "running":
            self.health.state = "loaded"

    async def _on_weights_get(self, request: Request) -> Envelope:
        session = self._require_session()
        state = StageState(parameters=session.parameters(), optimizer=session.optimizer_state(),
                           step=max(self.health.step, 0), stage=session.entry.index)
        return state.to_envelope(self.assignment.run_id)

    async def _on_weights_fetch(self, request: Request) -> Envelope:
        """Some of the state, by name: ``meta.names``; ``meta.previous`` for the stage held before the
        latest assignment (what re-partitioning moves between workers)."""
        meta = request.envelope.meta
        names = meta.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("FETCH /weights needs meta.names, a list of parameter names")
        if meta.get("previous"):
            if self._previous is None:
                raise BadRequest("this worker holds no previous stage state")
            state = self._previous
        else:
            session = self._require_session()
            state = StageState(parameters=session.parameters(), optimizer=session.optimizer_state(),
                               stage=session.entry.index)
        return _subset(state, names).to_envelope(self.assignment.run_id if self.assignment else "")

    async def _on_migrate(self, request: Request) -> Envelope:
        """Fetch the named state from the workers that held it, straight into this stage."""
        session = self._require_session()
        self._check_run(request.envelope)
        sources = request.envelope.meta.get("sources", [])
        started = time.perf_counter()

        async def fetch(source: dict) -> StageState:
            if source["url"] == SELF:
                return _subset(self._previous, list(source["names"]))
            query = Envelope(kind="control", run_id=self.assignment.run_id,
                             meta={"names": list(source["names"]), "previous": bool(source.get("previous", True))})
            response = await self.client.request("FETCH", source["url"], WEIGHTS, query, timeout=120.0)
            return StageState.from_envelope(response.envelope(self.config.limits))

        try:
            states = await asyncio.gather(*(fetch(s) for s in sources))
        except (TransportError, KeyError, TypeError, EdgertError) as error:
            raise BadRequest(f"migration failed: {error}") from None
        moved = 0
        for state in states:
            try:
                session.load_parameters(state.parameters)
                session.load_optimizer_state(state.optimizer)
            except EdgertError as error:
                raise BadRequest(f"migration failed: {error}") from None
            moved += state.bytes
        return Envelope(kind="control", run_id=self.assignment.run_id,
                        meta={"bytes": moved, "ms": (time.perf_counter() - started) * 1000})

    async def _on_profile(self, request: Request) -> Envelope:
        """Measure a stage (not installed: the current one is untouched) at a micro-batch size."""
        try:
            assignment, files = StageAssignment.from_envelope(request.envelope)
        except ProtocolError as error:
            raise BadRequest(str(error)) from None
        meta = request.envelope.meta
        micro_batch, repeats = int(meta.get("micro_batch", 16)), int(meta.get("repeats", 5))

        def measure() -> dict:
            session = self._load(assignment, files, folder_name="profile")
            return dataclasses.asdict(measure_stage(session, micro_batch, repeats, slowdown=self.config.slowdown))

        try:
            timing = await asyncio.get_running_loop().run_in_executor(None, measure)
        except EdgertError as error:
            raise BadRequest(f"profiling refused: {error}") from None
        return Envelope(kind="control", meta={"timing": timing, "cores": os.cpu_count() or 1,
                                              "memory_bytes": _available_memory(), "worker": self.config.name,
                                              "slowdown": str(self.config.slowdown)})

    async def _on_probe(self, request: Request) -> Envelope:
        """Measure the link from this worker to ``meta.target`` (its ``/echo``)."""
        target = request.envelope.meta.get("target")
        if not isinstance(target, str):
            raise BadRequest("POST /probe needs meta.target, a worker URL")
        try:
            result = await probe_link(self.client, target)
        except TransportError as error:
            raise BadRequest(f"{target} did not answer: {error}") from None
        return Envelope(kind="control", meta=result)

    async def _on_echo(self, request: Request) -> bytes:
        return b""

    async def _on_weights_put(self, request: Request) -> None:
        session = self._require_session()
        if self.health.state == "running":
            raise ServiceUnavailable("weights cannot be written while the stage is running a window")
        state = StageState.from_envelope(request.envelope)
        try:
            session.load_parameters(state.parameters)
            session.load_optimizer_state(state.optimizer)
        except EdgertError as error:
            raise BadRequest(str(error)) from None

    def _data_handler(self, path: str):
        async def handle(request: Request) -> None:
            envelope = request.envelope
            self._check_run(envelope)
            entry = self.session.entry
            if envelope.stage != entry.index:
                raise BadRequest(f"message for stage {envelope.stage} reached stage {entry.index}")
            _check_tensors(envelope, self._expected(path), path)
            try:
                self.inbox.put((path, envelope.step, envelope.microbatch), dict(envelope.tensors))
            except InboxFull as error:
                raise ServiceUnavailable(str(error)) from None
        return handle

    def _expected(self, path: str) -> list[BoundaryTensor]:
        entry = self.session.entry
        if path == ACT:
            return list(entry.inputs)
        if entry.is_last:
            raise BadRequest(f"stage {entry.index} is the last stage: it takes no gradients")
        return [t for t in entry.outputs if t.name in entry.output_gradients]

    def _check_run(self, envelope: Envelope) -> None:
        self._require_session()
        if envelope.run_id != self.assignment.run_id:
            raise BadRequest(f"message for run {envelope.run_id!r}; this worker is in run {self.assignment.run_id!r}")

    def _require_session(self) -> StageSession:
        if self.session is None:
            raise BadRequest("no stage assigned to this worker yet (PUT /stage first)")
        return self.session

    # -- compute thread ----------------------------------------------------------------------

    def _compute_loop(self) -> None:
        while True:
            item = self._windows.get()
            if item is None:
                return
            window, ends_segment = item
            try:
                self.executor.run_window(window, on_step=self._step_done)
                if ends_segment:
                    self._flush_reports()
                if self._windows.empty():
                    self.health.state = "loaded"
            except InboxAborted as error:
                log.info("%s: window abandoned: %s", self.config.name, error)
                self._unsent_reports.clear()
                self.executor.reset()
            except Exception as error:  # noqa: BLE001 - reported to the coordinator, not swallowed
                log.exception("%s: stage failed", self.config.name)
                self.health.state, self.health.detail = "failed", f"{type(error).__name__}: {error}"
                self.executor.reset()
                self._report(failure_envelope(self.assignment.run_id, self.assignment.entry.index,
                                              self.config.name, self.health.detail))

    def _step_done(self, report: StepReport) -> None:
        self.health.step = report.step
        self._unsent_reports.append(report)
        if time.monotonic() - self._last_report >= REPORT_INTERVAL:
            self._flush_reports()

    def _flush_reports(self) -> None:
        if self._unsent_reports:
            self._report(reports_to_envelope(self.assignment.run_id, self.assignment.entry.index,
                                             self.config.name, self._unsent_reports))
            self._unsent_reports = []
        self._last_report = time.monotonic()

    def _report(self, envelope: Envelope) -> None:
        self._submit(self.assignment.peers.coordinator, REPORT, envelope, None)

    def _send_forward(self, key: Key, tensors: dict[str, np.ndarray]) -> None:
        self._send_data(self.assignment.peers.next, ACT, key, tensors, +1, self._codecs["forward"])

    def _send_backward(self, key: Key, tensors: dict[str, np.ndarray]) -> None:
        self._send_data(self.assignment.peers.previous, GRAD, key, tensors, -1, self._codecs["backward"])

    def _send_data(self, url: str | None, path: str, key: Key, tensors, direction: int, codec) -> None:
        if url is None:
            raise EdgertError(f"stage {self.assignment.entry.index} has no peer to send {path} to")
        envelope = Envelope(kind=DATA_KINDS[path], run_id=self.assignment.run_id, step=key[0], microbatch=key[1],
                            stage=self.assignment.entry.index + direction, tensors=tensors)
        self._submit(url, path, envelope, codec)

    def _submit(self, url: str, path: str, envelope: Envelope, codec) -> None:
        """Hand a send to the transport loop without waiting for it; surface earlier failures."""
        while self._pending and (self._pending[0].done() or len(self._pending) >= MAX_PENDING_SENDS):
            self._pending.popleft().result()  # re-raises a failed send in the compute thread
        future = asyncio.run_coroutine_threadsafe(self.client.send(url, path, envelope, codec=codec), self._loop)
        self._pending.append(future)


def _check_tensors(envelope: Envelope, expected: list[BoundaryTensor], path: str) -> None:
    """Names, dtypes and non-batch dimensions must be exactly the manifest's."""
    names = sorted(envelope.tensors)
    wanted = sorted(t.name for t in expected)
    if names != wanted:
        raise BadRequest(f"/{path} expects tensors {wanted}, got {names}")
    batches: set[int] = set()
    for spec in expected:
        array = envelope.tensors[spec.name]
        if array.dtype != np.dtype(spec.dtype):
            raise BadRequest(f"/{path}: tensor {spec.name!r} has dtype {array.dtype}, expected {spec.dtype}")
        shape = list(array.shape)
        if len(shape) != len(spec.shape) or any(d != "N" and int(d) != n for d, n in zip(spec.shape, shape)):
            raise BadRequest(f"/{path}: tensor {spec.name!r} has shape {shape}, expected {list(spec.shape)}")
        batches.update(n for d, n in zip(spec.shape, shape) if d == "N")
    if len(batches) > 1 or 0 in batches:
        raise BadRequest(f"/{path}: tensors have batch sizes {sorted(batches)}; expected one, at least 1")


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes), 0 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _subset(state: StageState | None, names: list[str]) -> StageState:
    """The named part of a stage state; every name must be there."""
    if state is None:
        raise BadRequest("this worker holds no previous stage state")
    missing = [n for n in names if n not in state.parameters]
    if missing:
        raise BadRequest(f"no state for {', '.join(missing[:5])} here")
    return StageState(parameters={n: state.parameters[n] for n in names},
                      optimizer={n: state.optimizer[n] for n in names if n in state.optimizer},
                      step=state.step, stage=state.stage)
