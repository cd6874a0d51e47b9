"""``edgert train``: the central node. Assigns stages, streams data, records, re-plans.

The coordinator never carries activations or gradients: it sends each worker its stage,
tells every worker which steps to run under which schedule (``/run``), posts each step's
inputs to the first stage and labels to the last (``/batch``), and receives one report per
stage per optimizer step on its own ``/report`` resource. At each epoch's end it fetches
every stage's state, keeps it as the checkpoint, and evaluates it on the test set. With
re-planning on, it watches the stages' times and moves the cuts at a step boundary when
a new plan pays for its pause (edgert.assignment, edgert.exporter.replanner).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgert.assignment import LinkSettings, assign, migrate, with_learning_rate
from edgert.data import Batch, batches, load_training_data
from edgert.errors import EdgertError
from edgert.evaluation import Evaluator
from edgert.ledger import StepLedger
from edgert.manifest import MANIFEST_NAME, MEMORY_MODES, Manifest, load_manifest
from edgert.progress import Progress
from edgert.protocol import BATCH, HEALTH, REPORT, RUN, STOP, WEIGHTS, Health, Segment, reports_from_envelope
from edgert.runlog import RunLog
from edgert.schedule import SCHEDULES
from edgert.transport import ClientConfig, Envelope, Request, TensorClient, TensorServer, TransportError
from edgert.transport.server import parse_url
from edgert.weights import StageState, save_state

log = logging.getLogger("edgert.coordinator")


class TrainingError(EdgertError):
    """The run could not start or could not go on."""


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
    forward_codec: str = "none"
    backward_codec: str = "none"
    forward_threads: int = 1
    backward_threads: int = 1
    connect_timeout: float = 5.0
    step_timeout: float = 120.0
    listen: str = "coap+tcp://0.0.0.0:0"
    advertise: str | None = None
    progress: bool = True
    replan: str = "off"  # off | auto
    replan_every: int = 10
    replan_threshold: float = 0.1
    replan_at: tuple[tuple[int, tuple[int, ...] | None], ...] = ()  # forced: (before step, block cuts or None)
    devices: Path | None = None
    memory_mode: str = "recompute"  # recompute | stash


@dataclass
class RunSummary:
    """What ``edgert train --json`` prints."""

    run_dir: str
    steps: int
    epochs: int
    samples: int
    train_seconds: float
    samples_per_s: float
    train_loss: float | None
    test_loss: float | None
    test_accuracy: float | None
    stage_utilisation: list[float] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    schedule: str = ""
    replans: int = 0


class Coordinator:
    """Runs one training job over a set of workers."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self._check_config()
        self.plan_dir = config.plan_dir
        self.manifest: Manifest = load_manifest(config.plan_dir)
        if len(config.workers) != len(self.manifest.stages):
            raise TrainingError(f"the plan has {len(self.manifest.stages)} stages but {len(config.workers)} "
                                f"worker(s) were given; give one --workers URL per stage")
        self.run_id = config.out_dir.name or "run"
        self.dataset = load_training_data(config.data, self.manifest, config.seed)
        self.client = TensorClient(ClientConfig(timeout=30.0, retries=2, connect_timeout=config.connect_timeout))
        self.server = TensorServer(config.listen)
        self.server.add_resource(REPORT, post=self._on_report, rt="edgert.report", kinds=("report",))
        self.order: list[str] = list(config.workers)  # worker URL of each stage
        self.names: list[str] = []
        self.known: dict[str, str] = {}  # worker URL -> name
        self.log: RunLog | None = None
        self.ledger: StepLedger | None = None
        self.replanner = None
        self.replans = 0
        self._train_seconds = 0.0
        self._progress: Progress | None = None
        self._settings: LinkSettings | None = None

    def _check_config(self) -> None:
        config = self.config
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
        self.log = RunLog(self.config.out_dir)
        self.ledger = StepLedger(self.log, self._show_step)
        try:
            await self.server.start()
            await self._connect_workers()
            self._write_run_files()
            if self.config.replan == "auto" or self.config.replan_at:
                self.replanner = self._make_replanner()
            await self._assign_stages()
            test = await self._train()
            return self._summary(test)
        finally:
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
        self.log.write_json("run.json", {"run_id": self.run_id, "config": config, "workers": self.names,
                                         "plan": str(self.config.plan_dir.resolve()),
                                         "stages": len(self.manifest.stages)})

    def _make_replanner(self):
        try:
            from edgert.exporter.replanner import Replanner
        except ImportError as error:
            raise TrainingError(f"re-planning needs the host extra (onnx): {error}") from None
        return Replanner(self.config.plan_dir, self.manifest, self.config.out_dir / "stage-cache",
                         devices=self.config.devices, threshold=self.config.replan_threshold,
                         batch_size=self.config.batch_size, micro_batches=self.config.micro_batches,
                         schedule=self.config.schedule)

    async def _assign_stages(self) -> None:
        scheme, _, port = parse_url(self.server.urls[0])
        host = self.config.advertise or _local_address_towards(self.config.workers[0])
        self._settings = LinkSettings(
            run_id=self.run_id, coordinator_url=f"{scheme}://{host}:{port}",
            training=with_learning_rate(self.manifest.training, self.config.learning_rate),
            forward_codec=self.config.forward_codec, backward_codec=self.config.backward_codec,
            forward_threads=self.config.forward_threads, backward_threads=self.config.backward_threads,
            wait_timeout=self.config.step_timeout, memory_mode=self.config.memory_mode)
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

    async def _train(self) -> tuple[float | None, float | None]:
        config = self.config
        plan = list(batches(len(self.dataset.x_train), config.batch_size, config.epochs, config.seed, config.steps))
        if not plan:
            raise TrainingError("no training step to run: the data set is smaller than one batch")
        self._progress = Progress(len(plan), enabled=config.progress)
        evaluator = Evaluator(self.plan_dir, self.manifest)
        test: tuple[float | None, float | None] = (None, None)
        for chunk, ends_epoch in self._chunks(plan):
            started = time.perf_counter()
            await self._run_segment(chunk)
            self._train_seconds += time.perf_counter() - started
            if ends_epoch:
                test = await self._evaluate(evaluator, chunk[-1].epoch, chunk[-1].step)
            if chunk[-1] is not plan[-1] and await self._maybe_replan(chunk[-1].step + 1):
                evaluator = Evaluator(self.plan_dir, self.manifest)
            self.ledger.reset_timing()
        return test

    def _chunks(self, plan: list[Batch]) -> list[tuple[list[Batch], bool]]:
        """Segments: an epoch, cut further where a re-plan may happen."""
        forced = {step for step, _ in self.config.replan_at}
        chunks: list[tuple[list[Batch], bool]] = []
        current: list[Batch] = []
        for k, batch in enumerate(plan):
            current.append(batch)
            following = plan[k + 1] if k + 1 < len(plan) else None
            ends_epoch = following is None or following.epoch != batch.epoch
            boundary = following is not None and (
                following.step in forced
                or (self.config.replan == "auto" and following.step % self.config.replan_every == 0))
            if ends_epoch or boundary:
                chunks.append((current, ends_epoch))
                current = []
        return chunks

    async def _run_segment(self, plan: list[Batch]) -> None:
        """Tell every worker to run these steps, then feed them, ``lookahead`` steps ahead."""
        config = self.config
        stages = len(self.manifest.stages)
        segment = Segment(config.schedule, stages, plan[0].step, len(plan), config.batch_size, config.micro_batches)
        for batch in plan:
            self.ledger.expect(batch.step, batch.epoch, len(batch.indices))
        envelope = segment.to_envelope(self.run_id)
        await asyncio.gather(*(self.client.send(url, RUN, envelope) for url in self.order))
        ahead = config.lookahead + (stages if config.schedule == "async" else 0)
        in_flight: deque[int] = deque()
        for batch in plan:
            while len(in_flight) >= ahead:
                await self._wait_step(in_flight.popleft())
            await self._send_batch(batch)
            in_flight.append(batch.step)
        for step in in_flight:
            await self._wait_step(step)

    async def _send_batch(self, batch: Batch) -> None:
        """The step's inputs to the first stage and labels to the last: one message each (one in all)."""
        inputs = {self.manifest.model_input[0].name: np.ascontiguousarray(self.dataset.x_train[batch.indices])}
        labels = {self.manifest.labels[0].name: np.ascontiguousarray(self.dataset.y_train[batch.indices])}
        first, last = self.order[0], self.order[-1]
        messages = [(first, inputs), (last, labels)] if len(self.order) > 1 else [(first, {**inputs, **labels})]
        await asyncio.gather(*(self.client.send(url, BATCH, Envelope(kind="batch", run_id=self.run_id,
                                                                     step=batch.step, tensors=tensors))
                               for url, tensors in messages))

    async def _wait_step(self, step: int) -> None:
        if not await self.ledger.wait(step, self.config.step_timeout):
            names = ", ".join(f"stage {k} ({self.names[k]})" for k in self.ledger.missing(step))
            raise TrainingError(f"step {step}: no report from {names} within {self.config.step_timeout:.0f} s")
        if self.ledger.failure:
            raise TrainingError(self.ledger.failure)

    async def _on_report(self, request: Request) -> None:
        envelope = request.envelope
        if envelope.run_id != self.run_id or self.ledger is None:
            return
        if "failed" in envelope.meta:
            self.ledger.fail(f"stage {envelope.stage} ({envelope.meta.get('worker', '?')}) failed: "
                             f"{envelope.meta['failed']}")
            return
        reports, worker = reports_from_envelope(envelope)
        for report in reports:
            self.ledger.add(report, worker)

    def _show_step(self, record) -> None:
        if self._progress is not None:
            self._progress.update(self.ledger.completed, epoch=record.epoch + 1, loss=record.loss,
                                  acc=record.accuracy,
                                  **{"samples/s": round(record.samples / max(record.step_ms, 1e-9) * 1000, 1)})

    # -- re-planning ---------------------------------------------------------------------------

    async def _maybe_replan(self, next_step: int) -> bool:
        if self.replanner is None:
            return False
        forced = dict(self.config.replan_at)
        measured = self.ledger.stage_compute_ms(self.config.replan_every)
        step_ms = self.ledger.median_step_ms(self.config.replan_every)
        self.replanner.observe(self.manifest, self.names, measured, step_ms)
        if next_step in forced:
            proposal = self.replanner.propose(self.manifest, self.names, force=True, cuts=forced[next_step])
        else:
            proposal = self.replanner.propose(self.manifest, self.names)
        if proposal is None:
            return False
        await self._repartition(proposal, next_step)
        return True

    async def _repartition(self, proposal, next_step: int) -> None:
        started = time.perf_counter()
        self.replans += 1
        folder = self.config.out_dir / "plans" / f"plan{self.replans}"
        loop = asyncio.get_running_loop()
        manifest = await loop.run_in_executor(None, self.replanner.build, list(proposal.cuts), folder)
        by_name = {name: url for url, name in self.known.items()}
        order = [by_name[name] for name in proposal.workers]
        old_manifest, old_order, old_cuts = self.manifest, self.order, list(self.manifest.cuts)
        try:
            await assign(self.client, manifest, folder, order, list(proposal.workers), self._settings)
            moved = await migrate(self.client, self.run_id, old_manifest, old_order, manifest, order)
        except EdgertError as error:
            raise TrainingError(f"re-partition before step {next_step} failed: {error}") from None
        self.manifest, self.plan_dir, self.order, self.names = manifest, folder, order, list(proposal.workers)
        self.ledger.configure(self.names)
        pause = time.perf_counter() - started
        self.replanner.record_pause(pause)
        self.log.event("replan", before_step=next_step, reason=proposal.reason, old_cuts=old_cuts,
                       new_cuts=list(manifest.cuts), workers=self.names, predicted_gain=round(proposal.gain, 3),
                       pause_s=round(pause, 3), bytes_moved=moved.bytes, migrate_s=round(moved.seconds, 3))
        if self._progress is not None:
            self._progress.message(f"re-planned before step {next_step} ({proposal.reason}): cuts "
                                   f"{old_cuts} -> {list(manifest.cuts)}, paused {pause:.2f} s")

    # -- evaluation and checkpoints ----------------------------------------------------------

    async def _fetch_states(self) -> list[StageState]:
        async def fetch(url: str) -> StageState:
            return StageState.from_envelope(await self.client.fetch(url, WEIGHTS, timeout=60.0))

        return list(await asyncio.gather(*(fetch(url) for url in self.order)))

    async def _evaluate(self, evaluator: Evaluator, epoch: int, step: int) -> tuple[float | None, float | None]:
        states = await self._fetch_states()
        folder = self.config.out_dir / "checkpoints" / "latest"
        for stale in folder.glob("stage*.cbor"):
            stale.unlink()
        written = sum(save_state(state, folder / f"stage{k}.cbor", self.run_id) for k, state in enumerate(states))
        self._copy_plan(self.config.out_dir / "plan")
        (folder / "checkpoint.json").write_text(json.dumps({"step": step, "epoch": epoch,
                                                            "stages": len(states)}))
        loss, accuracy = await asyncio.get_running_loop().run_in_executor(
            None, evaluator.evaluate, states, self.dataset.x_test, self.dataset.y_test)
        self.log.record("eval", epoch=epoch, step=step, test_loss=loss, test_accuracy=accuracy,
                        checkpoint_bytes=written)
        if self._progress is not None:
            accuracy_text = f", test accuracy {accuracy:.4f}" if accuracy is not None else ""
            self._progress.message(f"epoch {epoch + 1}: test loss {loss:.4f}{accuracy_text}")
        return loss, accuracy

    def _copy_plan(self, target: Path) -> None:
        """The run's plan folder follows re-partitions, so a checkpoint always matches it."""
        if self.plan_dir.resolve() != target.resolve():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.plan_dir / MANIFEST_NAME, target / MANIFEST_NAME)

    def _summary(self, test: tuple[float | None, float | None]) -> RunSummary:
        wall = max(self._train_seconds, 1e-9)
        names = list(self.known.values())
        summary = RunSummary(
            run_dir=str(self.config.out_dir), steps=self.ledger.completed, epochs=self.config.epochs,
            samples=self.ledger.samples, train_seconds=round(self._train_seconds, 3),
            samples_per_s=round(self.ledger.samples / wall, 2), train_loss=self.ledger.last_loss,
            test_loss=test[0], test_accuracy=test[1],
            stage_utilisation=[round(self.ledger.busy_ms.get(n, 0.0) / 1000 / wall, 4) for n in self.names],
            workers=self.names if self.names else names, schedule=self.config.schedule, replans=self.replans)
        self.log.record("summary", **dataclasses.asdict(summary))
        return summary


def _local_address_towards(url: str) -> str:
    """The address of this host on the route to ``url`` (what workers can reach us at)."""
    _, host, port = parse_url(url)
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, port or 5683))
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def train(config: TrainConfig) -> RunSummary:
    """Run a training job to the end (blocking)."""
    return asyncio.run(Coordinator(config).run())


def summary_json(summary: RunSummary) -> dict[str, Any]:
    return dataclasses.asdict(summary)
