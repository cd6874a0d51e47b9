"""Stages held by groups of workers, as the plan's ``placement.json`` places them (docs/RUNTIME.md, "Groups").

:func:`planned_shares` reads each stage's members' shares from the plan; :func:`place_workers` splits
``--workers`` (every stage's members, in stage order) into the stages' holders of record and groups;
:func:`check_splittable` refuses a run whose micro-batches are too small for its groups; and
:func:`member_rows` says which rows of a step's batch a member gets in the coordinator's ``/batch``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgert.coordinator.errors import TrainingError
from edgert.errors import EdgertError
from edgert.exporter.device_plan import PLACEMENT_NAME, load_placement
from edgert.groups import StageGroup
from edgert.schedule import microbatches_per_step, split_batch


def planned_shares(plan_dir: Path, stages: int) -> list[tuple[float, ...]]:
    """Each stage's members' shares of every micro-batch, as ``placement.json`` gives them; one member
    per stage for a plan without groups or without ``placement.json``."""
    placement = load_placement(plan_dir)
    if placement is None:
        return [(1.0,)] * stages
    if len(placement.stages) != stages:
        raise TrainingError(f"{plan_dir / PLACEMENT_NAME}: {len(placement.stages)} stages for a plan of {stages}")
    for stage in placement.stages:
        counts = {len(values) for values in (stage.devices, stage.urls, stage.shares) if values}
        if len(counts) > 1:
            raise TrainingError(f"{plan_dir / PLACEMENT_NAME}: stage {stage.index} lists {len(stage.devices)} "
                                f"device(s), {len(stage.urls)} URL(s) and {len(stage.shares)} share(s)")
    return [stage.member_shares for stage in placement.stages]


def place_workers(workers: list[str], shares: list[tuple[float, ...]],
                  names: dict[str, str] | None = None) -> tuple[list[str], list[StageGroup | None]]:
    """``workers`` (every stage's members, stage after stage) as each stage's holder of record and group
    (None for a stage of one worker); ``names``: the workers' names, by URL, for the groups (TLS)."""
    needed = sum(len(s) for s in shares)
    if len(workers) != needed:
        grouped = [f"stage {k}: {len(s)}" for k, s in enumerate(shares) if len(s) > 1]
        detail = f" (groups in {PLACEMENT_NAME}: {', '.join(grouped)})" if grouped else ""
        raise TrainingError(f"the plan has {len(shares)} stages held by {needed} worker(s){detail} but "
                            f"{len(workers)} worker(s) were given; give every stage's members as --workers, "
                            f"in stage order")
    order, groups, start = [], [], 0
    for stage_shares in shares:
        members = tuple(workers[start:start + len(stage_shares)])
        start += len(stage_shares)
        order.append(members[0])
        try:
            group = StageGroup(members, tuple(stage_shares),
                               tuple(names.get(url, "") for url in members) if names else ())
        except EdgertError as error:
            raise TrainingError(f"stage {len(order) - 1}'s group: {error}") from None
        groups.append(group if len(members) > 1 else None)
    return order, groups


def check_splittable(groups: list[StageGroup | None], batch_size: int, micro_batches: int, schedule: str) -> None:
    """Every member of a group gets at least one row of the smallest micro-batch, or the run is refused."""
    largest = max((g.size for g in groups if g is not None), default=1)
    sizes = [m.size for m in split_batch(0, batch_size, microbatches_per_step(schedule, micro_batches))]
    if min(sizes) < largest:
        raise TrainingError(f"a micro-batch of {min(sizes)} sample(s) cannot be split across a group of {largest}: "
                            f"raise --batch-size or lower --micro-batches")


def without_failed(order: list[str], groups: list[StageGroup | None],
                   failed: set[str]) -> tuple[list[str], list[StageGroup | None]] | None:
    """The placement with the ``failed`` workers dropped from their groups, each group's share re-spread over
    the members left (in proportion to their shares): no re-cut (Asteroid). None when no group lost a member,
    or when a stage lost every worker (a re-cut is needed)."""
    new_order, new_groups, dropped = [], [], False
    for k, url in enumerate(order):
        group = groups[k] if k < len(groups) else None
        if group is None:
            if url in failed:
                return None
            new_order.append(url)
            new_groups.append(None)
            continue
        kept = [i for i, member in enumerate(group.members) if member not in failed]
        if not kept:
            return None
        dropped = dropped or len(kept) < group.size
        members = tuple(group.members[i] for i in kept)
        new_order.append(members[0])
        new_groups.append(None if len(kept) == 1 else StageGroup(
            members, tuple(group.shares[i] for i in kept), tuple(group.names[i] for i in kept) if group.names else ()))
    return (new_order, new_groups) if dropped else None


def groups_record(groups: list[StageGroup | None], known: dict[str, str]) -> dict[int, dict[str, list]]:
    """The ``groups`` field of ``stages_assigned`` and ``recovery`` (docs/RUNS.md): each group's workers and shares."""
    return {k: {"workers": [known.get(url, url) for url in group.members],
                "shares": [round(share / sum(group.shares), 6) for share in group.shares]}
            for k, group in enumerate(groups) if group is not None}


def member_rows(group: StageGroup | None, member: int, sizes: list[int]) -> np.ndarray:
    """The positions, in a step's batch made of micro-batches of ``sizes``, of the rows ``member`` owns."""
    if group is None:
        return np.arange(sum(sizes))
    rows, offset = [], 0
    for size in sizes:
        start, end = group.ranges(size)[member]
        rows.append(np.arange(offset + start, offset + end))
        offset += size
    return np.concatenate(rows)
