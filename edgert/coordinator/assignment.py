"""Putting stages on workers: the first assignment, and moving the cuts while training runs.

Re-partitioning happens at a step boundary, with the pipeline drained: every worker gets
its new stage (``PUT /stage``; it keeps a copy of the state it held), then fetches the
parameters *and optimizer state* of the blocks it now owns straight from the workers that
held them (``POST /migrate`` -> ``FETCH /weights`` between workers). Nothing passes
through the coordinator, and nothing learned is lost.

Each link between consecutive stages carries its activations and gradients in the codecs
:func:`link_codecs` gives it (the plan's ``placement.json``, or the run's), told to the sending
stages in their peers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from edgert.coordinator.errors import AssignmentError
from edgert.exporter.device_plan import PLACEMENT_NAME, load_placement
from edgert.groups import StageGroup
from edgert.manifest import Manifest, TrainingConfig
from edgert.protocol import (
    ASSIGNMENT_PIECES,
    MIGRATE,
    SELF,
    STAGE,
    MigrateRequest,
    MigrationSource,
    Peers,
    StageAssignment,
)
from edgert.run_settings import RunSettings
from edgert.security.admission import StageSigning
from edgert.transport import TensorClient, TransportError

DIRECTIONS = ("forward", "backward")  # activations to the next stage, gradients to the previous one


@dataclass(frozen=True)
class RunBriefing:
    """What the coordinator tells every stage of a run (its settings, where to report) and how: how many
    ring neighbours get each stage's copies, the cluster key that signs it (None: --insecure), and the
    directions whose codec each link takes from its plan (the others use ``settings``' on every link)."""

    run_id: str
    coordinator_url: str
    settings: RunSettings
    replicas: int
    signing: StageSigning | None
    planned_codecs: tuple[str, ...]  # some of DIRECTIONS: those --codec / --grad-codec did not fix
    threads: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # URL: planned (forward, backward)

    def settings_for(self, url: str) -> RunSettings:
        """The settings the worker at ``url`` is told: the run's, with the threads the plan split for it."""
        if url not in self.threads:
            return self.settings
        forward, backward = self.threads[url]
        return dataclasses.replace(self.settings, forward_threads=forward, backward_threads=backward)


@dataclass(frozen=True)
class LinkCodecs:
    """The codecs of the link from stage ``k`` to ``k + 1``: its activations' and its gradients'."""

    forward: str
    backward: str


@dataclass(frozen=True)
class Migration:
    """What a re-partition moved."""

    bytes: int
    seconds: float
    parameters: int


async def assign(client: TensorClient, manifest: Manifest, plan_dir: Path, order: list[str], names: list[str],
                 briefing: RunBriefing, groups: list[StageGroup | None] | None = None,
                 planned: tuple[str, ...] = ()) -> tuple[LinkCodecs, ...]:
    """Send stage ``k`` of ``manifest`` to worker ``order[k]`` (to every member of ``groups[k]``, when a group
    holds it), all at once; the codecs each link was given (``planned``: the planner's per link, else the
    plan folder's)."""
    stages = len(manifest.stages)
    links = link_codecs(plan_dir, stages, briefing, planned)
    grouped = list(groups or [None] * stages)

    def members(k: int) -> tuple[str, ...]:
        return (order[k],) if grouped[k] is None else grouped[k].members

    async def one(k: int, member: int) -> None:
        entry = manifest.stages[k]
        first, last = k == 0, k + 1 == stages
        url = members(k)[member]
        peers = Peers(previous=None if first else order[k - 1], next=None if last else order[k + 1],
                      coordinator=briefing.coordinator_url, previous_name=None if first else names[k - 1],
                      next_name=None if last else names[k + 1], next_codec=None if last else links[k].forward,
                      previous_codec=None if first else links[k - 1].backward,
                      previous_group=None if first else grouped[k - 1], next_group=None if last else grouped[k + 1])
        replicas = ring_neighbours(order, k, briefing.replicas) if member == 0 else ()  # the holder's copies only
        assignment = StageAssignment(run_id=briefing.run_id, entry=entry, stages=stages, peers=peers,
                                     settings=briefing.settings_for(url), replica_targets=replicas, group=grouped[k],
                                     member=member)
        try:
            envelope = assignment.to_envelope(assignment.read_files(plan_dir))
            if briefing.signing is not None:
                briefing.signing.apply(envelope)
            await client.request("PUT", url, STAGE, envelope, timeout=120.0, pieces=ASSIGNMENT_PIECES)
        except TransportError as error:
            who = names[k] if member == 0 else f"member {member} of stage {k}'s group"
            raise AssignmentError(f"worker {who} ({url}) refused stage {k}: {error}") from None

    await asyncio.gather(*(one(k, j) for k in range(stages) for j in range(len(members(k)))))
    return links


def links_record(names: list[str], links: tuple[LinkCodecs, ...]) -> list[dict[str, object]]:
    """The ``links`` event's list (docs/RUNS.md): each link's workers and codecs, for the stages on ``names``."""
    return [{"link": k, "sender": names[k], "receiver": names[k + 1], "forward": link.forward,
             "backward": link.backward} for k, link in enumerate(links)]


def link_codecs(plan_dir: Path, stages: int, briefing: RunBriefing,
                planned: tuple[str, ...] = ()) -> tuple[LinkCodecs, ...]:
    """Each link's codecs: in a direction of ``briefing.planned_codecs``, the planner's choice for that link
    (``planned``, a live re-plan's or a recovery's; else ``placement.json``'s ``link_codecs``: the planner
    costs both directions alike); otherwise, or with neither, the run's settings'."""
    chosen, source = (planned, "the planner") if planned else (None, plan_dir / PLACEMENT_NAME)
    if briefing.planned_codecs and chosen is None:
        chosen = getattr(load_placement(plan_dir), "link_codecs", None)
    if chosen is not None and len(chosen) != stages - 1:
        raise AssignmentError(f"{source}: {len(chosen)} link codecs for a plan of {stages} stages "
                              f"(expected {stages - 1})")

    def codec(direction: str, link: int) -> str:
        if chosen is not None and direction in briefing.planned_codecs:
            return chosen[link]
        return getattr(briefing.settings, f"{direction}_codec")

    return tuple(LinkCodecs(*(codec(direction, k) for direction in DIRECTIONS)) for k in range(stages - 1))


def ring_neighbours(order: list[str], k: int, replicas: int) -> tuple[str, ...]:
    """The next ``replicas`` workers after stage ``k`` in the ring (last -> first), never itself."""
    count = min(replicas, len(order) - 1)
    return tuple(order[(k + i) % len(order)] for i in range(1, count + 1))


def owners(manifest: Manifest, members: list[tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Which workers hold each parameter and running statistic (a group's every member, its holder of record
    first)."""
    return {p.name: members[stage.index] for stage in manifest.stages for p in stage.parameters}


async def migrate(client: TensorClient, run_id: str, old: Manifest, old_members: list[tuple[str, ...]],
                  new: Manifest, new_members: list[tuple[str, ...]]) -> Migration:
    """After the new stages are assigned, let every worker (every member of a group) pull its state from the
    old holders: a worker that held a parameter keeps its own copy, another fetches it from its holder of
    record (a group's members all hold the same state)."""
    held = owners(old, old_members)
    started = time.perf_counter()

    async def pull(stage_index: int, url: str) -> int:
        by_source: dict[str, list[str]] = {}
        for parameter in new.stages[stage_index].parameters:
            holders = held.get(parameter.name)
            if not holders:
                raise AssignmentError(f"no worker held {parameter.name!r} before the re-partition")
            by_source.setdefault(SELF if url in holders else holders[0], []).append(parameter.name)
        request = MigrateRequest(tuple(MigrationSource(source, tuple(names), previous=True)
                                       for source, names in by_source.items()))
        try:
            response = await client.post(url, MIGRATE, request.to_envelope(run_id), timeout=300.0)
        except TransportError as error:
            raise AssignmentError(f"worker {url} could not take over its state: {error}") from None
        return int(response.envelope().meta.get("bytes", 0))

    moved = await asyncio.gather(*(pull(k, url) for k in range(len(new.stages)) for url in new_members[k]))
    return Migration(bytes=sum(moved), seconds=time.perf_counter() - started,
                     parameters=sum(len(s.parameters) for s in new.stages))


def with_learning_rate(training: TrainingConfig, learning_rate: float | None) -> TrainingConfig:
    return training if learning_rate is None else dataclasses.replace(training, learning_rate=learning_rate)
