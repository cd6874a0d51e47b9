"""The coordinator's ledger of steps: which stage reported what, and when a step is done.

Each stage reports each optimizer step once; when every stage has, the step is complete:
its metrics line is written, the trace gets its spans, and whoever waits on the step
(flow control, evaluation, re-planning) is released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgert.coordinator.runlog import RunLog
from edgert.protocol import StepReport


@dataclass
class StepRecord:
    """A completed step, as metrics.jsonl records it."""

    step: int
    epoch: int
    samples: int
    loss: float | None
    accuracy: float | None
    step_ms: float
    stages: list[dict[str, Any]] = field(default_factory=list)
    placement: int = 0  # which placement (cuts and workers) ran it: times of another one are not comparable


HISTORY = 64  # completed steps kept for re-planning's medians; older ones are on disk only


class StepLedger:
    """Collects step reports; completes steps; keeps the last few for re-planning (memory does not
    grow with the run: metrics.jsonl has every step)."""

    def __init__(self, log: RunLog, on_complete: Callable[[StepRecord], None] | None = None,
                 history: int = HISTORY):
        self.log = log
        self.on_complete = on_complete
        self.stages = 0
        self.names: list[str] = []
        self.failure: str | None = None
        self.completed_through = -1  # the newest completed step (-1: none)
        self.done_through = -1  # the newest step the model has taken: completed, or in a snapshot
        self.members: list[int] = []  # workers holding each stage: a group's members each report
        self._pending: dict[int, dict[int, list[tuple[str, StepReport]]]] = {}  # step -> stage -> (worker, report)
        self._meta: dict[int, tuple[int, int]] = {}  # step -> (epoch, samples)
        self._events: dict[int, asyncio.Event] = {}
        self._last_finish: float | None = None
        self.recent: deque[StepRecord] = deque(maxlen=max(history, 1))
        self.placement = 0
        self.segment_started_s = 0.0

    def configure(self, names: list[str], members: list[int] | None = None) -> None:
        """The workers (by stage: the holders of record) of the steps expected from now on, and how many
        workers hold each stage (``members``; one each when not given): a new placement."""
        self.stages, self.names = len(names), list(names)
        self.members = list(members or [1] * len(names))
        self.placement += 1

    def expect(self, step: int, epoch: int, samples: int) -> None:
        self._pending[step] = {}
        self._meta[step] = (epoch, samples)
        self._events[step] = asyncio.Event()

    def fail(self, message: str) -> None:
        self.failure = message
        for event in self._events.values():
            event.set()

    def add(self, report: StepReport, worker: str) -> None:
        received = self._pending.get(report.step)
        if received is None or not 0 <= report.stage < self.stages:
            return  # a step that is already complete (or forgotten)
        parts = received.setdefault(report.stage, [])
        if any(name == worker for name, _ in parts) or len(parts) >= self.members[report.stage]:
            return  # a retried delivery
        parts.append((worker, report))
        self.log.spans(report.stage, worker, report.spans)
        if all(len(received.get(k, ())) == self.members[k] for k in range(self.stages)):
            self._complete(report.step, {k: merged([r for _, r in parts]) for k, parts in received.items()},
                           {k: parts for k, parts in received.items() if len(parts) > 1})

    async def wait(self, step: int, timeout: float) -> bool:
        """Wait for ``step``; False on timeout. A failure releases every waiter."""
        event = self._events.get(step)
        if event is None:
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def interrupt(self) -> None:
        """Wake every waiter (a worker failed): they look at the coordinator's state and decide."""
        for event in self._events.values():
            event.set()

    @property
    def completed(self) -> int:
        """How many steps the model has taken (steps run in order from 0)."""
        return self.done_through + 1

    def restart(self, names: list[str], after: int, members: list[int] | None = None) -> list[int]:
        """Training goes on from step ``after + 1`` on these workers: later steps are forgotten.

        Steps up to ``after`` that never completed here are in the snapshot's weights (a worker
        copied its state, then died before its batched report went out): they count as done.
        Returns those steps; they have no metrics line.
        """
        vouched = sorted(step for step in self._pending if step <= after)
        self.forget(list(self._pending))
        self.done_through = after
        self.completed_through = min(self.completed_through, after)
        self.recent = deque((r for r in self.recent if r.step <= after), maxlen=self.recent.maxlen)
        self.failure = None
        self.configure(names, members)
        self.reset_timing()
        return vouched

    def forget(self, steps: list[int]) -> None:
        """Steps that will not run (a segment was cut short)."""
        for step in steps:
            self._pending.pop(step, None)
            self._meta.pop(step, None)
            event = self._events.pop(step, None)
            if event is not None:
                event.set()

    def missing(self, step: int) -> list[int]:
        """The stages some of whose workers have not reported ``step``."""
        received = self._pending.get(step, {})
        return [k for k in range(self.stages) if len(received.get(k, ())) < self.members[k]]

    def begin_segment(self) -> float:
        """A segment of steps starts now; returns its start as a ``time_s``. Its steps' lines carry it,
        so the time a segment ran can be read from disk even if the coordinator dies during it."""
        self.segment_started_s = self.log.elapsed()
        return self.segment_started_s

    def reset_timing(self) -> None:
        """After a pause (evaluation, re-plan), the next step's time starts from its own start."""
        self._last_finish = None

    def _complete(self, step: int, reports: dict[int, StepReport],
                  groups: dict[int, list[tuple[str, StepReport]]]) -> None:
        epoch, samples = self._meta.pop(step)
        last = reports[self.stages - 1]
        finished = max(r.finished for r in reports.values())
        started = self._last_finish or min(r.started for r in reports.values())
        self._last_finish = finished
        elapsed = max(finished - started, 1e-9)
        loss = last.loss_sum / last.samples if last.samples else None
        accuracy = last.correct / last.samples if last.correct is not None and last.samples else None
        stages = []
        for k in range(self.stages):
            r = reports[k]
            stages.append({"stage": k, "worker": self.names[k], "forward_ms": round(r.forward_ms, 3),
                           "backward_ms": round(r.backward_ms, 3), "optimizer_ms": round(r.optimizer_ms, 3),
                           "idle_ms": round(r.idle_ms, 3), "transfer_ms": round(r.send_ms, 3),
                           "slowdown_ms": round(r.slowdown_ms, 3)})
            if r.replicated_bytes:  # the steps after which this stage sent its copies
                stages[-1].update(replication_ms=round(r.replication_ms, 3), replicated_bytes=r.replicated_bytes)
            if k in groups:  # a group's stage: its times are the slowest member's; each member's own
                stages[-1]["members"] = [{"worker": worker, "samples": part.samples,
                                          "forward_ms": round(part.forward_ms, 3),
                                          "backward_ms": round(part.backward_ms, 3),
                                          "optimizer_ms": round(part.optimizer_ms, 3),
                                          "idle_ms": round(part.idle_ms, 3)}
                                         for worker, part in sorted(groups[k], key=lambda item: item[0])]
        record = StepRecord(step, epoch, samples, loss, accuracy, elapsed * 1000, stages, self.placement)
        self.completed_through = max(self.completed_through, step)
        self.done_through = max(self.done_through, step)
        self.recent.append(record)
        self.log.record("step", step=step, epoch=epoch, loss=loss, accuracy=accuracy, samples=samples,
                        samples_per_s=round(samples / elapsed, 2), step_ms=round(elapsed * 1000, 3), stages=stages,
                        segment_started_s=self.segment_started_s)
        del self._pending[step]
        self._events.pop(step).set()
        if self.on_complete is not None:
            self.on_complete(record)

    def stage_times_ms(self, last: int) -> list[tuple[float, float, float]]:
        """Median forward, backward and optimizer ms per step of each stage over the last ``last`` steps.

        Only steps of the current placement count; none yet gives an empty list.
        """
        window = self._window(last)
        if not window:
            return []
        return [tuple(statistics.median(r.stages[k][key] for r in window)
                      for key in ("forward_ms", "backward_ms", "optimizer_ms"))
                for k in range(self.stages)]

    def member_times_ms(self, last: int) -> list[dict[str, tuple[float, float, float, float]]]:
        """For each stage held by a group, each member's median forward, backward and optimizer ms per step over
        the last ``last`` steps and its part of the stage's samples (empty for a stage of one worker)."""
        window = self._window(last)
        result: list[dict[str, tuple[float, float, float, float]]] = [{} for _ in range(self.stages)]
        for k in range(self.stages if window else 0):
            parts: dict[str, list[tuple[float, float, float, float]]] = {}
            for record in window:
                members = record.stages[k].get("members", [])
                total = sum(m["samples"] for m in members)
                for m in members:
                    parts.setdefault(m["worker"], []).append((m["forward_ms"], m["backward_ms"], m["optimizer_ms"],
                                                             m["samples"] / total if total else 0.0))
            result[k] = {worker: tuple(statistics.median(v[i] for v in values) for i in range(4))
                         for worker, values in parts.items()}
        return result

    def speed_changed(self, recent: int = 2, factor: float = 1.5, baseline: int = 5) -> bool:
        """Whether some stage's compute in each of the last ``recent`` steps differs from its median
        over the ``baseline`` steps before them by more than ``factor`` (a device changed speed)."""
        window = self._window(recent + baseline)
        if len(window) < recent + baseline:
            return False
        for k in range(self.stages):
            compute = [sum(r.stages[k][key] for key in ("forward_ms", "backward_ms", "optimizer_ms"))
                       for r in window]
            usual = statistics.median(compute[:baseline])
            if usual <= 0:
                continue
            ratios = [c / usual for c in compute[baseline:]]
            if all(r > factor for r in ratios) or all(r < 1 / factor for r in ratios):
                return True
        return False

    def _window(self, last: int) -> list[StepRecord]:
        return [r for r in list(self.recent)[-last:] if r.placement == self.placement]

    def median_step_ms(self, last: int) -> float:
        window = self._window(last)
        return statistics.median(r.step_ms for r in window) if window else 0.0


def merged(reports: list[StepReport]) -> StepReport:
    """One stage's report of a step from its group members' (one report: itself): samples, losses and correct
    answers add up; each time is the slowest member's; started the earliest, finished the latest."""
    if len(reports) == 1:
        return reports[0]
    first = reports[0]
    correct = [r.correct for r in reports if r.correct is not None]
    times = ("forward_ms", "backward_ms", "optimizer_ms", "idle_ms", "send_ms", "slowdown_ms", "replication_ms")
    return dataclasses.replace(
        first, samples=sum(r.samples for r in reports), loss_sum=sum(r.loss_sum for r in reports),
        correct=sum(correct) if correct else None, started=min(r.started for r in reports),
        finished=max(r.finished for r in reports), replicated_bytes=sum(r.replicated_bytes for r in reports),
        **{name: max(getattr(r, name) for r in reports) for name in times})
