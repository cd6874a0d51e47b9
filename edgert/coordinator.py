"""``edgert train``: the central node. Assigns stages, streams data, collects and records.

The coordinator never carries activations or gradients: it sends each worker its stage,
tells every worker which micro-batches to run under which schedule (``/window``), posts
inputs to the first stage and labels to the last, and receives one report per stage per
optimizer step on its own ``/report`` resource. At each epoch's end it fetches every
stage's state, keeps it as the checkpoint, and evaluates it on the test set.
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

from edgert.data import Batch, batches, load_training_data
from edgert.errors import EdgertError
from edgert.evaluation import Evaluator
from edgert.executor import StepReport
from edgert.manifest import MANIFEST_NAME, RUNTIME_ROLES, Manifest, load_manifest
from edgert.progress import Progress
from edgert.protocol import (
    BATCH,
    HEALTH,
    REPORT,
    RUN,
    STAGE,
    STOP,
    WEIGHTS,
    Health,
    Peers,
    Segment,
    StageAssignment,
    reports_from_envelope,
)
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


class Coordinator:
    """Runs one training job over a set of workers."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self._check_config()
        self.manifest: Manifest = load_manifest(config.plan_dir)
        if len(config.workers) != len(self.manifest.stages):
            raise TrainingError(f"the plan has {len(self.manifest.stages)} stages but {len(config.workers)} "
                                f"worker(s) were given; give one --workers URL per stage")
        self.stages = len(self.manifest.stages)
        self.run_id = config.out_dir.name or "run"
        self.dataset = load_training_data(config.data, self.manifest, config.seed)
        self.client = TensorClient(ClientConfig(timeout=30.0, retries=2, connect_timeout=config.connect_timeout))
        self.server = TensorServer(config.listen)
        self.server.add_resource(REPORT, post=self._on_report, rt="edgert.report", kinds=("report",))
        self.log: RunLog | None = None
        self.worker_names: list[str] = []
        self._reports: dict[int, dict[int, StepReport]] = {}
        self._done: dict[int, asyncio.Event] = {}
        self._failure: str | None = None
        self._last_completion: float | None = None
        self._step_meta: dict[int, Batch] = {}
        self._busy_ms = [0.0] * self.stages
        self._train_seconds = 0.0
        self._samples = 0
        self._steps_done = 0
        self._last_loss: float | None = None
        self._progress: Progress | None = None

    def _check_config(self) -> None:
        config = self.config
        if config.schedule not in SCHEDULES:
            raise TrainingError(f"unknown schedule {config.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        for name in ("epochs", "batch_size", "micro_batches", "lookahead"):
            if getattr(config, name) < 1:
                raise TrainingError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(config, name)})")
        if config.steps is not None and config.steps < 1:
            raise TrainingError(f"--steps must be at least 1 (got {config.steps})")
        if config.micro_batches > config.batch_size:
            raise TrainingError(f"--micro-batches {config.micro_batches} exceeds --batch-size {config.batch_size}")

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> RunSummary:
        """Connect, assign, train, evaluate; always releases the workers."""
        self.log = RunLog(self.config.out_dir)
        try:
            await self.server.start()
            await self._connect_workers()
            self._write_run_files()
            await self._assign_stages()
            evaluator = Evaluator(self.config.plan_dir, self.manifest)
            test = await self._train(evaluator)
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
        self.worker_names = [h.name for h in healths]
        log.info("workers: %s", ", ".join(f"{n} ({u})" for n, u in zip(self.worker_names, self.config.workers)))

    def _write_run_files(self) -> None:
        plan_copy = self.config.out_dir / "plan"
        if plan_copy.resolve() != self.config.plan_dir.resolve():
            plan_copy.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.config.plan_dir / MANIFEST_NAME, plan_copy / MANIFEST_NAME)
            source = self.config.plan_dir / "source.onnx"
            if source.is_file():
                shutil.copyfile(source, plan_copy / "source.onnx")
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self.config).items()}
        self.log.write_json("run.json", {"run_id": self.run_id, "config": config, "workers": self.worker_names,
                                         "plan": str(self.config.plan_dir.resolve()), "stages": self.stages})

    async def _assign_stages(self) -> None:
        coordinator_url = self._advertised_url()
        training = self.manifest.training
        if self.config.learning_rate is not None:
            training = dataclasses.replace(training, learning_rate=self.config.learning_rate)
        urls = self.config.workers

        async def assign(k: int) -> None:
            entry = self.manifest.stages[k]
            peers = Peers(previous=urls[k - 1] if k > 0 else None, next=urls[k + 1] if k + 1 < self.stages else None,
                          coordinator=coordinator_url)
            assignment = StageAssignment(
                run_id=self.run_id, entry=entry, training=training, stages=self.stages, peers=peers,
                forward_codec=self.config.forward_codec, backward_codec=self.config.backward_codec,
                forward_threads=self.config.forward_threads, backward_threads=self.config.backward_threads,
                wait_timeout=self.config.step_timeout)
            files = {a.role: (self.config.plan_dir / a.path).read_bytes() for a in entry.artifacts
                     if a.role in RUNTIME_ROLES}
            try:
                await self.client.request("PUT", urls[k], STAGE, assignment.to_envelope(files), timeout=120.0)
            except TransportError as error:
                raise TrainingError(f"worker {self.worker_names[k]} ({urls[k]}) refused stage {k}: {error}") from None

        started = time.perf_counter()
        await asyncio.gather(*(assign(k) for k in range(self.stages)))
        self.log.event("stages_assigned", seconds=round(time.perf_counter() - started, 3), workers=self.worker_names)

    def _advertised_url(self) -> str:
        scheme, _, port = parse_url(self.server.urls[0])
        host = self.config.advertise or _local_address_towards(self.config.workers[0])
        return f"{scheme}://{host}:{port}"

    async def _release_workers(self) -> None:
        async def stop(url: str) -> None:
            try:
                await self.client.post(url, STOP, b"run finished", timeout=2.0, retries=0)
            except (TransportError, OSError):
                pass

        if self.worker_names:
            await asyncio.gather(*(stop(url) for url in self.config.workers))

    # -- training ----------------------------------------------------------------------------

    async def _train(self, evaluator: Evaluator) -> tuple[float | None, float | None]:
        config = self.config
        plan = list(batches(len(self.dataset.x_train), config.batch_size, config.epochs, config.seed, config.steps))
        if not plan:
            raise TrainingError("no training step to run: the data set is smaller than one batch")
        self._progress = Progress(len(plan), enabled=config.progress)
        test: tuple[float | None, float | None] = (None, None)
        by_epoch: dict[int, list[Batch]] = {}
        for batch in plan:
            by_epoch.setdefault(batch.epoch, []).append(batch)
        for epoch, epoch_batches in by_epoch.items():
            started = time.perf_counter()
            await self._run_segment(epoch_batches)
            self._train_seconds += time.perf_counter() - started
            test = await self._evaluate(evaluator, epoch, epoch_batches[-1].step)
        return test

    async def _run_segment(self, plan: list[Batch]) -> None:
        """Tell every worker to run these steps, then feed them, ``lookahead`` steps ahead."""
        config = self.config
        segment = Segment(config.schedule, self.stages, plan[0].step, len(plan), config.batch_size,
                          config.micro_batches)
        for batch in plan:
            self._expect(batch)
        envelope = segment.to_envelope(self.run_id)
        await asyncio.gather(*(self.client.send(url, RUN, envelope) for url in config.workers))
        ahead = config.lookahead + (self.stages if config.schedule == "async" else 0)
        in_flight: deque[int] = deque()
        for batch in plan:
            while len(in_flight) >= ahead:
                await self._wait_step(in_flight.popleft())
            await self._send_batch(batch)
            in_flight.append(batch.step)
        for step in in_flight:
            await self._wait_step(step)

    def _expect(self, batch: Batch) -> None:
        self._step_meta[batch.step] = batch
        self._reports[batch.step] = {}
        self._done[batch.step] = asyncio.Event()

    async def _send_batch(self, batch: Batch) -> None:
        """The step's inputs to the first stage and labels to the last: one message each (one in all)."""
        inputs = {self.manifest.model_input[0].name: np.ascontiguousarray(self.dataset.x_train[batch.indices])}
        labels = {self.manifest.labels[0].name: np.ascontiguousarray(self.dataset.y_train[batch.indices])}
        first, last = self.config.workers[0], self.config.workers[-1]
        messages = [(first, inputs), (last, labels)] if self.stages > 1 else [(first, {**inputs, **labels})]
        await asyncio.gather(*(self.client.send(url, BATCH, Envelope(kind="batch", run_id=self.run_id,
                                                                     step=batch.step, tensors=tensors))
                               for url, tensors in messages))

    async def _wait_step(self, step: int) -> None:
        event = self._done.get(step)
        if event is None:  # already complete
            return
        try:
            await asyncio.wait_for(event.wait(), self.config.step_timeout)
        except TimeoutError:
            missing = [k for k in range(self.stages) if k not in self._reports.get(step, {})]
            names = ", ".join(f"stage {k} ({self.worker_names[k]})" for k in missing)
            timeout = self.config.step_timeout
            raise TrainingError(f"step {step}: no report from {names} within {timeout:.0f} s") from None
        if self._failure:
            raise TrainingError(self._failure)

    async def _on_report(self, request: Request) -> None:
        envelope = request.envelope
        if envelope.run_id != self.run_id:
            return
        if "failed" in envelope.meta:
            self._failure = (f"stage {envelope.stage} ({envelope.meta.get('worker', '?')}) failed: "
                             f"{envelope.meta['failed']}")
            for event in self._done.values():
                event.set()
            return
        reports, worker = reports_from_envelope(envelope)
        for report in reports:
            received = self._reports.get(report.step)
            if received is None or report.stage in received:
                continue  # a retried delivery, or a step that is already complete
            received[report.stage] = report
            self.log.spans(report.stage, worker, report.spans)
            if len(received) == self.stages:
                self._step_complete(report.step, received)

    def _step_complete(self, step: int, reports: dict[int, StepReport]) -> None:
        batch = self._step_meta.pop(step)
        last = reports[self.stages - 1]
        finished = max(r.finished for r in reports.values())
        started = self._last_completion or min(r.started for r in reports.values())
        elapsed = max(finished - started, 1e-9)
        self._last_completion = finished
        loss = last.loss_sum / last.samples if last.samples else None
        accuracy = last.correct / last.samples if last.correct is not None and last.samples else None
        self._samples += len(batch.indices)
        self._last_loss = loss
        stages = []
        for k in range(self.stages):
            r = reports[k]
            self._busy_ms[k] += r.compute_ms
            stages.append({"stage": k, "worker": self.worker_names[k], "forward_ms": round(r.forward_ms, 3),
                           "backward_ms": round(r.backward_ms, 3), "optimizer_ms": round(r.optimizer_ms, 3),
                           "idle_ms": round(r.idle_ms, 3), "transfer_ms": round(r.send_ms, 3),
                           "slowdown_ms": round(r.slowdown_ms, 3)})
        samples_per_s = len(batch.indices) / elapsed
        self.log.record("step", step=step, epoch=batch.epoch, loss=loss, accuracy=accuracy,
                        samples=len(batch.indices), samples_per_s=round(samples_per_s, 2),
                        step_ms=round(elapsed * 1000, 3), stages=stages)
        if self._progress is not None:
            self._progress.update(step + 1, epoch=batch.epoch + 1, loss=loss, acc=accuracy,
                                  **{"samples/s": round(samples_per_s, 1)})
        del self._reports[step]
        self._steps_done += 1
        self._done.pop(step).set()

    # -- evaluation and checkpoints ----------------------------------------------------------

    async def _fetch_states(self) -> list[StageState]:
        async def fetch(url: str) -> StageState:
            return StageState.from_envelope(await self.client.fetch(url, WEIGHTS, timeout=60.0))

        return list(await asyncio.gather(*(fetch(url) for url in self.config.workers)))

    async def _evaluate(self, evaluator: Evaluator, epoch: int, step: int) -> tuple[float | None, float | None]:
        states = await self._fetch_states()
        folder = self.config.out_dir / "checkpoints" / "latest"
        written = sum(save_state(state, folder / f"stage{k}.cbor", self.run_id) for k, state in enumerate(states))
        (folder / "checkpoint.json").write_text(json.dumps({"step": step, "epoch": epoch, "stages": self.stages}))
        loss, accuracy = await asyncio.get_running_loop().run_in_executor(
            None, evaluator.evaluate, states, self.dataset.x_test, self.dataset.y_test)
        self.log.record("eval", epoch=epoch, step=step, test_loss=loss, test_accuracy=accuracy,
                        checkpoint_bytes=written)
        if self._progress is not None:
            accuracy_text = f", test accuracy {accuracy:.4f}" if accuracy is not None else ""
            self._progress.message(f"epoch {epoch + 1}: test loss {loss:.4f}{accuracy_text}")
        return loss, accuracy

    def _summary(self, test: tuple[float | None, float | None]) -> RunSummary:
        wall = max(self._train_seconds, 1e-9)
        summary = RunSummary(
            run_dir=str(self.config.out_dir), steps=self._steps_done,
            epochs=self.config.epochs, samples=self._samples, train_seconds=round(self._train_seconds, 3),
            samples_per_s=round(self._samples / wall, 2), train_loss=self._last_loss, test_loss=test[0],
            test_accuracy=test[1], stage_utilisation=[round(b / 1000 / wall, 4) for b in self._busy_ms],
            workers=self.worker_names, schedule=self.config.schedule)
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
