"""What the coordinator's parts share about the run in progress: its id, its placement, its workers.

Who writes what: the placement (``manifest``, ``plan_dir``, ``order``, ``names``) changes only when
the cuts move: the first assignment (:class:`~edgert.coordinator.coordinator.Coordinator`), a
re-plan (:class:`~edgert.coordinator.replanning.Replanning`), a recovery or a resume
(:class:`~edgert.coordinator.recovery.Recovery`). ``known`` is filled when the workers connect,
grows when one joins (re-planning) and shrinks when one fails (recovery); ``announced_through``
is written by :class:`~edgert.coordinator.segments.SegmentRunner` as it announces a segment (a copy
taken after a later step is refused); ``settings`` are set by the coordinator before the first
assignment or resume.
Everything else each part keeps to itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgert.coordinator.assignment import RunBriefing
from edgert.groups import StageGroup
from edgert.manifest import Manifest


@dataclass
class RunState:
    """The run as every part of the coordinator sees it."""

    run_id: str
    manifest: Manifest
    plan_dir: Path
    order: list[str]  # worker URL of each stage
    names: list[str] = field(default_factory=list)  # worker name of each stage
    known: dict[str, str] = field(default_factory=dict)  # worker URL -> name: every worker, idle ones too
    announced_through: int = -1  # the last step of the segments sent to the workers (copies come after)
    settings: RunBriefing | None = None  # what every stage assignment of this run carries
    groups: list[StageGroup | None] = field(default_factory=list)  # each stage's group (None: ``order[k]`` alone)
    link_codecs: tuple[str, ...] = ()  # the live planner's codec per link (empty: the plan folder's, if any)

    def place(self, manifest: Manifest, plan_dir: Path, order: list[str], names: list[str],
              groups: list[StageGroup | None] | None = None, link_codecs: tuple[str, ...] = ()) -> None:
        """The placement changed: ``manifest``'s stages (built in ``plan_dir``) run on ``order``, named ``names``,
        with ``groups`` (none: one worker per stage) and the planner's ``link_codecs`` (none: the plan folder's)."""
        self.manifest, self.plan_dir, self.order, self.names = manifest, plan_dir, order, list(names)
        self.groups, self.link_codecs = list(groups or []), tuple(link_codecs)

    def group(self, stage: int) -> StageGroup | None:
        """The group holding ``stage`` (None: its worker ``order[stage]`` alone)."""
        return self.groups[stage] if stage < len(self.groups) else None

    def members(self, stage: int) -> tuple[str, ...]:
        """The URLs of the workers holding ``stage``, its holder of record first."""
        group = self.group(stage)
        return (self.order[stage],) if group is None else group.members

    def member_names(self) -> list[tuple[str, ...]]:
        """The names of the workers holding each stage (a group's members, else its one worker)."""
        return [tuple(self.known.get(url, "") for url in self.members(k)) for k in range(len(self.order))]

    def member_counts(self) -> list[int]:
        """How many workers hold each stage (the ledger waits for each one's report)."""
        return [len(self.members(k)) for k in range(len(self.order))]

    def placed(self) -> list[str]:
        """Every worker holding a stage, stage after stage."""
        return [url for k in range(len(self.order)) for url in self.members(k)]

    def urls_by_name(self) -> dict[str, str]:
        """Each known worker's URL, by its name."""
        return {name: url for url, name in self.known.items()}
