"""``edgert train``: the central node's run loop. Assigns stages, streams data, records.

The coordinator never carries activations or gradients: it sends each worker its stage,
tells every worker which steps to run under which schedule (``/run``), posts each step's
inputs to the first stage and labels to the last (``/batch``), and receives one report per
stage per optimizer step on its own ``/report`` resource. At each epoch's end it fetches
every stage's state, keeps it as the checkpoint, and evaluates it on the test set. With
re-planning on, it watches the stages' times and moves the cuts at a step boundary when
a new plan pays for its pause (edgert/coordinator/replanning.py); when a worker fails it rolls
back to the newest snapshot on the workers left (edgert/coordinator/recovery.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgert.coordinator.assignment import DIRECTIONS, RunBriefing, assign, links_record, with_learning_rate
from edgert.coordinator.data import Batch, batches, load_training_data
from edgert.coordinator.errors import AssignmentError, TrainingError, WorkerFailure
from edgert.coordinator.evaluation import Evaluation
from edgert.coordinator.failures import FailureDetector, health_of
from edgert.coordinator.inputs import read_report
from edgert.coordinator.ledger import HISTORY, StepLedger, StepRecord
from edgert.coordinator.recovery import Recovery
from edgert.coordinator.replanning import Replanning
from edgert.coordinator.run_state import RunState
from edgert.coordinator.run_summary import RunSummary, joined_workers, summarise
from edgert.coordinator.runlog import RUN_FILE, RunLog, claim_run_folder, new_run_id
from edgert.coordinator.segments import SegmentRunner, next_segment
from edgert.coordinator.snapshots import CentralCopies
from edgert.coordinator.stage_groups import check_splittable, groups_record, place_workers, planned_shares
from edgert.errors import EdgertError
from edgert.exporter.device_plan import PlannedPlacement, load_placement
from edgert.manifest import MANIFEST_NAME, MEMORY_MODES, TrainingConfig, load_manifest
from edgert.models.csv_data import DEFAULT_LABEL_COLUMN
from edgert.models.data_settings import DATA_FILE, DataRecord, DataSettings, read_data_record, write_data_record
from edgert.progress import Progress
from edgert.protocol import REPORT, STOP, Health
from edgert.run_settings import RunSettings
from edgert.schedule import SCHEDULES
from edgert.transport import ClientConfig, Request, TensorClient, TensorServer, TransportError
from edgert.transport.urls import parse_url

log = logging.getLogger("edgert.coordinator.coordinator")

REPLAN_MODES = ("off", "auto")  # auto: the cuts also move when a placement check finds better ones


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``edgert train`` was asked to do."""

    plan_dir: Path
    workers: tuple[str, ...]
    out_dir: Path
    data: str = "digits"
    label_column: str = DEFAULT_LABEL_COLUMN  # a CSV's column of labels
    epochs: int = 5
    steps: int | None = None
    batch_size: int = 64
    micro_batches: int = 4
    schedule: str = "1f1b"
    learning_rate: float | None = None
    seed: int = 0
    lookahead: int = 8
    forward_codec: str | None = None  # every link's activations; None: the plan's per link, else RunSettings'
    backward_codec: str | None = None  # every link's gradients; None: the plan's per link, else RunSettings'
    forward_threads: int = RunSettings.forward_threads
    backward_threads: int = RunSettings.backward_threads
    # forwards beside backwards; None: as the plan was made (placement.json, edgert plan --side-by-side), each
    # worker then with the threads the plan split for it; else RunSettings'
    side_by_side: bool | None = None
    # weight gradients once a step; None: as the plan was made (placement.json, edgert plan --split-backward),
    # else RunSettings'
    split_backward: bool | None = None
    connect_timeout: float = 5.0
    step_timeout: float = RunSettings.wait_timeout
    listen: str = "coap+tcp://0.0.0.0:0"
    advertise: str | None = None
    progress: bool = True
    replan: str = "off"  # one of REPLAN_MODES
    replan_every: int = 10
    replan_threshold: float = 0.1
    replan_at: tuple[tuple[int, tuple[int, ...] | None], ...] = ()  # forced: (before step, block cuts or None)
    # a live re-plan, a re-cutting recovery or a resume may let a data-parallel group of workers hold a stage;
    # None: where a group is exact, a model whose forward updates no running statistics (BatchNorm)
    replan_groups: bool | None = None
    devices: Path | None = None
    memory_mode: str = RunSettings.memory_mode
    replicate_every: int = RunSettings.replicate_every
    central_every: int = RunSettings.central_every  # its copies are kept on disk
    replicas: int = 1  # neighbours each stage's copy goes to
    resume: bool = False  # continue the run in out_dir from its newest snapshot
    overwrite: bool = False  # out_dir may hold another run: its records are removed
    keys: Path | None = None  # the cluster keystore (edgert keys init); None: plaintext (--insecure)

    def data_settings(self) -> DataSettings:
        """The data this run reads and how it splits it (recorded in the run folder's data.json)."""
        return DataSettings.given(self.data, self.seed, self.label_column)

    def run_settings(self, training: TrainingConfig, planned_side_by_side: bool = False,
                     planned: PlannedPlacement | None = None) -> RunSettings:
        """What every stage of this run is told, training by ``training`` (the plan's, ``--lr`` applied);
        ``planned_side_by_side``: the plan was made for forwards beside backwards; ``planned``: the plan's
        placement.json, if ``edgert plan`` made it."""
        given = {f"{d}_codec": getattr(self, f"{d}_codec") for d in DIRECTIONS if d not in self.planned_codecs()}
        side_by_side = planned_side_by_side if self.side_by_side is None else self.side_by_side
        return RunSettings(training=with_learning_rate(training, self.learning_rate), **given,
                           forward_threads=self.forward_threads, backward_threads=self.backward_threads,
                           side_by_side=side_by_side, split_backward=self.splits_backward(planned),
                           wait_timeout=self.step_timeout, memory_mode=self.memory_mode,
                           replicate_every=self.replicate_every, central_every=self.central_every)

    def runs_side_by_side(self, plan_dir: Path) -> bool:
        """Whether the stages run their forwards beside their backwards (re-plans are costed so)."""
        return bool(self.side_by_side) or self.plans_side_by_side(load_placement(plan_dir))

    def plans_side_by_side(self, placement: PlannedPlacement | None) -> bool:
        """Whether the stages run side by side because the plan was made so (its ``placement.json``; neither
        ``--side-by-side`` nor ``--one-after-the-other`` given): each worker then with its planned threads."""
        return self.side_by_side is None and placement is not None and placement.side_by_side

    def runs_split_backward(self, plan_dir: Path) -> bool:
        """Whether the stages compute their weight gradients once a step (re-plans are costed so)."""
        return self.splits_backward(load_placement(plan_dir))

    def splits_backward(self, placement: PlannedPlacement | None) -> bool:
        """Whether the stages compute their weight gradients once a step: ``--split-backward`` or
        ``--whole-backward`` if given, else as the plan was made (``placement``: its placement.json)."""
        if self.split_backward is not None:
            return self.split_backward
        return placement.split_backward if placement is not None else RunSettings.split_backward

    def planned_codecs(self) -> tuple[str, ...]:
        """The directions whose codec each link takes from the plan: those not given on the command line."""
        return tuple(d for d in DIRECTIONS if getattr(self, f"{d}_codec") is None)


class Coordinator:
    """Runs one training job over a set of workers: the run loop, and the parts it wires together.

    The parts own their state and are handed what they need: :class:`SegmentRunner` (feeding
    one segment of steps), :class:`FailureDetector` (which workers failed), :class:`Evaluation`
    (epoch ends, checkpoints), :class:`Replanning` (when and where the cuts move, workers
    joining), :class:`Recovery` (rolling back after a failure, the coordinator's copies). What
    they share is a :class:`RunState`; each serves the resources whose state it owns (the
    coordinator itself ``/report``, which feeds the ledger). The parts are made when the run
    opens its folder (:meth:`run`), as are its log and ledger.
    """

    def __init__(self, config: TrainConfig):
        self.config = config
        self._check_config()
        if not config.resume:  # before anything is loaded: a folder holding another run is refused at once
            claim_run_folder(config.out_dir, config.overwrite)
        manifest = load_manifest(config.plan_dir)
        shares = planned_shares(config.plan_dir, len(manifest.stages))
        if config.resume:  # the workers given, placed anew from the snapshot (Recovery.resume): groups too
            order, groups = list(config.workers), []
            saved = read_run_file(config.out_dir)
            # a run folder written before runs had their own ids is named by its folder
            run_id, self.started = str(saved.get("run_id") or config.out_dir.name), saved.get("started")
        else:
            order, groups = place_workers(list(config.workers), shares)
            check_splittable(groups, config.batch_size, config.micro_batches, config.schedule)
            run_id, self.started = new_run_id(), time.time()
        self.state = RunState(run_id, manifest, config.plan_dir, order, groups=groups)
        self.data_settings = config.data_settings()
        reading = Progress(0, "reading data", enabled=config.progress)
        self.dataset = load_training_data(self.data_settings, manifest, reading)
        reading.close()
        self.security = None
        if config.keys is not None:
            from edgert.security.keystore import HostSecurity  # host side only

            self.security = HostSecurity.open(config.keys)
        tls = None if self.security is None else self.security.tls
        self.client = TensorClient(ClientConfig(timeout=30.0, retries=2, connect_timeout=config.connect_timeout),
                                   tls=tls)
        self.server = TensorServer(config.listen, tls=tls)
        self.server.add_resource(REPORT, post=self._on_report, rt="edgert.report", kinds=("report",))
        self.log: RunLog | None = None
        self.ledger: StepLedger | None = None
        self.failures: FailureDetector | None = None
        self.evaluation: Evaluation | None = None
        self.replanning: Replanning | None = None
        self.recovery: Recovery | None = None
        self._segments: SegmentRunner | None = None
        self._progress: Progress | None = None

    def _check_config(self) -> None:
        config = self.config
        secure = config.keys is not None
        if secure != config.listen.startswith("coaps+tcp://"):
            raise TrainingError(f"--listen {config.listen}: " + (
                "with a keystore the coordinator listens on coaps+tcp://" if secure
                else "coaps+tcp needs the cluster keystore (--keys)"))
        if config.schedule not in SCHEDULES:
            raise TrainingError(f"unknown schedule {config.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        for name in ("epochs", "batch_size", "micro_batches", "lookahead", "replan_every"):
            if getattr(config, name) < 1:
                raise TrainingError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(config, name)})")
        if config.steps is not None and config.steps < 1:
            raise TrainingError(f"--steps must be at least 1 (got {config.steps})")
        if config.micro_batches > config.batch_size:
            raise TrainingError(f"--micro-batches {config.micro_batches} exceeds --batch-size {config.batch_size}")
        if config.memory_mode not in MEMORY_MODES:
            raise TrainingError(f"--memory-mode must be one of {', '.join(MEMORY_MODES)} (got {config.memory_mode!r})")
        if config.replan not in REPLAN_MODES:
            raise TrainingError(f"--replan must be {' or '.join(REPLAN_MODES)} (got {config.replan!r})")

    @property
    def run_id(self) -> str:
        """The run's id, known from construction on."""
        return self.state.run_id

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> RunSummary:
        """Connect, assign, train, evaluate; always releases the workers."""
        config = self.config
        plan = list(batches(len(self.dataset.x_train), config.batch_size, config.epochs, config.seed, config.steps))
        self._open(plan)
        try:
            await self.server.start()
            await self._connect_workers()
            if config.resume:
                await self._remember_joined()
            self._write_run_files()
            if self._plans_live:
                await self.replanning.start()
            if config.resume:
                self._prepare_settings()
                start = await self.recovery.resume()
            else:
                await self._assign_stages()
                start = 0
            self.failures.start_watching()
            await self._train(plan, start)
            return self._summary()
        finally:
            await self.failures.close()
            await self._release_workers()
            self._progress.close()
            self.log.close()
            await self.server.shutdown()
            await self.client.close()

    def _open(self, plan: list[Batch]) -> None:
        """Open the run's records (metrics, trace, progress) and make the parts that keep them, for ``plan``."""
        config, state = self.config, self.state
        self.log = RunLog(config.out_dir, self.started)
        self.ledger = StepLedger(self.log, self._show_step, history=max(HISTORY, config.replan_every))
        self._progress = Progress(len(plan), enabled=config.progress)
        central = CentralCopies(config.out_dir / "snapshots")
        self.failures = FailureDetector(state, self.client, self.ledger, self.log, config.step_timeout)
        self.evaluation = Evaluation(config.out_dir, state, self.client, self.log, self.dataset, central,
                                     self._progress)
        self.replanning = Replanning(config, state, self.client, self.log, self.ledger, self.failures,
                                     self.evaluation, self._progress,
                                     signing=None if self.security is None else self.security.signing,
                                     last_step=plan[-1].step if plan else -1, takes_joins=self._plans_live)
        self.recovery = Recovery(config.out_dir, config.resume, state, self.client, self.log, self.ledger,
                                 self.failures, self.replanning, self.evaluation, central, self._progress)
        self.recovery.serve(self.server)
        self.replanning.serve(self.server)
        self._segments = SegmentRunner(config, state, self.client, self.ledger, self.dataset, self.failures,
                                       self.replanning, self.evaluation)

    async def _connect_workers(self) -> None:
        async def probe(url: str) -> Health:
            try:
                return await health_of(self.client, url, self.config.connect_timeout, retries=1)
            except (TransportError, OSError, EdgertError) as error:
                raise TrainingError(f"worker {url} is not reachable: {error}") from None

        state = self.state
        healths = await asyncio.gather(*(probe(url) for url in self.config.workers))
        state.known = {url: h.name for url, h in zip(self.config.workers, healths)}
        state.names = [state.known[url] for url in state.order]
        if any(group is not None for group in state.groups):  # the groups learn their members' names (TLS)
            shares = [state.group(k).shares if state.group(k) else (1.0,) for k in range(len(state.order))]
            state.order, state.groups = place_workers(state.placed(), shares, state.known)
        log.info("workers: %s", ", ".join(f"{n} ({u})" for u, n in state.known.items()))

    async def _remember_joined(self) -> None:
        """``--resume``: take back the workers that had joined the run and still answer, as if they joined now."""
        for url, name in joined_workers(self.config.out_dir).items():
            if url in self.state.known:
                continue
            try:
                health = await health_of(self.client, url, self.config.connect_timeout)
            except (TransportError, OSError, EdgertError) as error:
                self.log.event("join_forgotten", worker=name, url=url, reason=str(error))
                self._progress.message(f"worker {name} had joined from {url} but does not answer: left out")
                continue
            if health.name != name:
                self.log.event("join_forgotten", worker=name, url=url, reason=f"{url} is now {health.name!r}")
                continue
            self.replanning.admit(url, name)
            self.log.event("join_remembered", worker=name, url=url)
            self._progress.message(f"worker {name} had joined from {url}: remembered, weighed at the first check")

    def _write_run_files(self) -> None:
        plan_copy = self.config.out_dir / "plan"
        if plan_copy.resolve() != self.config.plan_dir.resolve():
            plan_copy.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.config.plan_dir / MANIFEST_NAME, plan_copy / MANIFEST_NAME)
            source = self.config.plan_dir / "source.onnx"
            if source.is_file():
                shutil.copyfile(source, plan_copy / "source.onnx")
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self.config).items()}
        write_data_record(self.config.out_dir, DataRecord.of(self.data_settings, self.dataset))
        self.log.write_json(RUN_FILE, {"run_id": self.run_id, "started": self.log.started, "config": config,
                                       "workers": self.state.names, "plan": str(self.config.plan_dir.resolve()),
                                       "stages": len(self.state.manifest.stages)})

    @property
    def _plans_live(self) -> bool:
        """Whether the run needs the planner while it trains: to re-plan, recover, or place workers that join."""
        config = self.config
        return config.replan == "auto" or bool(config.replan_at) or self._fault_tolerant

    @property
    def _fault_tolerant(self) -> bool:
        return bool(self.config.replicate_every or self.config.central_every)

    def _prepare_settings(self) -> None:
        """What every stage assignment of this run carries."""
        scheme, _, port = parse_url(self.server.urls[0])
        host = self.config.advertise or _local_address_towards(self.config.workers[0])
        placement = load_placement(self.state.plan_dir)
        planned = self.config.plans_side_by_side(placement)
        self.state.settings = RunBriefing(
            run_id=self.run_id, coordinator_url=f"{scheme}://{host}:{port}",
            settings=self.config.run_settings(self.state.manifest.training, planned, placement),
            replicas=self.config.replicas,
            signing=None if self.security is None else self.security.signing,
            planned_codecs=self.config.planned_codecs(),
            threads=placement.threads() if planned else {})

    async def _assign_stages(self) -> None:
        self._prepare_settings()
        state = self.state
        started = time.perf_counter()
        try:
            links = await assign(self.client, state.manifest, state.plan_dir, state.order, state.names,
                                 state.settings, state.groups)
        except EdgertError as error:
            raise TrainingError(str(error)) from None
        self.ledger.configure(state.names, state.member_counts())
        groups = groups_record(state.groups, state.known)
        self.log.event("stages_assigned", seconds=round(time.perf_counter() - started, 3), workers=state.names,
                       cuts=list(state.manifest.cuts), **({"groups": groups} if groups else {}))
        self.log.event("links", links=links_record(state.names, links))

    async def _release_workers(self) -> None:
        async def stop(url: str) -> None:
            try:
                await self.client.post(url, STOP, b"run finished", timeout=2.0, retries=0)
            except (TransportError, OSError):
                pass

        if self.state.known:
            await asyncio.gather(*(stop(url) for url in self.state.known))

    # -- training ----------------------------------------------------------------------------

    async def _train(self, plan: list[Batch], start_step: int = 0) -> None:
        """Run ``plan``'s steps from ``start_step`` on, in segments; evaluate at epoch ends, re-plan when
        asked to, recover from failures."""
        config = self.config
        if not plan:
            raise TrainingError("no training step to run: the data set is smaller than one batch")
        self.evaluation.use_plan(self.state.plan_dir, self.state.manifest)
        position = next((k for k, batch in enumerate(plan) if batch.step >= start_step), len(plan))
        forced = {step for step, _ in config.replan_at}
        while position < len(plan):
            chunk, ends_epoch = next_segment(plan[position:], config.schedule, forced)
            try:
                while chunk:
                    started = self.ledger.begin_segment()
                    try:
                        done = await self._segments.run(chunk, final=position + len(chunk) == len(plan))
                    finally:  # the time training took, also when a failure cut the segment short
                        self.log.record("segment", first_step=chunk[0].step, started_s=started,
                                        seconds=round(self.log.elapsed() - started, 6))
                    position += done
                    chunk = chunk[done:]
                    self.ledger.reset_timing()
                if ends_epoch:
                    await self.evaluation.evaluate(plan[position - 1].epoch, plan[position - 1].step)
                if position < len(plan) and plan[position].step in dict(config.replan_at):
                    await self.replanning.forced(plan[position].step)
            except (WorkerFailure, TransportError, AssignmentError) as error:
                failure = await self.failures.as_failure(error)
                if not self._fault_tolerant:
                    raise TrainingError(f"{failure} (fault tolerance is off: --replicate-every 0)") from None
                resume = await self.recovery.recover(failure)
                position = next((k for k, batch in enumerate(plan) if batch.step == resume), len(plan))
            self.ledger.reset_timing()
        await self.evaluation.settle()

    async def _on_report(self, request: Request) -> None:
        message = read_report(request, self.state.run_id, self.state.names, self.state.member_names())
        worker = message.worker if request.identity is None else request.identity.name
        if message.failed is not None:
            self.ledger.fail(f"stage {message.stage} ({worker or '?'}) failed: {message.failed}")
            return
        for report in message.reports:
            self.ledger.add(report, worker)

    def _show_step(self, record: StepRecord) -> None:
        self._progress.update(self.ledger.completed, epoch=record.epoch + 1, loss=record.loss, acc=record.accuracy,
                              **{"samples/s": round(record.samples / max(record.step_ms, 1e-9) * 1000, 1)})

    def _summary(self) -> RunSummary:
        """The whole run's summary, from its records on disk (every process of it, across resumes)."""
        summary = summarise(self.config.out_dir)
        self.log.record("summary", **dataclasses.asdict(summary))
        return summary


def _local_address_towards(url: str) -> str:
    """The address of this host on the route to ``url`` (what workers can reach us at)."""
    _, host, port = parse_url(url)
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, port))
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def read_run_file(run_dir: Path) -> dict[str, Any]:
    """A run folder's run.json."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        raise TrainingError(f"{run_dir}: no {RUN_FILE}; is this a run folder written by `edgert train`?")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise TrainingError(f"{path}: unreadable ({error})") from None


def resumed_config(run_dir: Path, workers: list[str] | None = None) -> TrainConfig:
    """The config of the run in ``run_dir`` (its run.json), set to resume there; workers may be replaced.

    ``run_dir`` is the run folder, wherever it is now (the folder stored in run.json may have moved).
    """
    saved = read_run_file(run_dir)["config"]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in saved.items() if k in fields}
    for name in ("plan_dir", "out_dir", "devices", "keys"):
        if values.get(name) is not None:
            values[name] = Path(values[name])
    values["workers"] = tuple(workers) if workers else tuple(values["workers"])
    if (Path(run_dir) / DATA_FILE).is_file():  # the data's absolute path: the run resumes from any folder
        values["data"] = read_data_record(run_dir).settings.source
    values["replan_at"] = tuple((step, tuple(cuts) if cuts else None) for step, cuts in values.get("replan_at", ()))
    return TrainConfig(**{**values, "out_dir": Path(run_dir), "resume": True, "overwrite": False})


def train(config: TrainConfig) -> RunSummary:
    """Run a training job to the end (blocking)."""
    return asyncio.run(Coordinator(config).run())

