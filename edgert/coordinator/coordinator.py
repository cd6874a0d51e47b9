"""``edgert train``: the central node. Assigns stages, streams data, records, re-plans.

The coordinator never carries activations or gradients: it sends each worker its stage,
tells every worker which steps to run under which schedule (``/run``), posts each step's
inputs to the first stage and labels to the last (``/batch``), and receives one report per
stage per optimizer step on its own ``/report`` resource. At each epoch's end it fetches
every stage's state, keeps it as the checkpoint, and evaluates it on the test set. With
re-planning on, it watches the stages' times and moves the cuts at a step boundary when
a new plan pays for its pause (edgert.coordinator.assignment, edgert.exporter.planner.replanner).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import socket
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgert.coordinator.assignment import AssignmentError, RunBriefing, assign, with_learning_rate
from edgert.coordinator.data import Batch, batches, load_training_data
from edgert.coordinator.evaluation import EvaluationMixin
from edgert.coordinator.evaluator import Evaluator
from edgert.coordinator.failures import CentralCopies, FailureWatch, WorkerFailure
from edgert.coordinator.inputs import read_report
from edgert.coordinator.ledger import HISTORY, StepLedger
from edgert.coordinator.progress import Progress
from edgert.coordinator.recovery import RecoveryMixin
from edgert.coordinator.replanning import ReplanMixin
from edgert.coordinator.run_summary import RunSummary, count_events, summarise
from edgert.coordinator.runlog import RUN_FILE, RunLog, claim_run_folder, new_run_id
from edgert.errors import EdgertError, TrainingError
from edgert.manifest import MANIFEST_NAME, MEMORY_MODES, Manifest, TrainingConfig, load_manifest
from edgert.protocol import (
    BATCH,
    HEALTH,
    INBOX_CAPACITY,
    JOIN,
    MAX_SEGMENT_STEPS,
    REPLICA,
    REPORT,
    RUN,
    STOP,
    WEIGHTS,
    Health,
    Segment,
    hold_envelope,
    truncate_envelope,
)
from edgert.run_settings import RunSettings
from edgert.schedule import SCHEDULES, steps_ahead
from edgert.transport import ClientConfig, Envelope, Request, TensorClient, TensorServer, TransportError
from edgert.transport.urls import parse_url
from edgert.weights import StageState

log = logging.getLogger("edgert.coordinator.coordinator")

SHIFT_WINDOW = 2  # steps a placement check looks at when a device has just changed speed


def next_segment(plan: list[Batch], schedule: str, forced: set[int]) -> tuple[list[Batch], bool]:
    """The plan's first segment and whether it ends an epoch: an epoch (under ``async``, every epoch
    left), cut before every ``forced`` re-plan step and after ``MAX_SEGMENT_STEPS`` steps.

    An ``async`` segment runs on across epoch ends: each is evaluated from the copies the
    stages send after its last step (edgert/coordinator/evaluation.py).
    """
    for k, batch in enumerate(plan):
        following = plan[k + 1] if k + 1 < len(plan) else None
        ends_epoch = following is None or following.epoch != batch.epoch
        if following is None or (ends_epoch and schedule != "async") or k + 1 == MAX_SEGMENT_STEPS \
                or following.step in forced:
            return plan[:k + 1], ends_epoch
    return plan, True


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``edgert train`` was asked to do."""

    plan_dir: Path
    workers: tuple[str, ...]
    out_dir: Path
    data: str = "digits"
    epochs: int = 5
    steps: int | None = None
    batch_size: int = 64
    micro_batches: int = 4
    schedule: str = "1f1b"
    learning_rate: float | None = None
    seed: int = 0
    lookahead: int = 8
    forward_codec: str = RunSettings.forward_codec
    backward_codec: str = RunSettings.backward_codec
    forward_threads: int = RunSettings.forward_threads
    backward_threads: int = RunSettings.backward_threads
    connect_timeout: float = 5.0
    step_timeout: float = RunSettings.wait_timeout
    listen: str = "coap+tcp://0.0.0.0:0"
    advertise: str | None = None
    progress: bool = True
    replan: str = "off"  # off | auto
    replan_every: int = 10
    replan_threshold: float = 0.1
    replan_at: tuple[tuple[int, tuple[int, ...] | None], ...] = ()  # forced: (before step, block cuts or None)
    devices: Path | None = None
    memory_mode: str = RunSettings.memory_mode
    replicate_every: int = RunSettings.replicate_every
    central_every: int = RunSettings.central_every  # its copies are kept on disk
    replicas: int = 1  # neighbours each stage's copy goes to
    resume: bool = False  # continue the run in out_dir from its newest snapshot
    overwrite: bool = False  # out_dir may hold another run: its records are removed
    keys: Path | None = None  # the cluster keystore (edgert keys init); None: plaintext (--insecure)

    def run_settings(self, training: TrainingConfig) -> RunSettings:
        """What every stage of this run is told, training by ``training`` (the plan's, ``--lr`` applied)."""
        return RunSettings(training=with_learning_rate(training, self.learning_rate),
                           forward_codec=self.forward_codec, backward_codec=self.backward_codec,
                           forward_threads=self.forward_threads, backward_threads=self.backward_threads,
                           wait_timeout=self.step_timeout, memory_mode=self.memory_mode,
                           replicate_every=self.replicate_every, central_every=self.central_every)


class Coordinator(RecoveryMixin, ReplanMixin, EvaluationMixin):
    """Runs one training job over a set of workers."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self._check_config()
        if not config.resume:  # before anything is loaded: a folder holding another run is refused at once
            claim_run_folder(config.out_dir, config.overwrite)
        self.plan_dir = config.plan_dir
        self.manifest: Manifest = load_manifest(config.plan_dir)
        if len(config.workers) != len(self.manifest.stages) and not config.resume:
            raise TrainingError(f"the plan has {len(self.manifest.stages)} stages but {len(config.workers)} "
                                f"worker(s) were given; give one --workers URL per stage")
        if config.resume:
            saved = read_run_file(config.out_dir)
            # a run folder written before runs had their own ids is named by its folder
            self.run_id, self.started = str(saved.get("run_id") or config.out_dir.name), saved.get("started")
        else:
            self.run_id, self.started = new_run_id(), time.time()
        self.dataset = load_training_data(config.data, self.manifest, config.seed)
        self.security = None
        if config.keys is not None:
            from edgert.security.keystore import HostSecurity  # host side only

            self.security = HostSecurity.open(config.keys)
        tls = None if self.security is None else self.security.tls
        self.client = TensorClient(ClientConfig(timeout=30.0, retries=2, connect_timeout=config.connect_timeout),
                                   tls=tls)
        self.server = TensorServer(config.listen, tls=tls)
        self.server.add_resource(REPORT, post=self._on_report, rt="edgert.report", kinds=("report",))
        self.server.add_resource(REPLICA, put=self._on_replica, rt="edgert.replica", kinds=("weights",))
        self.server.add_resource(JOIN, post=self._on_join, rt="edgert.join", kinds=("control",))
        self.server.add_resource(WEIGHTS, fetch=self._on_weights_fetch, rt="edgert.weights", kinds=("control",))
        self.central = CentralCopies(config.out_dir / "snapshots")
        self.watch: FailureWatch | None = None
        self._failed: dict[str, float] = {}  # failed worker URL -> when it was noticed (monotonic), until recovered
        self._recoveries = 0
        self._membership_changed = False
        self._recheck_after_replan = False  # a live re-plan's result is checked SHIFT_WINDOW + 1 steps later
        self.order: list[str] = list(config.workers)  # worker URL of each stage
        self.names: list[str] = []
        self._announced_through = -1  # the last step of the segments sent to the workers (copies come after)
        self.known: dict[str, str] = {}  # worker URL -> name
        self.log: RunLog | None = None
        self.ledger: StepLedger | None = None
        self.replanner = None
        self.replans = 0
        if config.resume:  # plans/plan<N> and plans/recovery<N> go on from the run's earlier processes
            self.replans, self._recoveries = count_events(config.out_dir, "replan", "recovery")
        self._progress: Progress | None = None
        self._settings: RunBriefing | None = None
        self._evaluator: Evaluator | None = None
        self._init_evaluation()

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
        if config.replan not in ("off", "auto"):
            raise TrainingError(f"--replan must be off or auto (got {config.replan!r})")

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> RunSummary:
        """Connect, assign, train, evaluate; always releases the workers."""
        self.log = RunLog(self.config.out_dir, self.started)
        self.ledger = StepLedger(self.log, self._show_step, history=max(HISTORY, self.config.replan_every))
        try:
            await self.server.start()
            await self._connect_workers()
            self._write_run_files()
            if self.config.replan == "auto" or self.config.replan_at or self._fault_tolerant:
                self.replanner = self._make_replanner()
                if self.config.devices is None:
                    await self._profile_workers(dict(self.known))
            if self.config.resume:
                self._prepare_settings()
                start = await self._resume_from_snapshot()
            else:
                await self._assign_stages()
                start = 0
            self.watch = FailureWatch(self.client, self._on_worker_failure)
            self.watch.watch(list(self.known))
            await self._train(start)
            return self._summary()
        finally:
            if self.watch is not None:
                await self.watch.close()
            await self._release_workers()
            if self._progress is not None:
                self._progress.close()
            self.log.close()
            await self.server.shutdown()
            await self.client.close()

    async def _connect_workers(self) -> None:
        async def probe(url: str) -> Health:
            try:
                response = await self.client.get(url, HEALTH, timeout=self.config.connect_timeout, retries=1)
                return Health.from_envelope(response.envelope())
            except (TransportError, OSError, EdgertError) as error:
                raise TrainingError(f"worker {url} is not reachable: {error}") from None

        healths = await asyncio.gather(*(probe(url) for url in self.config.workers))
        self.known = {url: h.name for url, h in zip(self.config.workers, healths)}
        self.names = [self.known[url] for url in self.order]
        log.info("workers: %s", ", ".join(f"{n} ({u})" for u, n in self.known.items()))

    def _write_run_files(self) -> None:
        plan_copy = self.config.out_dir / "plan"
        if plan_copy.resolve() != self.config.plan_dir.resolve():
            plan_copy.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.config.plan_dir / MANIFEST_NAME, plan_copy / MANIFEST_NAME)
            source = self.config.plan_dir / "source.onnx"
            if source.is_file():
                shutil.copyfile(source, plan_copy / "source.onnx")
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self.config).items()}
        self.log.write_json(RUN_FILE, {"run_id": self.run_id, "started": self.log.started, "config": config,
                                       "workers": self.names, "plan": str(self.config.plan_dir.resolve()),
                                       "stages": len(self.manifest.stages)})

    @property
    def _fault_tolerant(self) -> bool:
        return bool(self.config.replicate_every or self.config.central_every)

    def _prepare_settings(self) -> None:
        """What every stage assignment of this run carries."""
        scheme, _, port = parse_url(self.server.urls[0])
        host = self.config.advertise or _local_address_towards(self.config.workers[0])
        self._settings = RunBriefing(
            run_id=self.run_id, coordinator_url=f"{scheme}://{host}:{port}",
            settings=self.config.run_settings(self.manifest.training), replicas=self.config.replicas,
            signing=None if self.security is None else self.security.signing)

    async def _assign_stages(self) -> None:
        self._prepare_settings()
        started = time.perf_counter()
        try:
            await assign(self.client, self.manifest, self.plan_dir, self.order, self.names, self._settings)
        except EdgertError as error:
            raise TrainingError(str(error)) from None
        self.ledger.configure(self.names)
        self.log.event("stages_assigned", seconds=round(time.perf_counter() - started, 3), workers=self.names,
                       cuts=list(self.manifest.cuts))

    async def _release_workers(self) -> None:
        async def stop(url: str) -> None:
            try:
                await self.client.post(url, STOP, b"run finished", timeout=2.0, retries=0)
            except (TransportError, OSError):
                pass

        if self.known:
            await asyncio.gather(*(stop(url) for url in self.known))

    # -- training ----------------------------------------------------------------------------

    async def _train(self, start_step: int = 0) -> None:
        config = self.config
        plan = list(batches(len(self.dataset.x_train), config.batch_size, config.epochs, config.seed, config.steps))
        if not plan:
            raise TrainingError("no training step to run: the data set is smaller than one batch")
        self._progress = Progress(len(plan), enabled=config.progress)
        self._evaluator = Evaluator(self.plan_dir, self.manifest)
        position = next((k for k, batch in enumerate(plan) if batch.step >= start_step), len(plan))
        forced = {step for step, _ in config.replan_at}
        while position < len(plan):
            chunk, ends_epoch = next_segment(plan[position:], config.schedule, forced)
            try:
                while chunk:
                    started = self.ledger.begin_segment()
                    try:
                        done = await self._run_segment(chunk, final=position + len(chunk) == len(plan))
                    finally:  # the time training took, also when a failure cut the segment short
                        self.log.record("segment", first_step=chunk[0].step, started_s=started,
                                        seconds=round(self.log.elapsed() - started, 6))
                    position += done
                    chunk = chunk[done:]
                    self.ledger.reset_timing()
                if ends_epoch:
                    await self._evaluate(plan[position - 1].epoch, plan[position - 1].step)
                if position < len(plan) and plan[position].step in dict(config.replan_at):
                    await self._forced_replan(plan[position].step)
            except (WorkerFailure, TransportError, AssignmentError) as error:
                failure = await self._as_failure(error)
                if not self._fault_tolerant:
                    raise TrainingError(f"{failure} (fault tolerance is off: --replicate-every 0)") from None
                resume = await self._recover(failure)
                position = next((k for k, batch in enumerate(plan) if batch.step == resume), len(plan))
            self.ledger.reset_timing()
        await self._settle_evaluations()

    async def _run_segment(self, plan: list[Batch], final: bool = False) -> int:
        """Run these steps, feeding them ``lookahead`` steps ahead; returns how many ran.

        With re-planning on, every ``replan_every`` completed steps the current placement is
        checked while the pipeline keeps going; a re-plan cuts the segment at the last step
        whose data was sent, drains, moves the cuts, and returns early. While the segment
        drains (unless it is the ``final`` one) the checks go on, and a re-plan waits for it.
        """
        config = self.config
        stages = len(self.manifest.stages)
        epoch_ends = {batch.step: batch.epoch for batch, following in zip(plan, plan[1:])
                      if batch.epoch != following.epoch}
        segment = Segment(config.schedule, stages, plan[0].step, len(plan), config.batch_size, config.micro_batches,
                          checkpoint_steps=tuple(sorted(epoch_ends)))
        self._expect_checkpoints(epoch_ends)
        for batch in plan:
            self.ledger.expect(batch.step, batch.epoch, len(batch.indices))
        envelope = segment.to_envelope(self.run_id)
        self._announced_through = max(self._announced_through, segment.last_step)
        await asyncio.gather(*(self.client.send(url, RUN, envelope) for url in self.order))
        ahead = steps_ahead(config.schedule, stages, config.micro_batches, config.lookahead, INBOX_CAPACITY)
        in_flight: deque[int] = deque()
        since_check = 0

        async def settle(step: int):
            """Wait for ``step``; then, when due, a better placement or None."""
            nonlocal since_check
            await self._wait_step(step)
            since_check += 1
            auto = config.replan == "auto"
            shifted = auto and self.ledger.speed_changed()
            # right after a re-plan, the new placement's own times (not the old ones) are checked soon
            recheck = auto and self._recheck_after_replan and since_check > SHIFT_WINDOW
            if (auto and since_check >= config.replan_every) or shifted or recheck or self._membership_changed:
                since_check, self._membership_changed, self._recheck_after_replan = 0, False, False
                quick = shifted or recheck
                return await self._check_placement(window=SHIFT_WINDOW if quick else config.replan_every)
            return None

        for batch in plan:
            while len(in_flight) >= ahead:
                proposal = await settle(in_flight.popleft())
                if proposal is not None:
                    return await self._replan_now(proposal, plan, in_flight)
            await self._send_batch(batch)
            in_flight.append(batch.step)
        while in_flight:
            step = in_flight.popleft()
            if final:
                await self._wait_step(step)
                continue
            proposal = await settle(step)
            if proposal is not None:
                return await self._replan_now(proposal, plan, in_flight)
        return len(plan)

    async def _replan_now(self, proposal, plan: list[Batch], in_flight: deque[int]) -> int:
        """Stop the pipeline after the latest step any stage has committed (run a backward or an
        optimizer step for), re-partition; returns steps run.

        Later steps, even those a fast stage has run forwards for, are dropped and sent again to the
        new placement (docs/RUNTIME.md, "Hold and truncate").
        """
        replies = await asyncio.gather(*(self.client.send(url, RUN, hold_envelope(self.run_id)) for url in self.order))
        committed = max(int(reply.envelope().meta.get("committed", -1)) for reply in replies)
        last = max(committed, self.ledger.completed_through, plan[0].step - 1)
        await asyncio.gather(*(self.client.send(url, RUN, truncate_envelope(self.run_id, last)) for url in self.order))
        for step in in_flight:
            if step <= last:
                await self._wait_step(step)
        self.ledger.forget([batch.step for batch in plan if batch.step > last])
        await self._settle_evaluations(through_step=last, drop_later=True)
        await self._repartition(proposal, last + 1)
        return last + 1 - plan[0].step

    async def _send_batch(self, batch: Batch) -> None:
        """The step's inputs to the first stage and labels to the last: one message each (one in all)."""
        inputs = {self.manifest.model_input[0].name: np.ascontiguousarray(self.dataset.x_train[batch.indices])}
        labels = {self.manifest.labels[0].name: np.ascontiguousarray(self.dataset.y_train[batch.indices])}
        first, last = self.order[0], self.order[-1]
        messages = [(first, inputs), (last, labels)] if len(self.order) > 1 else [(first, {**inputs, **labels})]
        await asyncio.gather(*(self.client.send(url, BATCH, Envelope(kind="batch", run_id=self.run_id,
                                                                     step=batch.step, tensors=tensors))
                               for url, tensors in messages))

    async def _on_report(self, request: Request) -> None:
        message = read_report(request, self.run_id, self.names)
        worker = message.worker if request.identity is None else request.identity.name
        if message.failed is not None:
            self.ledger.fail(f"stage {message.stage} ({worker or '?'}) failed: {message.failed}")
            return
        for report in message.reports:
            self.ledger.add(report, worker)

    def _show_step(self, record) -> None:
        if self._progress is not None:
            self._progress.update(self.ledger.completed, epoch=record.epoch + 1, loss=record.loss,
                                  acc=record.accuracy,
                                  **{"samples/s": round(record.samples / max(record.step_ms, 1e-9) * 1000, 1)})

    # -- evaluation and checkpoints ----------------------------------------------------------

    async def _fetch_states(self) -> list[StageState]:
        async def fetch(url: str) -> StageState:
            return StageState.from_envelope(await self.client.fetch(url, WEIGHTS, timeout=60.0))

        return list(await asyncio.gather(*(fetch(url) for url in self.order)))

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
    values["replan_at"] = tuple((step, tuple(cuts) if cuts else None) for step, cuts in values.get("replan_at", ()))
    return TrainConfig(**{**values, "out_dir": Path(run_dir), "resume": True, "overwrite": False})


def train(config: TrainConfig) -> RunSummary:
    """Run a training job to the end (blocking)."""
    return asyncio.run(Coordinator(config).run())


def summary_json(summary: RunSummary) -> dict[str, Any]:
    return dataclasses.asdict(summary)
