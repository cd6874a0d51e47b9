"""The worker's compute thread: runs the windows of the segments it is given, one after another.

Each window is walked by the stage's executor (edgert.worker.executor), which blocks only on
the inbox. After every step the stage's state may be replicated and the step's report is
gathered; reports go to the coordinator together, at most every :data:`REPORT_INTERVAL` and
before any wait. Tensors for the neighbours and reports leave through the outbox, never
waited for here. A window that fails is reported (the coordinator recovers); one abandoned
because the run was stopped is not.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from edgert.errors import EdgertError
from edgert.protocol import (
    ACT,
    DATA_KINDS,
    GRAD,
    GROUP_GRAD,
    GROUP_GRAD_KIND,
    REPORT,
    Segment,
    StepReport,
    failure_envelope,
    reports_to_envelope,
)
from edgert.schedule import Key, Window
from edgert.transport import Codec, Envelope, get_codec
from edgert.worker.current_stage import CurrentStage
from edgert.worker.errors import InboxAborted
from edgert.worker.outbox import Outbox

log = logging.getLogger("edgert.worker.compute_thread")
REPORT_INTERVAL = 0.02  # seconds: step reports are sent together at most this often, and before any wait


class ComputeThread:
    """The thread that trains the current stage, the windows queued for it, and its step reports."""

    def __init__(self, current: CurrentStage, outbox: Outbox, name: str, after_step: Callable[[StepReport], None]):
        self._current = current
        self._outbox = outbox
        self._name = name
        self._after_step = after_step  # the stage's replication, before the step is reported
        self._windows: queue.Queue[tuple[Window, bool] | None] = queue.Queue()  # None: the thread ends
        self._idle = threading.Event()  # the thread waits for work (no window running)
        self._unsent_reports: list[StepReport] = []
        self._last_report = 0.0
        self._codecs: dict[str, Codec] = {}
        self._piece_codecs: dict[tuple[str, str], Codec] = {}  # (path, receiver) -> its own copy of the link's codec
        self._thread: threading.Thread | None = None

    # -- driven from the transport loop ------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="edgert-compute", daemon=True)
        self._thread.start()

    def new_stage(self, codecs: dict[str, Codec]) -> None:
        """A stage was installed: its tensors go out with ``codecs`` ("forward": its outgoing link's activations,
        "backward": its incoming link's gradients); no report is left of the previous one."""
        self._unsent_reports = []
        self._codecs = codecs
        self._piece_codecs = {}

    def queue_segment(self, segment: Segment) -> None:
        """Run ``segment``'s windows after those already queued."""
        windows = segment.windows()
        for k, window in enumerate(windows):
            self._windows.put((window, k == len(windows) - 1))

    def truncate(self, last_step: int) -> None:
        """Drop the queued windows that begin after ``last_step``."""
        kept = []
        while not self._windows.empty():
            item = self._windows.get_nowait()
            if item is not None and min(item[0].steps) <= last_step:
                kept.append(item)
        for item in kept:
            self._windows.put(item)

    def drop_windows(self) -> None:
        """Forget every queued window (the run was stopped)."""
        while not self._windows.empty():
            self._windows.get_nowait()

    async def until_idle(self, timeout: float = 30.0) -> None:
        """Wait until the thread has left its window (it was told to stop)."""
        deadline = time.monotonic() + timeout
        while not self._idle.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def stop(self, timeout: float = 10.0) -> None:
        """End the thread once its window is over (the run was stopped first), waiting at most ``timeout``."""
        self._windows.put(None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # -- on the compute thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._idle.set()
            try:  # waiting for a window flushes reports, which may raise an earlier send's failure
                item = self._next_window()
                self._idle.clear()
                if item is None:
                    return
                self._run_window(*item)
            except Exception as error:  # noqa: BLE001 - reported to the coordinator, not swallowed
                self._abandon_window(error)

    def _next_window(self) -> tuple[Window, bool] | None:
        """The next window; the step reports gathered so far go out before waiting for one."""
        try:
            return self._windows.get_nowait()
        except queue.Empty:
            self.flush_reports()
            return self._windows.get()

    def _run_window(self, window: Window, ends_segment: bool) -> None:
        self._current.executor.run_window(window, on_step=self._step_done)
        if ends_segment:
            self.flush_reports()
        if self._windows.empty():
            self._current.health.state = "loaded"

    def _abandon_window(self, error: Exception) -> None:
        """A window ended in ``error``: the stage failed, unless the run was stopped or the worker is stopping."""
        self._unsent_reports.clear()
        self._current.executor.reset()
        if isinstance(error, InboxAborted) or self._outbox.closed:
            log.info("%s: window abandoned: %s", self._name, error)
        else:
            self._fail_stage(error)

    def _fail_stage(self, error: Exception) -> None:
        """Tell the coordinator this stage failed (it recovers); sends still in flight are history now."""
        log.exception("%s: stage failed", self._name)
        health, assignment = self._current.health, self._current.assignment
        health.state, health.detail = "failed", f"{type(error).__name__}: {error}"
        self._outbox.new_generation()  # their failures, like the one that failed the stage, raise no more
        self._report(failure_envelope(assignment.run_id, assignment.entry.index, self._name, health.detail))

    def _step_done(self, report: StepReport) -> None:
        self._current.health.step = report.step
        self._after_step(report)
        self._unsent_reports.append(report)
        if time.monotonic() - self._last_report >= REPORT_INTERVAL:
            self.flush_reports()

    def flush_reports(self) -> None:
        """Send the step reports gathered so far (the executor calls this before it waits)."""
        if self._unsent_reports:
            assignment = self._current.assignment
            self._report(reports_to_envelope(assignment.run_id, assignment.entry.index, self._name,
                                             self._unsent_reports))
            self._unsent_reports = []
        self._last_report = time.monotonic()

    def _report(self, envelope: Envelope) -> None:
        self._outbox.submit(self._current.assignment.peers.coordinator, REPORT, envelope, None, must_arrive=False)

    def send_forward(self, key: Key, tensors: dict[str, np.ndarray], rows: int | None = None) -> None:
        """Send a micro-batch's activations to the next stage (the executor's forward output); with ``rows``
        (the micro-batch's size) each row piece goes to the next stage's member that owns those rows."""
        if rows is not None:
            self._send_pieces("next", ACT, key, tensors, rows, +1, self._codecs["forward"])
            return
        self._send_data(self._current.assignment.peers.next, ACT, key, tensors, +1, self._codecs["forward"])

    def send_backward(self, key: Key, tensors: dict[str, np.ndarray], rows: int | None = None) -> None:
        """Send a micro-batch's gradients to the previous stage (the executor's backward output); with ``rows``,
        by row piece to the previous stage's members, as :meth:`send_forward`."""
        if rows is not None:
            self._send_pieces("previous", GRAD, key, tensors, rows, -1, self._codecs["backward"])
            return
        self._send_data(self._current.assignment.peers.previous, GRAD, key, tensors, -1, self._codecs["backward"])

    def send_group(self, step: int, tensors: dict[str, np.ndarray], codecs: dict[str, Codec]) -> None:
        """Send this member's gradients of ``step`` to the other members of its group, each tensor in its codec
        (``codecs``: by name; the others raw)."""
        assignment = self._current.assignment
        envelope = Envelope(kind=GROUP_GRAD_KIND, run_id=assignment.run_id, step=step, stage=assignment.entry.index,
                            tensors=tensors, meta={"member": assignment.member})
        for j, url in enumerate(assignment.group.members):
            if j != assignment.member:
                self._outbox.submit(url, GROUP_GRAD, envelope, codecs)

    def _send_pieces(self, link: str, path: str, key: Key, tensors: dict[str, np.ndarray], rows: int, direction: int,
                     codec: Codec) -> None:
        """Each neighbour member its rows of this worker's part of the micro-batch, with ``meta.row``: the
        piece's first row in the micro-batch."""
        assignment = self._current.assignment
        routing = assignment.routing
        first = routing.own(rows)[0]
        for url, start, end in routing.pieces(link, rows):
            piece = {name: np.ascontiguousarray(value[start - first:end - first]) for name, value in tensors.items()}
            envelope = Envelope(kind=DATA_KINDS[path], run_id=assignment.run_id, step=key[0], microbatch=key[1],
                                stage=assignment.entry.index + direction, tensors=piece, meta={"row": start})
            # each receiver gets its own copy of a stateful codec (topk's error feedback belongs to its rows)
            receiver_codec = self._piece_codecs.setdefault((path, url), get_codec(codec.spec))
            self._outbox.submit(url, path, envelope, receiver_codec)

    def _send_data(self, url: str | None, path: str, key: Key, tensors: dict[str, np.ndarray], direction: int,
                   codec: Codec) -> None:
        assignment = self._current.assignment
        if url is None:
            raise EdgertError(f"stage {assignment.entry.index} has no peer to send {path} to")
        envelope = Envelope(kind=DATA_KINDS[path], run_id=assignment.run_id, step=key[0], microbatch=key[1],
                            stage=assignment.entry.index + direction, tensors=tensors)
        self._outbox.submit(url, path, envelope, codec)
