"""Running one window of a stage's schedule, action by action (on the worker's compute thread,
edgert.worker.compute_thread).

For each window of work the executor walks its stage's action list (edgert.schedule):
``F`` waits for the micro-batch's inputs, runs the forward and hands the outputs to the
next stage; ``B`` waits for the gradients (or, on the last stage, the labels), runs the
backward and hands the input gradients to the previous stage; ``S`` steps the optimizer.
The last stage's forward is folded into its backward. Under the ``async`` schedule the
weights a micro-batch's forward used are stashed and restored for its backward (PipeDream).
A split backward (``split_backward``, edgert.stage) computes its parameter gradients once, before
the step, over all the step's micro-batches (``W``, timed as backward). With ``side_by_side`` the
forwards run on a second thread beside the backwards
(edgert.worker.forward_lane), on the synchronous schedules and where no forward updates running
statistics (a BatchNorm's forward would read them while a backward writes them).
Everything it does is timed, per step, for the coordinator's metrics and trace. Before it
waits for a tensor it calls ``before_wait`` (the compute thread sends the step reports it has
gathered): what it waits for may be sent only once those reports arrive.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Hashable

import numpy as np

from edgert.groups import StageRouting
from edgert.protocol import StepReport
from edgert.schedule import Computation, Key, MicroBatch, Schedule, Window, stage_actions
from edgert.stage import StageSession
from edgert.transport import Codec
from edgert.worker.errors import InboxAborted, InboxSkipped
from edgert.worker.forward_lane import ForwardLane
from edgert.worker.gate import StepGate
from edgert.worker.group_exchange import GroupExchange
from edgert.worker.inbox import Inbox
from edgert.worker.slowdown import WEIGHT_CALL, SlowdownEmulator, SlowdownSchedule
from edgert.worker.stage_timer import warm_up

Sender = Callable[..., None]  # (key, tensors) and, on a link that carries row pieces, rows=<micro-batch size>
GroupSender = Callable[[int, dict[str, np.ndarray], dict[str, Codec]], None]  # to the group's other members
StepCallback = Callable[[StepReport], None]


class StageExecutor:
    """Walks action lists for one stage, with its inbox and its links to the neighbours."""

    def __init__(self, session: StageSession, stage: int, inbox: Inbox, send_forward: Sender,
                 send_backward: Sender, slowdown: SlowdownSchedule = SlowdownSchedule(),
                 wait_timeout: float | None = None, before_wait: Callable[[], None] | None = None,
                 routing: StageRouting | None = None, send_group: GroupSender | None = None,
                 group_codec: Codec | None = None, side_by_side: bool = False):
        self.session = session
        self.routing = routing or StageRouting(None, 0, None, None)
        self._exchange = GroupExchange(session, self.routing, self._take_key, send_group, group_codec) \
            if self.routing.grouped else None
        self.stage = stage
        self.inbox = inbox
        self._send_forward = send_forward
        self._send_backward = send_backward
        self.slowdown = SlowdownEmulator(slowdown)
        self._warmed: set[int] = set()
        self.wait_timeout = wait_timeout
        self._before_wait = before_wait
        # inputs (and, when stashing, saved activations) of each micro-batch until its backward
        self._held: dict[Key, tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]] = {}
        self._stash: dict[int, np.ndarray] = {}  # weight version -> flat snapshot (async)
        self._stash_version: dict[Key, int] = {}
        self._version = 0
        self.activity = "idle"  # what the compute thread is doing now, for /health
        self.gate = StepGate()
        self._lane = ForwardLane(f"stage{stage}", inbox.interrupt) \
            if side_by_side and not self.is_last and not session.entry.buffer_updates else None
        self._report_lock = threading.Lock()  # the lane's forwards and this thread's backwards share the reports

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.session.entry.is_last

    def run_window(self, window: Window, on_step: StepCallback | None = None) -> list[StepReport]:
        """Execute the window's actions; returns one report per optimizer step, in order.

        ``on_step`` is called with each step's report as soon as its optimizer step is done.
        """
        batches = list(window.microbatches)
        self._warm_up(self._rows(batches[0]))
        actions = stage_actions(window.schedule, self.stage, window.stages, len(batches))
        reports = {step: StepReport(step=step, stage=self.stage, started=time.time()) for step in window.steps}
        last_backward: MicroBatch | None = None
        done = []
        lane = self._lane if window.schedule != Schedule.ASYNC else None
        handed: set[int] = set()  # positions of forwards handed to the lane ahead of their turn
        for position, action in enumerate(actions):
            if position in handed:
                continue
            if action.kind is Computation.STEP:
                step = last_backward.step if window.schedule == Schedule.ASYNC and last_backward else window.steps[-1]
            else:
                step = batches[action.microbatch].step
            self.gate.enter(step, commits=action.kind is not Computation.FORWARD)
            if self._truncated(step):
                continue  # the segment was cut short before this step
            self.activity = f"{action.kind.name.lower()} {step}"  # "forward 12"
            try:
                if action.kind is Computation.FORWARD and lane is not None:
                    self._hand_over(lane, batches[action.microbatch], reports, window)
                elif action.kind is Computation.FORWARD:
                    self._forward(batches[action.microbatch], reports[step], window)
                elif action.kind is Computation.BACKWARD:
                    last_backward = batches[action.microbatch]
                    if lane is not None:
                        # the forwards after this backward need nothing from it: they run beside it
                        for ahead in itertools.takewhile(lambda p: actions[p].kind is Computation.FORWARD,
                                                         range(position + 1, len(actions))):
                            handed.add(ahead)
                            self.gate.enter(batches[actions[ahead].microbatch].step)
                            self._hand_over(lane, batches[actions[ahead].microbatch], reports, window)
                        lane.wait_for(last_backward.key, self._before_wait)
                    self._backward(last_backward, reports[step], window)
                else:
                    self._finish_weights(reports[step], step)
                    if lane is not None:
                        lane.wait_idle(self._before_wait)  # the step changes the weights a forward reads
                    self._combine(window, step, reports[step])
                    self._step(reports[step])
                    done.append(step)
                    if on_step is not None:
                        on_step(reports[step])
            except InboxSkipped:
                self._held.pop(batches[action.microbatch].key, None)
        if lane is not None:
            lane.wait_idle(self._before_wait)
        self.activity = "idle"
        return [reports[step] for step in done]

    def _hand_over(self, lane: ForwardLane, batch: MicroBatch, reports: dict[int, StepReport],
                   window: Window) -> None:
        """``batch``'s forward to the lane (unless a truncation dropped its step)."""
        if not self._truncated(batch.step):
            lane.submit(batch.key, functools.partial(self._forward, batch, reports[batch.step], window, True))

    def _warm_up(self, rows: int) -> None:
        """Before an emulated device first computes micro-batches of ``rows``: learn their warm times."""
        if self.slowdown.schedule.emulates and rows not in self._warmed:
            self._warmed.add(rows)
            self.activity = "warming up"
            warm_up(self.session, rows, self.slowdown)

    def _rows(self, batch: MicroBatch) -> int:
        """How many rows of ``batch`` this worker computes: its share in a group, else all."""
        start, end = self.routing.own(batch.size)
        return end - start

    def _combine(self, window: Window, step: int, report: StepReport) -> None:
        """In a group, before the optimizer step: every member's gradients summed (group_exchange.py)."""
        if self._exchange is None:
            return
        sizes = [m.size for m in window.microbatches if m.step == step]
        rows = [sum(end - start for start, end in (self.routing.group.ranges(size)[j] for size in sizes))
                for j in range(self.routing.group.size)]
        started = self._clock()
        self._exchange.combine(step, rows)
        report.idle_ms += (time.perf_counter() - started[0]) * 1000

    def _truncated(self, step: int) -> bool:
        return self.inbox.last_step is not None and step > self.inbox.last_step

    # -- actions -----------------------------------------------------------------------------

    def _forward(self, batch: MicroBatch, report: StepReport, window: Window, in_lane: bool = False) -> None:
        inputs = self._take_rows("act", "previous", batch, report, in_lane=in_lane)
        kept: dict[str, np.ndarray] | None = {} if self.session.stashing else None
        self._held[batch.key] = (inputs, kept)
        if window.schedule == Schedule.ASYNC and not self.is_last:
            self._stash_weights(batch.key)
        if self.is_last:
            return  # folded into the backward, which recomputes the forward anyway
        started = self._clock()
        outputs = self.session.forward(inputs, kept)
        self._computed(report, "forward_ms", f"F{batch.step}.{batch.index}", started, batch.step,
                       (Computation.FORWARD, self._rows(batch)))
        self._send(self._send_forward, batch.key, outputs, report, self._piece_rows("next", batch))

    def _backward(self, batch: MicroBatch, report: StepReport, window: Window) -> None:
        if batch.key not in self._held:  # its forward, in the lane, met a truncation
            raise InboxSkipped(f"{batch.key} is after a truncation")
        inputs, kept = self._held.pop(batch.key)
        if self.is_last:
            labels = self._take("labels", batch, report)
            gradients = None
        else:
            labels = None
            gradients = self._take_rows("grad", "next", batch, report)
        stashed = self._stashed_version(batch.key) if window.schedule == Schedule.ASYNC and not self.is_last else None
        started = self._clock()
        with self.session.stashed_weights(stashed) if stashed is not None else contextlib.nullcontext():
            # a share's loss is scaled by its rows over the batch: the group's gradients then simply add up
            result = self.session.backward(inputs, output_gradients=gradients, labels=labels,
                                           loss_scale=batch.loss_scale * self._rows(batch) / batch.size, saved=kept)
            if window.schedule == Schedule.ASYNC:
                self.session.finish_weights()  # with the weights its forward read, before the next step
        self._computed(report, "backward_ms", f"B{batch.step}.{batch.index}", started, batch.step,
                       (Computation.BACKWARD, self._rows(batch)))
        if self.is_last:
            self._score(report, self._rows(batch), result.loss, result.prediction, labels)
        if not self.is_first and result.input_gradients:
            self._send(self._send_backward, batch.key, result.input_gradients, report,
                       self._piece_rows("previous", batch))

    def _finish_weights(self, report: StepReport, step: int) -> None:
        """A split backward's parameter gradients, all the step's micro-batches at once (part of its backward)."""
        started = self._clock()
        rows = self.session.finish_weights()
        if rows:
            self._computed(report, "backward_ms", f"W{step}", started, step, (WEIGHT_CALL, rows))

    def _step(self, report: StepReport) -> None:
        started = self._clock()
        self.session.step()
        self._version += 1
        self._computed(report, "optimizer_ms", f"S{report.step}", started, report.step, Computation.STEP)
        report.finished = time.time()

    # -- weight stashing (async) -------------------------------------------------------------

    def _stash_weights(self, key: Key) -> None:
        if self._version not in self._stash:
            self._stash[self._version] = self.session.weights_snapshot()
        self._stash_version[key] = self._version

    def _stashed_version(self, key: Key) -> np.ndarray | None:
        """The weights ``key``'s forward ran with, when the optimizer has stepped since (else None)."""
        version = self._stash_version.pop(key)
        weights = self._stash[version]
        if version not in self._stash_version.values():
            del self._stash[version]
        return None if version == self._version else weights

    # -- bookkeeping -------------------------------------------------------------------------

    def _take_rows(self, kind: str, link: str, batch: MicroBatch, report: StepReport,
                   in_lane: bool = False) -> dict[str, np.ndarray]:
        """``batch``'s tensors from the ``link`` neighbour: whole, or this worker's rows gathered from the row
        pieces its members send (in row order) when either side is a group."""
        if not self.routing.split(link):
            return self._take(kind, batch, report, in_lane=in_lane)
        parts = [self._take(kind, batch, report, row=start, in_lane=in_lane)
                 for _, start, _ in self.routing.pieces(link, batch.size)]
        if len(parts) == 1:
            return parts[0]
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}

    def _piece_rows(self, link: str, batch: MicroBatch) -> dict[str, int]:
        """The sender's keyword for a link that carries row pieces: the whole micro-batch's size."""
        return {"rows": batch.size} if self.routing.split(link) else {}

    def _take_key(self, key: tuple) -> dict[str, np.ndarray]:
        """Wait for ``key`` (a group member's gradients), the step reports sent first."""
        if self._before_wait is not None and not self.inbox.holds(key):
            self._before_wait()
        return self.inbox.take(key, self.wait_timeout)[0]

    def _take(self, kind: str, batch: MicroBatch, report: StepReport, row: int | None = None,
              in_lane: bool = False):
        """Wait for ``batch``'s ``kind`` tensors. The forward lane neither sends the step reports first (this
        thread does, before it waits for the lane) nor counts its wait as the stage's idle time (the backwards
        may be computing meanwhile)."""
        key = (kind, batch.step, batch.index) if row is None else (kind, batch.step, batch.index, row)
        if self._before_wait is not None and not in_lane and not self.inbox.holds(key):
            self._before_wait()
        value, waited = self.inbox.take(key, self.wait_timeout)
        with self._report_lock:
            if waited > 1e-4:
                now = time.time()
                report.spans.append((f"wait {kind}", now - waited, waited))
            if not in_lane:
                report.idle_ms += waited * 1000
        return value

    def _clock(self) -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def _computed(self, report: StepReport, field_name: str, name: str, started: tuple[float, float],
                  step: int, call: Hashable) -> None:
        elapsed = time.perf_counter() - started[0]
        cpu = time.thread_time() - started[1] if self.session.single_threaded else None
        slept = self.slowdown.emulate(step, call, elapsed, cpu)
        total = elapsed + slept
        with self._report_lock:
            setattr(report, field_name, getattr(report, field_name) + total * 1000)
            report.slowdown_ms += slept * 1000
            report.spans.append((name, time.time() - total, total))

    def _send(self, sender: Sender, key: Key, tensors: dict[str, np.ndarray], report: StepReport,
              pieces: dict[str, int]) -> None:
        started = time.perf_counter()
        sender(key, tensors, **pieces)
        with self._report_lock:
            report.send_ms += (time.perf_counter() - started) * 1000

    @staticmethod
    def _score(report: StepReport, rows: int, loss: float | None, prediction, labels) -> None:
        report.samples += rows
        report.loss_sum += (loss or 0.0) * rows
        label = next(iter(labels.values()))
        if prediction is not None and np.issubdtype(label.dtype, np.integer) and prediction.ndim == label.ndim + 1:
            report.correct = (report.correct or 0) + int(np.sum(prediction.argmax(-1) == label))

    def reset(self) -> None:
        """Forget held inputs, stashed weights and the unfinished step's gradients (after a failure or a re-plan)."""
        if self._lane is not None:
            self.inbox.interrupt(InboxAborted("the window was abandoned"))  # a forward waiting for its input ends
            self._lane.reset()
            self.inbox.resume()
        self._held.clear()
        self._stash.clear()
        self._stash_version.clear()
        self.session.zero_grad()

    def close(self) -> None:
        """The stage is replaced: the forward lane's thread ends."""
        if self._lane is not None:
            self._lane.close()
