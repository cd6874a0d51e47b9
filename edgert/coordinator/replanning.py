"""The coordinator's re-planning: watching stage times, moving the cuts, welcoming workers.

Every ``--replan-every`` completed steps (and when a worker joins) the placement is checked
against the times measured lately, while the pipeline keeps going; a better placement that
pays for its pause is applied at a step boundary: the segment is cut at the last step
whose data was sent, the pipeline drains, the new stages are assigned and their state
migrates between workers (edgert.coordinator.assignment).
"""

from __future__ import annotations

import asyncio
import time

from edgert.coordinator.assignment import assign, migrate
from edgert.coordinator.errors import TrainingError
from edgert.coordinator.evaluator import Evaluator
from edgert.devices import save_devices
from edgert.errors import EdgertError
from edgert.protocol import HEALTH, Health, JoinRequest, read_request
from edgert.transport import BadRequest, Request, TransportError
from edgert.transport.errors import Forbidden


class ReplanMixin:
    """Mixin of :class:`edgert.coordinator.coordinator.Coordinator`."""

    def _make_replanner(self):
        try:
            from edgert.exporter.planner.replanner import Replanner
        except ImportError as error:
            raise TrainingError(f"re-planning needs the host extra (onnx): {error}") from None
        return Replanner(self.config.plan_dir, self.manifest, self.config.out_dir / "stage-cache",
                         devices=self.config.devices, threshold=self.config.replan_threshold,
                         batch_size=self.config.batch_size, micro_batches=self.config.micro_batches,
                         schedule=self.config.schedule, memory_mode=self.config.memory_mode)

    async def _on_join(self, request: Request) -> str:
        """A worker offers itself (``edgert worker --join``): the planner decides at the next step boundary."""
        url = read_request(JoinRequest.from_envelope, request.envelope).url
        try:
            health = Health.from_envelope((await self.client.get(url, HEALTH, timeout=5.0)).envelope())
        except (TransportError, EdgertError) as error:
            raise BadRequest(f"{url} does not answer: {error}") from None
        if request.identity is not None and request.identity.name != health.name:
            raise Forbidden(f"{request.identity} may join only as itself, not as worker {health.name!r} at {url}")
        if url not in self.known:
            if self.replanner is not None and self.config.devices is None:
                await self._profile_workers({url: health.name})
            self.known[url] = health.name
            if self.watch is not None:
                self.watch.watch([url])
            self._membership_changed = True
            self.log.event("join", worker=health.name, url=url)
        return "joined"

    async def _profile_workers(self, workers: dict[str, str]) -> None:
        """A quick profile of ``workers`` on the model's units, so the planner knows their speeds."""
        started = time.perf_counter()
        try:
            await self.replanner.profile(self.client, workers, self.config.out_dir / "profile",
                                         signing=None if self.security is None else self.security.signing)
        except (TransportError, EdgertError) as error:
            raise TrainingError(f"profiling {', '.join(workers.values())} failed: {error}") from None
        save_devices(self.replanner.devices, self.config.out_dir / "devices.json")
        self.log.event("profiled", workers=list(workers.values()), seconds=round(time.perf_counter() - started, 3),
                       devices_file="devices.json")

    # -- re-planning ---------------------------------------------------------------------------

    def _observe(self, window: int) -> None:
        measured = self.ledger.stage_times_ms(window)
        step_ms = self.ledger.median_step_ms(window)
        self.replanner.observe(self.manifest, self.names, measured, step_ms)

    async def _check_placement(self, window: int):
        """A better placement for the times of the last ``window`` steps, or None (planned off the event loop)."""
        self._observe(window)
        workers = list(self.known.values())
        proposal = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.replanner.propose(self.manifest, self.names, candidates=workers))
        self.log.event("placement_check", after_step=self.ledger.completed_through, **self.replanner.last_check)
        return proposal

    async def _forced_replan(self, next_step: int) -> None:
        self._observe(self.config.replan_every)
        cuts = dict(self.config.replan_at)[next_step]
        proposal = self.replanner.propose(self.manifest, self.names, force=True, cuts=cuts,
                                          candidates=list(self.known.values()))
        await self._repartition(proposal, next_step)

    async def _repartition(self, proposal, next_step: int) -> None:
        """Move to ``proposal``'s cuts and workers before ``next_step``; the pipeline is drained."""
        started = time.perf_counter()
        self.replans += 1
        folder = self.config.out_dir / "plans" / f"plan{self.replans}"
        loop = asyncio.get_running_loop()
        manifest = await loop.run_in_executor(None, self.replanner.build, list(proposal.cuts), folder)
        self._evaluator = Evaluator(folder, manifest)
        by_name = {name: url for url, name in self.known.items()}
        order = [by_name[name] for name in proposal.workers]
        old_manifest, old_order, old_cuts = self.manifest, self.order, list(self.manifest.cuts)
        await assign(self.client, manifest, folder, order, list(proposal.workers), self._settings)
        moved = await migrate(self.client, self.run_id, old_manifest, old_order, manifest, order)
        self.manifest, self.plan_dir, self.order, self.names = manifest, folder, order, list(proposal.workers)
        self.ledger.configure(self.names)
        pause = time.perf_counter() - started
        self.replanner.record_pause(pause)
        self._recheck_after_replan = proposal.reason != "forced"
        self.log.event("replan", before_step=next_step, reason=proposal.reason, old_cuts=old_cuts,
                       new_cuts=list(manifest.cuts), workers=self.names, predicted_gain=round(proposal.gain, 3),
                       pause_s=round(pause, 3), bytes_moved=moved.bytes, migrate_s=round(moved.seconds, 3))
        if self._progress is not None:
            self._progress.message(f"re-planned before step {next_step} ({proposal.reason}): cuts "
                                   f"{old_cuts} -> {list(manifest.cuts)}, paused {pause:.2f} s")

