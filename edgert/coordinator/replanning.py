"""The coordinator's re-planning: watching stage times, moving the cuts, welcoming workers.

Every ``--replan-every`` completed steps (and when a worker joins) the placement is checked
against the times measured lately, while the pipeline keeps going; while a worker that joined
is idle, it is weighed at every such check whatever ``--replan`` says. The planner may form,
grow, shrink or re-form data-parallel groups (``--replan-groups``; by default for models
without batch statistics): a worker that joins a group with the cuts unchanged needs no
re-cut. A better placement whose gain over the steps left, its pause included, reaches the
threshold is applied at a step boundary: the run loop cuts the segment at the last step whose
data was sent and drains the pipeline, then the new stages are assigned and their state
migrates between workers (edgert.coordinator.assignment).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgert.coordinator.assignment import assign, links_record, migrate
from edgert.coordinator.errors import TrainingError
from edgert.coordinator.evaluation import Evaluation
from edgert.coordinator.failures import FailureDetector, health_of
from edgert.coordinator.ledger import StepLedger
from edgert.coordinator.run_state import RunState
from edgert.coordinator.run_summary import count_events
from edgert.coordinator.runlog import RunLog
from edgert.coordinator.stage_groups import check_splittable, groups_record
from edgert.devices import save_devices
from edgert.errors import EdgertError
from edgert.groups import StageGroup
from edgert.manifest import Manifest
from edgert.progress import Progress
from edgert.protocol import JOIN, JoinRequest, read_request
from edgert.security.admission import StageSigning
from edgert.transport import BadRequest, Request, TensorClient, TensorServer, TransportError
from edgert.transport.errors import Forbidden, ServiceUnavailable

if TYPE_CHECKING:
    from edgert.coordinator.coordinator import TrainConfig
    from edgert.coordinator.profiling import ProfilePlans
    from edgert.exporter.planner.replanner import Proposal, Replanner

log = logging.getLogger("edgert.coordinator.replanning")

SHIFT_WINDOW = 2  # steps a placement check looks at when a device has just changed speed
QUICK_PROFILE_REPEATS = 2  # timed calls per unit when a joining or unprofiled worker is measured


@dataclass(frozen=True)
class NewPlacement:
    """A placement made for a given set of workers: the plan built for it, each stage's worker (URL and name; a
    group's holder of record), the groups (None for a stage of one worker), the planner's codec per link."""

    manifest: Manifest
    order: list[str]
    names: list[str]
    groups: list[StageGroup | None]
    link_codecs: tuple[str, ...]


class Replanning:
    """Decides when the placement is checked, moves the cuts, and takes in workers that join (``POST /join``).

    Owns the planner (edgert.exporter.planner.replanner, made by :meth:`start`), the plans a quick
    profile times workers on, the count of re-plans and when the next check is due; moves the
    placement in ``state`` and adds the workers that join to ``state.known``.
    """

    def __init__(self, config: TrainConfig, state: RunState, client: TensorClient, log: RunLog, ledger: StepLedger,
                 failures: FailureDetector, evaluation: Evaluation, progress: Progress,
                 signing: StageSigning | None, last_step: int, takes_joins: bool):
        self._config = config
        self._last_step = last_step  # the run's final step: a gain is summed over the steps left
        self._takes_joins = takes_joins  # whether this run has a planner (started by start()) to place joiners
        self._state = state
        self._client = client
        self._log = log
        self._ledger = ledger
        self._failures = failures
        self._evaluation = evaluation
        self._progress = progress
        self._signing = signing
        self._replanner: Replanner | None = None
        # plans/plan<N> go on from the run's earlier processes
        self._replans = count_events(config.out_dir, "replan")[0] if config.resume else 0
        self._since_check = 0  # steps completed since the last check, in this segment
        self._membership_changed = False
        self._recheck = False  # a live re-plan's result is checked SHIFT_WINDOW + 1 steps later
        self._profile_plans: ProfilePlans | None = None  # the units and whole model, made at the first quick profile
        self._profiling = asyncio.Lock()
        self._ready = False  # start() has made the planner and profiled the first workers: joins are taken
        self._joined: set[str] = set()  # names of the workers that joined while the run went on
        self._idle_reason: dict[str, str] = {}  # joined worker's name -> the kind of reason it was last kept idle for

    def serve(self, server: TensorServer) -> None:
        """Take in workers that offer themselves (a resource on ``server``)."""
        server.add_resource(JOIN, post=self._on_join, rt="edgert.join", kinds=("control",))

    async def start(self) -> None:
        """Make the planner (the host extra, onnx); profile the workers unless ``--devices`` gave their speeds."""
        try:
            from edgert.exporter.planner.replanner import Replanner
        except ImportError as error:
            raise TrainingError(f"re-planning needs the host extra (onnx): {error}") from None
        config = self._config
        self._replanner = Replanner(config.plan_dir, self._state.manifest, config.out_dir / "stage-cache",
                                    devices=config.devices, threshold=config.replan_threshold,
                                    batch_size=config.batch_size, micro_batches=config.micro_batches,
                                    schedule=config.schedule, memory_mode=config.memory_mode,
                                    side_by_side=config.runs_side_by_side(config.plan_dir),
                                    split_backward=config.runs_split_backward(config.plan_dir))
        if config.devices is None:
            await self._profile(dict(self._state.known))
        self._ready = True

    def begin_segment(self) -> None:
        """A segment starts: the steps until the next check count from here."""
        self._since_check = 0

    async def after_step(self) -> Proposal | None:
        """A step completed: when a check is due, a better placement (a proposal) or None."""
        config = self._config
        self._since_check += 1
        auto = config.replan == "auto"
        shifted = auto and self._ledger.speed_changed()
        # right after a re-plan, the new placement's own times (not the old ones) are checked soon
        recheck = auto and self._recheck and self._since_check > SHIFT_WINDOW
        periodic = (auto or bool(self.idle_workers())) and self._since_check >= config.replan_every
        if not (periodic or shifted or recheck or self._membership_changed):
            return None
        self._since_check, self._membership_changed, self._recheck = 0, False, False
        quick = shifted or recheck
        return await self._check_placement(window=SHIFT_WINDOW if quick else config.replan_every)

    def idle_workers(self) -> list[str]:
        """The names of the known workers that hold no stage (joined, or left out by a re-plan)."""
        state = self._state
        return [name for url, name in state.known.items() if url not in state.placed()]

    @property
    def groups_allowed(self) -> bool:
        """Whether the planner may put groups on stages: ``--replan-groups``, by default where a group is exact (no
        stage's forward updates running statistics: each member would normalise with its own rows')."""
        chosen = self._config.replan_groups
        return chosen if chosen is not None else not any(s.buffer_updates for s in self._state.manifest.stages)

    @property
    def steps_left(self) -> int:
        """Steps the run still has to complete."""
        return max(0, self._last_step - self._ledger.completed_through)

    async def forced(self, next_step: int) -> None:
        """``--replan-at``: move to the cuts asked for before ``next_step`` (the pipeline is drained)."""
        state = self._state
        self._observe(self._config.replan_every)
        cuts = dict(self._config.replan_at)[next_step]
        proposal = self._replanner.propose(state.manifest, state.names, force=True, cuts=cuts,
                                           candidates=list(state.known.values()))
        await self.repartition(proposal, next_step)

    async def repartition(self, proposal: Proposal, next_step: int) -> None:
        """Move to ``proposal``'s cuts, workers and groups before ``next_step``; the pipeline is drained. Where
        only the groups change (the cuts stay), the plan is kept: nothing is re-cut, and only the workers new
        to a stage fetch its state, from a worker that holds it."""
        state = self._state
        started = time.perf_counter()
        order = self._urls(proposal.workers)
        groups = self._groups(proposal)
        recut = list(proposal.cuts) != self._replanner.block_cuts(state.manifest)
        if recut:
            self._replans += 1
            folder = self._config.out_dir / "plans" / f"plan{self._replans}"
            manifest = await self._build(list(proposal.cuts), folder)
            self._evaluation.use_plan(folder, manifest)
        else:
            manifest, folder = state.manifest, state.plan_dir
        idle_before = self.idle_workers()
        old_manifest, old_members, old_cuts = state.manifest, [state.members(k) for k in range(len(state.order))], \
            list(state.manifest.cuts)
        links = await assign(self._client, manifest, folder, order, list(proposal.workers), state.settings, groups,
                             proposal.link_codecs)
        new_members = [g.members if g is not None else (url,) for g, url in zip(groups, order)]
        moved = await migrate(self._client, state.run_id, old_manifest, old_members, manifest, new_members)
        state.place(manifest, folder, order, list(proposal.workers), groups, proposal.link_codecs)
        self._ledger.configure(state.names, state.member_counts())
        pause = time.perf_counter() - started
        self._replanner.record_pause(pause, recut)
        self._recheck = proposal.reason != "forced"
        grouped = groups_record(groups, state.known)
        self._log.event("replan", before_step=next_step, reason=proposal.reason, old_cuts=old_cuts,
                        new_cuts=list(manifest.cuts), recut=recut, workers=state.names,
                        predicted_gain=round(proposal.gain, 3), pause_s=round(pause, 3), bytes_moved=moved.bytes,
                        migrate_s=round(moved.seconds, 3), **({"groups": grouped} if grouped else {}))
        self._log.event("links", before_step=next_step, links=links_record(state.names, links))
        change = (f"cuts {old_cuts} -> {list(manifest.cuts)}" if recut else "same cuts")
        if grouped:
            change += ", groups " + "; ".join(f"stage {k}: {'+'.join(g['workers'])}" for k, g in grouped.items())
        self._progress.message(f"re-planned before step {next_step} ({proposal.reason}): {change}, "
                               f"paused {pause:.2f} s")
        placed = {name: k for k, members in enumerate(state.member_names()) for name in members}
        for name in idle_before:
            if name in placed and name in self._joined:
                self._idle_reason.pop(name, None)
                stage = placed[name]
                how = " (in its group, no re-cut)" if not recut and len(state.members(stage)) > 1 else ""
                self._log.event("join_placed", worker=name, stage=stage, before_step=next_step, recut=recut)
                self._progress.message(f"worker {name} (joined) placed on stage {stage}{how} from step {next_step}")

    def _groups(self, proposal: Proposal) -> list[StageGroup | None]:
        """The groups ``proposal`` puts on stages (None for a stage of one worker), by URL, with their names."""
        urls = self._state.urls_by_name()
        groups: list[StageGroup | None] = []
        for k, members in enumerate(proposal.stage_members()):
            if len(members) == 1:
                groups.append(None)
                continue
            groups.append(StageGroup(tuple(urls[name] for name in members), tuple(proposal.shares[k]),
                                     tuple(members)))
        return groups

    async def placement_for(self, manifest: Manifest, workers: list[str], folder: Path) -> NewPlacement:
        """``manifest``'s model cut for ``workers`` (by name), whatever the times say, built into ``folder`` (a
        recovery that must re-cut, a resume). Groups as ``--replan-groups`` allows, and only where every
        member gets rows of the smallest micro-batch."""
        config = self._config
        proposal = self._replanner.propose(manifest, None, force=True, candidates=workers,
                                           allow_groups=self.groups_allowed)
        groups = self._groups(proposal)
        try:
            check_splittable(groups, config.batch_size, config.micro_batches, config.schedule)
        except TrainingError:
            proposal = self._replanner.propose(manifest, None, force=True, candidates=workers)
            groups = [None] * len(proposal.workers)
        built = await self._build(list(proposal.cuts), folder)
        return NewPlacement(built, self._urls(proposal.workers), list(proposal.workers), groups,
                            proposal.link_codecs)

    # -- the steps -------------------------------------------------------------------------------

    def _observe(self, window: int) -> None:
        """Give the planner the stage times of the last ``window`` steps (a group's members' own, too)."""
        from edgert.exporter.planner.replanner import MemberTimes

        measured = self._ledger.stage_times_ms(window)
        step_ms = self._ledger.median_step_ms(window)
        members = [{name: MemberTimes(*times) for name, times in stage.items()}
                   for stage in self._ledger.member_times_ms(window)]
        self._replanner.observe(self._state.manifest, self._state.names, measured, step_ms, members)

    async def _check_placement(self, window: int) -> Proposal | None:
        """A better placement for the times of the last ``window`` steps, or None (planned off the event loop)."""
        state = self._state
        self._observe(window)
        workers, steps_left = list(state.known.values()), self.steps_left
        try:
            proposal = await asyncio.get_running_loop().run_in_executor(
                None, lambda: self._replanner.propose(state.manifest, state.names, candidates=workers,
                                                      steps_left=steps_left, members=state.member_names(),
                                                      allow_groups=self.groups_allowed))
        except EdgertError as error:  # a check that cannot plan keeps the placement; training goes on
            log.warning("placement check after step %d failed: %s", self._ledger.completed_through, error)
            self._log.event("placement_check", after_step=self._ledger.completed_through, steps_left=steps_left,
                            decision=f"keep: the planner failed: {error}")
            return None
        check = self._replanner.last_check
        if proposal is not None and proposal.members:
            try:
                config = self._config
                check_splittable(self._groups(proposal), config.batch_size, config.micro_batches, config.schedule)
            except TrainingError as error:
                check["decision"], proposal = f"keep: {error}", None
        self._log.event("placement_check", after_step=self._ledger.completed_through, **check)
        if proposal is None:
            self._report_idle(check["decision"])
        return proposal

    def _report_idle(self, decision: str) -> None:
        """Say why each idle worker that joined stays idle, when the kind of reason is new (its figures aside),
        in the log and on the console; every check's figures are in its ``placement_check`` event."""
        reason = decision.removeprefix("keep: ")
        kind = re.sub(r"[-+]?\d[\d.]*", "#", reason)
        for name in self.idle_workers():
            if name not in self._joined or self._idle_reason.get(name) == kind:
                continue
            self._idle_reason[name] = kind
            self._log.event("join_kept_idle", worker=name, after_step=self._ledger.completed_through,
                            reason=reason, steps_left=self.steps_left)
            self._progress.message(f"worker {name} (joined) kept idle after step {self._ledger.completed_through}:"
                                   f" {reason}; weighed again every {self._config.replan_every} steps")

    async def _build(self, cuts: list[int], folder: Path) -> Manifest:
        """The plan for ``cuts``, exported into ``folder`` (off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(None, self._replanner.build, cuts, folder)

    def _urls(self, names: Iterable[str]) -> list[str]:
        """The known workers' URLs, for their names."""
        by_name = self._state.urls_by_name()
        return [by_name[name] for name in names]

    async def _on_join(self, request: Request) -> str:
        """A worker offers itself (``edgert worker --join``): the planner decides at the next step boundary."""
        url = read_request(JoinRequest.from_envelope, request.envelope).url
        if not self._takes_joins:
            raise BadRequest("this run cannot place a worker that joins: it neither re-plans nor recovers "
                             "(start it with --replan auto, or keep --replicate-every above 0)")
        if not self._ready:
            raise ServiceUnavailable("the run is starting (profiling its workers); join again shortly")
        try:
            health = await health_of(self._client, url, timeout=5.0)
        except (TransportError, EdgertError) as error:
            raise BadRequest(f"{url} does not answer: {error}") from None
        if request.identity is not None and request.identity.name != health.name:
            raise Forbidden(f"{request.identity} may join only as itself, not as worker {health.name!r} at {url}")
        if url not in self._state.known:
            if self._config.devices is None:
                await self._profile({url: health.name})
            self.admit(url, health.name)
            self._log.event("join", worker=health.name, url=url)
            self._progress.message(f"worker {health.name} joined from {url}: weighed at the next step boundary")
        return "joined"

    def admit(self, url: str, name: str) -> None:
        """Count ``url`` (worker ``name``) among the run's workers: watched, and weighed at the next check."""
        self._state.known[url] = name
        self._joined.add(name)
        self._failures.watch(url)
        self._membership_changed = True

    async def _profile(self, workers: dict[str, str]) -> None:
        """A quick profile of ``workers`` on the model's units, so the planner knows their speeds."""
        started = time.perf_counter()
        try:
            async with self._profiling:  # workers that join together are timed one after another too
                await self._measure(workers)
        except (TransportError, EdgertError) as error:
            raise TrainingError(f"profiling {', '.join(workers.values())} failed: {error}") from None
        save_devices(self._replanner.devices, self._config.out_dir / "devices.json")
        self._log.event("profiled", workers=list(workers.values()), seconds=round(time.perf_counter() - started, 3),
                        devices_file="devices.json")

    async def _measure(self, workers: dict[str, str]) -> None:
        """Time ``workers`` (URL -> name) on the model's units, one after another, and cost them by it from now on.

        Without a ``devices.json``, FLOPs are a poor guide to a device's speed on another block
        range; a quick profile (FTPipeHD re-profiles too) lets the planner place blocks by time.
        One at a time, so workers that share a host's cores do not disturb each other's times.
        """
        from edgert.coordinator.profiling import export_profile_plans, profile_device, unit_names

        replanner = self._replanner
        if self._profile_plans is None:
            self._profile_plans = export_profile_plans(replanner.source_path, self._config.out_dir / "profile",
                                                       replanner.training)
        plans = self._profile_plans
        profiles = [await profile_device(self._client, plans, url, name, replanner.micro_batch, QUICK_PROFILE_REPEATS,
                                         memory_mode=replanner.memory_mode, signing=self._signing,
                                         scaling=replanner.side_by_side, split_backward=replanner.split_backward)
                    for url, name in workers.items()]
        replanner.use_profiles(profiles, tuple(unit_names(plans.units)))
