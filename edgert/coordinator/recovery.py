"""The coordinator's fault tolerance: recovering from failed workers, resuming a stopped run.

On a failure the survivors stop, the newest consistent snapshot is found (every parameter
has a copy after the same step: a worker's own snapshot, a neighbour's replica, or the
coordinator's; edgert/coordinator/snapshots.py), the planner cuts the model for the
survivors, every survivor takes its new stage and pulls its state as of that step from the
nearest holder, and the steps since the snapshot are replayed with the same samples: none
skipped, none applied twice. How failures are noticed is edgert/coordinator/failures.py's.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from edgert.coordinator.assignment import assign, links_record
from edgert.coordinator.errors import TrainingError, WorkerFailure
from edgert.coordinator.evaluation import Evaluation
from edgert.coordinator.failures import FailureDetector, dead_among
from edgert.coordinator.inputs import central_copy_origin, read_copy_query
from edgert.coordinator.ledger import StepLedger
from edgert.coordinator.replanning import Replanning
from edgert.coordinator.run_state import RunState
from edgert.coordinator.run_summary import count_events
from edgert.coordinator.runlog import RunLog
from edgert.coordinator.snapshots import COORDINATOR, CentralCopies, gather_holdings, newest_snapshot, sources_for
from edgert.coordinator.stage_groups import groups_record, without_failed
from edgert.errors import EdgertError
from edgert.groups import StageGroup
from edgert.manifest import MANIFEST_NAME, Manifest
from edgert.progress import Progress
from edgert.protocol import MIGRATE, REPLICA, STOP, WEIGHTS
from edgert.transport import BadRequest, Envelope, Request, TensorClient, TensorServer, TransportError
from edgert.transport.pieces import FileSink, Piece, Sink
from edgert.weights import StageState


class Recovery:
    """Rolls the run back to its newest consistent snapshot on the workers left, and serves the
    coordinator's own copies (``PUT /replica`` from the stages, ``FETCH /weights`` for the takers).

    Owns the central copies and the count of recoveries; moves the placement in ``state`` and drops
    the failed workers from ``state.known``.
    """

    def __init__(self, out_dir: Path, resume: bool, state: RunState, client: TensorClient, log: RunLog,
                 ledger: StepLedger, failures: FailureDetector, replanning: Replanning, evaluation: Evaluation,
                 central: CentralCopies, progress: Progress):
        self._out_dir = out_dir
        self._state = state
        self._client = client
        self._log = log
        self._ledger = ledger
        self._failures = failures
        self._replanning = replanning
        self._evaluation = evaluation
        self.central = central
        self._progress = progress
        # plans/recovery<N> go on from the run's earlier processes
        self._recoveries = count_events(out_dir, "recovery")[0] if resume else 0

    def serve(self, server: TensorServer) -> None:
        """Take the stages' copies and hand them out during recoveries (resources on ``server``)."""
        server.add_resource(REPLICA, put=self._on_replica, rt="edgert.replica", kinds=("weights",),
                            pieces=self._admit_copy)
        server.add_resource(WEIGHTS, fetch=self._on_weights_fetch, rt="edgert.weights", kinds=("control",),
                            piece_answers=True)

    async def recover(self, failure: WorkerFailure) -> int:
        """Recover from ``failure`` (and from further failures during it); returns the step to resume at."""
        failed = set(failure.urls)
        for _ in range(len(self._state.known)):
            try:
                resume = await self._recover_once(failed, failure.noticed_at)
                self._evaluation.forget_checkpoints("a worker failed before every stage's copy arrived", resume)
                return resume
            except (EdgertError, TransportError) as error:
                survivors = [url for url in self._state.known if url not in failed]
                more = await dead_among(self._client, survivors)
                if not more:
                    raise TrainingError(f"recovery failed: {error}") from None
                failed |= more
        raise TrainingError("every worker failed")

    async def resume(self) -> int:
        """``edgert train --resume``: continue from the newest complete snapshot on disk; returns the step
        to resume at."""
        state = self._state
        stored = self.central.load_latest()
        if stored is None:
            raise TrainingError(f"{self.central.folder}: no complete snapshot to resume from "
                                f"(snapshots are written every --central-every steps)")
        step, manifest, plan_dir = stored.step, stored.manifest, stored.plan_dir
        order, groups, codecs = state.order, [], ()
        workers = [state.known[url] for url in order]
        if len(workers) != len(manifest.stages) or not (plan_dir / MANIFEST_NAME).is_file():
            plan_dir = self._out_dir / "plans" / f"resume-{step}"
            placed = await self._replanning.placement_for(manifest, workers, plan_dir)
            manifest, order, groups, codecs = placed.manifest, placed.order, placed.groups, placed.link_codecs
        state.place(manifest, plan_dir, order, [state.known[u] for u in order], groups, codecs)
        links = await assign(self._client, manifest, plan_dir, state.order, state.names, state.settings, groups,
                             codecs)
        await self._restore(manifest, state.order, step, {COORDINATOR: self.central.holdings()}, groups)
        self._ledger.restart(state.names, after=step, members=state.member_counts())
        self._log.event("resume", snapshot_step=step, resume_step=step + 1, workers=state.names,
                        cuts=list(manifest.cuts), process_started_s=self._log.opened_s,
                        **({"groups": groups_record(groups, state.known)} if any(groups) else {}))
        self._log.event("links", before_step=step + 1, links=links_record(state.names, links))
        return step + 1

    # -- recovering ----------------------------------------------------------------------------

    async def _recover_once(self, failed: set[str], noticed_at: float) -> int:
        """One attempt: stop the survivors, find the snapshot, re-plan for them, restore; the resume step."""
        state = self._state
        detected = time.monotonic()
        survivors = self._drop(failed)
        lost_at = self._ledger.completed_through
        await asyncio.gather(*(self._stop(url) for url in survivors))
        holdings = await gather_holdings(self._client, survivors, state.run_id)
        holdings[COORDINATOR] = self.central.holdings()
        names = {p.name for stage in state.manifest.stages for p in stage.parameters}
        snapshot = newest_snapshot(holdings, names)  # None: no copy yet, start over from the initial state
        planned = time.monotonic()
        regrouped = without_failed(state.order, state.groups, failed)
        if regrouped is None:  # a stage lost every worker (or no group lost one): re-cut for the survivors
            workers = [state.known[u] for u in survivors]  # however many: idle ones that joined too
            folder = self._out_dir / "plans" / f"recovery{self._recoveries + 1}"
            placed = await self._replanning.placement_for(state.manifest, workers, folder)
            manifest, order, new_names, groups = placed.manifest, placed.order, placed.names, placed.groups
            codecs = placed.link_codecs
        else:  # the failed members' shares are re-spread over their groups: the same cuts, no plan to build
            manifest, folder = state.manifest, state.plan_dir
            order, groups = regrouped
            new_names = [state.known[u] for u in order]
            codecs = state.link_codecs  # the same links as before the failure
        built = time.monotonic()
        links = await assign(self._client, manifest, folder, order, new_names, state.settings, groups, codecs)
        moved = await self._restore(manifest, order, snapshot, holdings, groups)
        self._recoveries += 1
        state.place(manifest, folder, order, new_names, groups, codecs)
        self._evaluation.use_plan(folder, manifest)
        self._failures.recovered(failed)  # a worker that died meanwhile (an idle one, say) is recovered from next
        after = snapshot if snapshot is not None else -1
        from_snapshot = self._ledger.restart(state.names, after=after, members=state.member_counts())
        resume = after + 1
        total = time.monotonic() - noticed_at
        self._log.event("recovery", failed=sorted(failed), detection_s=round(detected - noticed_at, 3),
                        snapshot_step=snapshot, resume_step=resume, steps_lost=max(lost_at - after, 0),
                        steps_from_snapshot=from_snapshot,
                        replan_s=round(built - planned, 3), transfer_s=round(moved, 3), total_s=round(total, 3),
                        new_cuts=list(manifest.cuts), workers=state.names, regrouped=regrouped is not None,
                        **({"groups": groups_record(groups, state.known)} if any(groups) else {}))
        self._log.event("links", before_step=resume, links=links_record(state.names, links))
        self._progress.message(f"recovered from the failure of {', '.join(sorted(failed))}: resumed at step "
                               f"{resume} on {len(order)} worker(s) in {total:.2f} s")
        return resume

    def _drop(self, failed: set[str]) -> list[str]:
        """Forget the ``failed`` workers; the survivors."""
        survivors = [url for url in self._state.known if url not in failed]
        if not survivors:
            raise TrainingError("every worker failed")
        self._failures.recovering(failed)
        for url in failed:
            self._state.known.pop(url, None)
        return survivors

    async def _restore(self, manifest: Manifest, order: list[str], snapshot: int | None, holdings: dict,
                       groups: list[StageGroup | None] | None = None) -> float:
        """Every new stage's workers (a group's every member) pull its state as of ``snapshot`` (None: the initial
        state it was built with)."""
        started = time.monotonic()
        if snapshot is None:
            return 0.0
        coordinator_url = self._state.settings.coordinator_url

        async def pull(k: int, url: str) -> None:
            names = [p.name for p in manifest.stages[k].parameters]
            request = sources_for(snapshot, names, url, holdings, coordinator_url)
            try:
                await self._client.post(url, MIGRATE, request.to_envelope(self._state.run_id), timeout=120.0)
            except TransportError as error:
                raise EdgertError(f"worker {url} could not restore its state: {error}") from None

        groups = groups or []
        await asyncio.gather(*(pull(k, url) for k in range(len(order))
                               for url in (groups[k].members if k < len(groups) and groups[k] else (order[k],))))
        return time.monotonic() - started

    async def _stop(self, url: str) -> None:
        try:
            await self._client.post(url, STOP, b"recovering from a failure", timeout=2.0, retries=0)
        except (TransportError, OSError):
            pass

    # -- copies held by the coordinator --------------------------------------------------------

    def _admit_copy(self, request: Request, piece: Piece) -> Sink:
        """A copy arriving in pieces: checked from its first piece, written to its place on disk as it comes."""
        state, header = self._state, piece.header
        central_copy_origin(request, header, piece.size, state.run_id, state.names, state.announced_through,
                            state.manifest)
        return FileSink(self.central.path(header.step, header.stage))

    async def _on_replica(self, request: Request) -> None:
        """A worker's copy of its stage (edgert/coordinator/inputs.py says which are refused)."""
        state = self._state
        origin = central_copy_origin(request, request.envelope, len(request.payload), state.run_id, state.names,
                                     state.announced_through, state.manifest)
        copy = StageState.from_envelope(request.envelope)
        if request.sink is not None:
            request.sink.commit()  # the file in its place before the snapshot it completes is marked complete
        manifest_text = json.dumps(state.manifest.to_json())
        complete = self.central.put(copy, origin, len(state.manifest.stages), manifest_text,
                                    str(state.plan_dir.resolve()), on_disk=request.stored is not None)
        if complete:
            self._log.event("central_snapshot", step=copy.step, stages=len(state.manifest.stages))
            self._evaluation.snapshot_complete(copy.step)

    async def _on_weights_fetch(self, request: Request) -> Envelope:
        """Copies as of a step, for workers taking over blocks during a recovery."""
        query = read_copy_query(request.envelope, self._state.run_id)
        try:
            return self.central.get(query.copy_step, list(query.names)).to_envelope(self._state.run_id)
        except EdgertError as error:
            raise BadRequest(str(error)) from None
