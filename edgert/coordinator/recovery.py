"""The coordinator's fault tolerance: central copies, failure handling, pipeline replay.

On a failure the survivors stop, the newest consistent snapshot is found (every parameter
has a copy after the same step: a worker's own snapshot, a neighbour's replica, or the
coordinator's), the planner cuts the model for the survivors, every survivor takes its new
stage and pulls its state as of that step from the nearest holder, and the steps since
the snapshot are replayed with the same samples: none skipped, none applied twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from edgert.coordinator.assignment import assign
from edgert.coordinator.errors import TrainingError, WorkerFailure
from edgert.coordinator.evaluator import Evaluator
from edgert.coordinator.failures import COORDINATOR, dead_among, gather_holdings, newest_snapshot, sources_for
from edgert.coordinator.inputs import central_copy_origin, read_copy_query
from edgert.errors import EdgertError, ReplicaStoreFull
from edgert.manifest import MANIFEST_NAME, Manifest
from edgert.protocol import STOP
from edgert.transport import BadRequest, Envelope, Request, TooLarge, TransportError
from edgert.weights import StageState

MIN_DEADLINE_S = 1.0
DEADLINE_FACTOR = 4.0  # a step slower than this many median steps makes the coordinator probe the workers


class RecoveryMixin:
    """Mixin of :class:`edgert.coordinator.coordinator.Coordinator`."""

    # -- copies held by the coordinator ---------------------------------------------------------

    async def _on_replica(self, request: Request) -> None:
        """A worker's copy of its stage (edgert/coordinator/inputs.py says which are refused)."""
        origin = central_copy_origin(request, self.run_id, self.names, self._announced_through, self.central.store)
        state = StageState.from_envelope(request.envelope)
        manifest_text = json.dumps(self.manifest.to_json())
        try:
            complete = self.central.put(state, origin, len(self.manifest.stages), manifest_text,
                                        str(self.plan_dir.resolve()))
        except ReplicaStoreFull as error:
            raise TooLarge(str(error)) from None
        if complete:
            self.log.event("central_snapshot", step=state.step, stages=len(self.manifest.stages))
            self._snapshot_complete(state.step)

    async def _on_weights_fetch(self, request: Request) -> Envelope:
        """Copies as of a step, for workers taking over blocks during a recovery."""
        query = read_copy_query(request.envelope, self.run_id)
        try:
            return self.central.store.get(query.copy_step, list(query.names)).to_envelope(self.run_id)
        except EdgertError as error:
            raise BadRequest(str(error)) from None

    # -- noticing failures ----------------------------------------------------------------------

    def _on_worker_failure(self, urls: set[str], noticed: float) -> None:
        fresh = (urls & set(self.known)) - set(self._failed)
        if not fresh:
            return
        self._failed.update(dict.fromkeys(fresh, noticed))
        self.ledger.interrupt()

    def _failure(self) -> WorkerFailure:
        """The failures not yet recovered from, noticed when the first of them was (one noticed during
        a recovery counts from its own notice, not from the failure that recovery was for)."""
        return WorkerFailure(set(self._failed), min(self._failed.values()))

    def _deadline(self) -> float:
        """How long a step may take before the workers are probed: a few median steps."""
        median = self.ledger.median_step_ms(10) / 1000
        if median <= 0:
            return self.config.step_timeout
        return min(max(DEADLINE_FACTOR * median, MIN_DEADLINE_S), self.config.step_timeout)

    async def _wait_step(self, step: int) -> None:
        waited = 0.0
        while True:
            deadline = self._deadline()
            finished = await self.ledger.wait(step, deadline)
            if self._failed:
                raise self._failure()
            if self.ledger.failure or not finished:
                dead = await dead_among(self.client, self.order)
                if dead:
                    self._on_worker_failure(dead, time.monotonic())
                    raise self._failure()
                if self.ledger.failure:
                    raise TrainingError(self.ledger.failure)
            if finished:
                return
            waited += deadline
            if waited >= self.config.step_timeout:
                names = ", ".join(f"stage {k} ({self.names[k]})" for k in self.ledger.missing(step))
                raise TrainingError(f"step {step}: no report from {names} within "
                                           f"{self.config.step_timeout:.0f} s")
            self.log.event("slow_step", step=step, waited_s=round(waited, 2))

    # -- recovering -----------------------------------------------------------------------------

    async def _as_failure(self, error: Exception) -> WorkerFailure:
        """A worker failure behind ``error`` (a send or an assignment that failed), or the error itself."""
        if isinstance(error, WorkerFailure):
            return error
        dead = await dead_among(self.client, list(self.known))
        if not dead:
            raise TrainingError(str(error)) from None
        self._on_worker_failure(dead, time.monotonic())
        return self._failure()

    async def _recover(self, failure: WorkerFailure) -> int:
        """Recover from ``failure`` (and from further failures during it); returns the step to resume at."""
        failed = set(failure.urls)
        for _ in range(len(self.known)):
            try:
                resume = await self._recover_once(failed, failure.noticed_at)
                self._forget_checkpoints("a worker failed before every stage's copy arrived", resume)
                return resume
            except (EdgertError, TransportError) as error:
                survivors = [url for url in self.known if url not in failed]
                more = await dead_among(self.client, survivors)
                if not more:
                    raise TrainingError(f"recovery failed: {error}") from None
                failed |= more
        raise TrainingError("every worker failed")

    async def _recover_once(self, failed: set[str], noticed_at: float) -> int:
        detected = time.monotonic()
        survivors = [url for url in self.known if url not in failed]
        if not survivors:
            raise TrainingError("every worker failed")
        self.watch.forget(failed)
        for url in failed:
            self.known.pop(url, None)
        lost_at = self.ledger.completed_through
        await asyncio.gather(*(self._stop(url) for url in survivors))
        holdings = await gather_holdings(self.client, survivors, self.run_id)
        holdings[COORDINATOR] = self.central.holdings()
        names = {p.name for stage in self.manifest.stages for p in stage.parameters}
        snapshot = newest_snapshot(holdings, names)  # None: no copy yet, start over from the initial state
        planned = time.monotonic()
        workers = [self.known[u] for u in survivors]  # however many: idle ones that joined too
        proposal = self.replanner.propose(self.manifest, None, force=True, candidates=workers)
        folder = self.config.out_dir / "plans" / f"recovery{self._recoveries + 1}"
        manifest = await asyncio.get_running_loop().run_in_executor(None, self.replanner.build,
                                                                    list(proposal.cuts), folder)
        by_name = {name: url for url, name in self.known.items()}
        order = [by_name[name] for name in proposal.workers]
        built = time.monotonic()
        await assign(self.client, manifest, folder, order, list(proposal.workers), self._settings)
        moved = await self._restore(manifest, order, snapshot, holdings)
        self._recoveries += 1
        self.manifest, self.plan_dir, self.order, self.names = manifest, folder, order, list(proposal.workers)
        self._evaluator = Evaluator(folder, manifest)
        for url in failed:  # a worker that died meanwhile (an idle one, say) is recovered from next
            self._failed.pop(url, None)
        after = snapshot if snapshot is not None else -1
        from_snapshot = self.ledger.restart(self.names, after=after)
        resume = after + 1
        total = time.monotonic() - noticed_at
        self.log.event("recovery", failed=sorted(failed), detection_s=round(detected - noticed_at, 3),
                       snapshot_step=snapshot, resume_step=resume, steps_lost=max(lost_at - after, 0),
                       steps_from_snapshot=from_snapshot,
                       replan_s=round(built - planned, 3), transfer_s=round(moved, 3), total_s=round(total, 3),
                       new_cuts=list(manifest.cuts), workers=self.names)
        if self._progress is not None:
            self._progress.message(f"recovered from the failure of {', '.join(sorted(failed))}: resumed at step "
                                   f"{resume} on {len(order)} worker(s) in {total:.2f} s")
        return resume

    async def _resume_from_snapshot(self) -> int:
        """``edgert train --resume``: continue from the newest complete snapshot on disk."""
        latest = self.central.latest_complete()
        if latest is None:
            raise TrainingError(f"{self.central.folder}: no complete snapshot to resume from "
                                f"(snapshots are written every --central-every steps)")
        info = json.loads((latest / "complete.json").read_text())
        step = int(info["step"])
        self.central.load(latest)
        manifest = Manifest.from_json(json.loads((latest / "manifest.json").read_text()))
        plan_dir = Path(info.get("plan_dir", ""))
        workers = [self.known[url] for url in self.order]
        if len(workers) != len(manifest.stages) or not (plan_dir / MANIFEST_NAME).is_file():
            proposal = self.replanner.propose(manifest, None, force=True, candidates=workers)
            plan_dir = self.config.out_dir / "plans" / f"resume-{step}"
            manifest = self.replanner.build(list(proposal.cuts), plan_dir)
            by_name = {name: url for url, name in self.known.items()}
            self.order = [by_name[name] for name in proposal.workers]
        self.manifest, self.plan_dir, self.names = manifest, plan_dir, [self.known[u] for u in self.order]
        await assign(self.client, manifest, plan_dir, self.order, self.names, self._settings)
        await self._restore(manifest, self.order, step, {COORDINATOR: self.central.holdings()})
        self.ledger.restart(self.names, after=step)
        self.log.event("resume", snapshot_step=step, resume_step=step + 1, workers=self.names,
                       cuts=list(manifest.cuts), process_started_s=self.log.opened_s)
        return step + 1

    async def _restore(self, manifest, order: list[str], snapshot: int | None, holdings: dict) -> float:
        """Every new stage pulls its state as of ``snapshot`` (None: the initial state it was built with)."""
        started = time.monotonic()
        if snapshot is None:
            return 0.0
        coordinator_url = self._settings.coordinator_url

        async def pull(k: int) -> None:
            url = order[k]
            names = [p.name for p in manifest.stages[k].parameters]
            sources = sources_for(snapshot, names, url, holdings, coordinator_url)
            message = Envelope(kind="control", run_id=self.run_id, meta={"sources": sources})
            try:
                await self.client.post(url, "migrate", message, timeout=120.0)
            except TransportError as error:
                raise EdgertError(f"worker {url} could not restore its state: {error}") from None

        await asyncio.gather(*(pull(k) for k in range(len(order))))
        return time.monotonic() - started

    async def _stop(self, url: str) -> None:
        try:
            await self.client.post(url, STOP, b"recovering from a failure", timeout=2.0, retries=0)
        except (TransportError, OSError):
            pass
