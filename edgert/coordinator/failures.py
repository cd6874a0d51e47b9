"""Noticing that workers failed: by their health, by a step long overdue, by a send that failed.

- :class:`FailureWatch` observes every worker's ``/health`` (RFC 7641): a worker that
  dies closes its connection and the observation fails at once; it is then probed, and
  only a worker that does not answer is declared failed. A *slow* worker still answers,
  so it is never mistaken for a dead one.
- :class:`FailureDetector` keeps the workers that failed until a recovery is done with them,
  and waits for each step with a deadline of a few median steps, probing the workers when
  it passes. What is done about a failure is edgert/coordinator/recovery.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from edgert.coordinator.errors import TrainingError, WorkerFailure
from edgert.coordinator.ledger import StepLedger
from edgert.coordinator.run_state import RunState
from edgert.coordinator.runlog import RunLog
from edgert.protocol import HEALTH, Health
from edgert.transport import TensorClient, TransportError

log = logging.getLogger("edgert.coordinator.failures")
MIN_DEADLINE_S = 1.0
DEADLINE_FACTOR = 4.0  # a step slower than this many median steps makes the coordinator probe the workers
PROBE_TIMEOUT_S = 1.0  # each of a probe's two health requests


async def health_of(client: TensorClient, url: str, timeout: float = PROBE_TIMEOUT_S, retries: int = 0) -> Health:
    """A worker's ``GET /health``, read; raises TransportError or OSError (no answer), EdgertError (a bad one)."""
    return Health.from_envelope((await client.get(url, HEALTH, timeout=timeout, retries=retries)).envelope())


async def answers(client: TensorClient, url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``url`` answers a health request in time (two tries)."""
    try:
        await client.get(url, HEALTH, timeout=timeout, retries=1)
        return True
    except (TransportError, OSError):
        return False


async def dead_among(client: TensorClient, urls: list[str], timeout: float = PROBE_TIMEOUT_S) -> set[str]:
    """Those of ``urls`` that do not answer a probe (all probed at once)."""
    results = await asyncio.gather(*(answers(client, url, timeout) for url in urls))
    return {url for url, alive in zip(urls, results) if not alive}


class FailureWatch:
    """Observes workers' health; calls ``on_failure`` with the URLs that stopped answering."""

    def __init__(self, client: TensorClient, on_failure: Callable[[set[str], float], None]):
        self.client = client
        self.on_failure = on_failure
        self._tasks: dict[str, asyncio.Task] = {}

    def watch(self, urls: list[str]) -> None:
        """Observe these workers too (one already watched is left as it is)."""
        for url in urls:
            if url not in self._tasks:
                self._tasks[url] = asyncio.create_task(self._watch(url))

    def forget(self, urls: set[str]) -> None:
        """Observe these workers no more."""
        for url in urls:
            task = self._tasks.pop(url, None)
            if task is not None:
                task.cancel()

    async def _watch(self, url: str) -> None:
        """Observe ``url`` until it fails a probe after its observation broke, then report it (once)."""
        while True:
            try:
                async for _ in self.client.observe(url, HEALTH, timeout=5.0):
                    pass
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - any broken observation is a reason to probe
                log.debug("observation of %s ended: %s", url, error)
            noticed = time.monotonic()
            if not await answers(self.client, url):
                self.on_failure({url}, noticed)
                return
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()


class FailureDetector:
    """The workers that failed and are not yet recovered from, each with when it was noticed.

    Owns the :class:`FailureWatch` on every known worker (from :meth:`start_watching` on); a
    failure interrupts whoever waits on the ``ledger``, and :meth:`wait_step` raises it.
    """

    def __init__(self, state: RunState, client: TensorClient, ledger: StepLedger, log: RunLog,
                 step_timeout: float):
        self._state = state
        self._client = client
        self._ledger = ledger
        self._log = log
        self._step_timeout = step_timeout
        self._failed: dict[str, float] = {}  # failed worker URL -> when it was noticed (monotonic), until recovered
        self._watch: FailureWatch | None = None

    def start_watching(self) -> None:
        """Watch every known worker from now on (training starts)."""
        self._watch = FailureWatch(self._client, self.notice)
        self._watch.watch(list(self._state.known))

    def watch(self, url: str) -> None:
        """Watch a worker that joined, if the watch has started (else it starts with the others)."""
        if self._watch is not None:
            self._watch.watch([url])

    async def close(self) -> None:
        if self._watch is not None:
            await self._watch.close()

    def notice(self, urls: set[str], noticed: float) -> None:
        """Workers stopped answering (noticed at ``noticed``, monotonic); those not known already fail."""
        fresh = (urls & set(self._state.known)) - set(self._failed)
        if not fresh:
            return
        self._failed.update(dict.fromkeys(fresh, noticed))
        self._ledger.interrupt()

    def failure(self) -> WorkerFailure:
        """The failures not yet recovered from, noticed when the first of them was (one noticed during
        a recovery counts from its own notice, not from the failure that recovery was for)."""
        return WorkerFailure(set(self._failed), min(self._failed.values()))

    def recovering(self, urls: set[str]) -> None:
        """A recovery without ``urls`` begins: they are watched no more."""
        if self._watch is not None:
            self._watch.forget(urls)

    def recovered(self, urls: set[str]) -> None:
        """A recovery from the failure of ``urls`` is done; a worker that failed meanwhile is still failed."""
        for url in urls:
            self._failed.pop(url, None)

    async def as_failure(self, error: Exception) -> WorkerFailure:
        """A worker failure behind ``error`` (a send or an assignment that failed), or the error itself."""
        if isinstance(error, WorkerFailure):
            return error
        dead = await dead_among(self._client, list(self._state.known))
        if not dead:
            raise TrainingError(str(error)) from None
        self.notice(dead, time.monotonic())
        return self.failure()

    async def wait_step(self, step: int) -> None:
        """Wait until ``step`` completed; a failed worker raises :class:`WorkerFailure`, a failed stage or
        a step without reports for ``step_timeout`` raises :class:`~edgert.errors.TrainingError`."""
        waited = 0.0
        while True:
            deadline = self._deadline()
            finished = await self._ledger.wait(step, deadline)
            if self._failed:
                raise self.failure()
            if self._ledger.failure or not finished:
                await self._probe()
            if finished:
                return
            waited += deadline
            if waited >= self._step_timeout:
                names = ", ".join(f"stage {k} ({self._state.names[k]})" for k in self._ledger.missing(step))
                raise TrainingError(f"step {step}: no report from {names} within {self._step_timeout:.0f} s")
            self._log.event("slow_step", step=step, waited_s=round(waited, 2))

    def _deadline(self) -> float:
        """How long a step may take before the workers are probed: a few median steps."""
        median = self._ledger.median_step_ms(10) / 1000
        if median <= 0:
            return self._step_timeout
        return min(max(DEADLINE_FACTOR * median, MIN_DEADLINE_S), self._step_timeout)

    async def _probe(self) -> None:
        """A step is late or a stage failed: a worker that does not answer has failed, else the stage's failure
        ends the run."""
        dead = await dead_among(self._client, self._state.placed())
        if dead:
            self.notice(dead, time.monotonic())
            raise self.failure()
        if self._ledger.failure:
            raise TrainingError(self._ledger.failure)
