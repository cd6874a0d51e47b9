"""The exact dynamic programme over one device order, one layer per device (docs/PLANNER.md).

The order is read from the back of the pipeline: ``order[0]`` hosts the last stage, and the
pipeline uses a prefix ``order[:depth + 1]`` of it. Layer ``depth`` holds, for every group
size ``g`` (the stage on ``order[depth - g + 1 : depth + 1]``) and first unit ``j``, the best
value of placing units ``[j, U)`` on the devices ``order[:depth + 1]``:

    V[depth][g][j] = min over k > j, g' of  stage(group, j, k, rank) (+) link(group -> next, k) (+) V[depth - g][g'][k]

where ``(+)`` is ``max`` when minimising the bottleneck and ``+`` when minimising the
latency under a bottleneck cap (every term above the cap is ``inf``). The rank (stages
after this one, which sets the in-flight micro-batches) is ``depth - g + 1``: exact for
single devices, an upper bound when later stages are groups (memory only grows with it).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgert.exporter.planner.bounds import Used, WorkBounds
from edgert.exporter.planner.costs import Stage
from edgert.exporter.planner.tables import Tables

CACHE_NUMBERS = 4_000_000  # numbers each cache of OrderDP keeps, at most (32 MB)


class Layer(NamedTuple):
    values: np.ndarray  # (groups, U+1): row g-1 = the stage is a group of g devices ending at this depth
    cuts: np.ndarray  # (groups, U+1): the end k of that stage
    next_groups: np.ndarray  # (groups, U+1): by the next stage's first unit k, its group size
    used: Used  # totals over order[:depth + 1]
    bound: float  # lower bound on plans through a state (j >= 1) of this layer that use more devices


class OrderDP:
    """Layers of the DP for device orders; ``cap`` None minimises the bottleneck, else the latency."""

    def __init__(self, tables: Tables, max_group: int, cap: float | None = None, sorted_groups: bool = False):
        self.tables = tables
        self.max_group = max_group
        self.cap = cap
        # Searching all orders, a group need only be tried with its members in increasing
        # order, which also limits how far back a later group can reach (see subtree_bound).
        self.sorted_groups = sorted_groups
        # Stage times depend on the member set and rank, links on the member set and the receivers
        # in order, a group's row on the devices before it and its member set: orders share them.
        self._stages = _Cache()
        self._links = _Cache()
        self._rows = _Cache()
        self._bounds = WorkBounds(tables, max_group)
        size = tables.units + 1
        self._rows_index = np.arange(size)
        self._last_cuts = np.full(size, tables.units)
        self._no_groups = np.zeros(size, dtype=np.int64)
        self._single_groups = np.ones(size, dtype=np.int64)
        self._unsorted_row = (np.full(size, np.inf), self._no_groups, self._no_groups)
        self.layers_built = 0

    def layer(self, order: list[int], layers: list[Layer]) -> Layer:
        """Layer ``len(layers)`` for ``order`` (only ``order[:len(layers) + 1]`` is read)."""
        depth = len(layers)
        self.layers_built += 1
        if self.max_group == 1:
            columns = [column[None] for column in self._single_row(order, layers, depth)]
        else:
            rows = [self._group_row(order, layers, depth, g) for g in range(1, min(depth + 1, self.max_group) + 1)]
            columns = [np.stack(column) for column in zip(*rows)]
        used = self._bounds.grow(layers[-1].used if layers else Used(), order[depth])
        return Layer(*columns, used, self._bounds.through(columns[0], used, order, self.cap))

    def stages(self, order: list[int], layers: list[Layer], group: int) -> list[Stage]:
        """The stages, in pipeline order, of the complete plan at the last layer with that group size."""
        depth, first, result = len(layers) - 1, 0, []
        while True:
            layer = layers[depth]
            end = int(layer.cuts[group - 1][first])
            rank = depth - group + 1
            result.append((first, end, tuple(order[rank:depth + 1])))
            if rank == 0:
                return result
            depth, group, first = rank - 1, int(layer.next_groups[group - 1][end]), end

    def subtree_bound(self, order: list[int], layers: list[Layer]) -> float:
        """A lower bound on every plan that uses more devices than ``order[:len(layers)]``."""
        depth = len(layers) - 1
        if depth + 1 >= self.tables.devices:
            return np.inf
        # A later stage on devices order[rank..] (rank <= depth + 1) continues from layer rank - 1.
        earliest_rank = max(depth + 2 - self.max_group, self._sorted_run_start(order, depth))
        bound = min(layer.bound for layer in layers[max(earliest_rank - 1, 0):])
        if earliest_rank <= 0:  # the last stage may be a group reaching past this prefix
            bound = min(bound, self._bounds.any_plan)
        return bound

    def _sorted_run_start(self, order: list[int], depth: int) -> int:
        """The first position of the increasing run ending at ``depth`` (0 when groups need not be sorted)."""
        if not self.sorted_groups:
            return 0
        start = depth
        while start > 0 and order[start - 1] < order[start]:
            start -= 1
        return start

    def _single_row(self, order: list[int], layers: list[Layer], depth: int):
        """:meth:`_group_row` for one device: the hot path of searches without groups."""
        device = order[depth]
        if depth == 0:
            return self._last_stage([device]), self._last_cuts, self._no_groups
        stage = self._stages.get((device, depth), lambda: self._compute_stage([device], depth))
        link = self._links.get((device, order[depth - 1]), lambda: self._group_links([device], [order[depth - 1]])[0])
        after = layers[-1].values[0]
        total = np.maximum(stage, np.maximum(link, after)) if self.cap is None else stage + (link + after)
        cuts = total.argmin(axis=1)
        return total[self._rows_index, cuts], cuts, self._single_groups

    def _group_row(self, order: list[int], layers: list[Layer], depth: int, g: int):
        """(values, cuts, next groups) over j for the stage on the ``g`` devices ending at ``depth``."""
        if g == 1:
            return self._compute_row(order, layers, depth, g)
        rank = depth - g + 1
        if self._sorted_run_start(order, depth) > rank:
            return self._unsorted_row
        key = (tuple(order[:rank]), frozenset(order[rank:depth + 1]))
        return self._rows.get(key, lambda: self._compute_row(order, layers, depth, g))

    def _compute_row(self, order: list[int], layers: list[Layer], depth: int, g: int):
        rank = depth - g + 1
        members = order[rank:depth + 1]
        if rank == 0:
            return self._last_stage(members), self._last_cuts, self._no_groups
        stage = self._stage(members, rank)
        after, after_group = self._after(order, members, rank, layers[rank - 1])
        total = np.maximum(stage, after) if self.cap is None else stage + after
        cuts = total.argmin(axis=1)
        return total[self._rows_index, cuts], cuts, after_group

    def _stage(self, members: list[int], rank: int) -> np.ndarray:
        key = (members[0], rank) if len(members) == 1 else (frozenset(members), rank)
        return self._stages.get(key, lambda: self._compute_stage(members, rank))

    def _compute_stage(self, members: list[int], rank: int) -> np.ndarray:
        """Stage time of every range [j, k) on the group at that rank, ``inf`` where it does not fit."""
        fits = self.tables.max_rank[members].min(axis=0) >= rank
        with np.errstate(divide="ignore"):
            work = self.tables.work[members[0]] if len(members) == 1 else (
                1.0 / self.tables.speed[members].sum(axis=0) + self._allreduce(members))
        return self._bounded(np.where(fits, work, np.inf))

    def _last_stage(self, members: list[int]) -> np.ndarray:
        return self._stages.get(("last", frozenset(members)), lambda: self._compute_last_stage(members))

    def _compute_last_stage(self, members: list[int]) -> np.ndarray:
        """Last-stage time of every range [j, U) on the group, ``inf`` where it does not fit."""
        fits = self.tables.max_rank[members][:, :, -1].min(axis=0) >= 0
        with np.errstate(divide="ignore"):
            work = 1.0 / (1.0 / self.tables.last_work[members]).sum(axis=0)
        work = work + self.tables.params[:, -1] * self.tables.allreduce(members)
        return self._bounded(np.where(fits, work, np.inf))

    def _allreduce(self, members: list[int]) -> np.ndarray | float:
        factor = self.tables.allreduce(members)
        return self.tables.params * factor if factor else 0.0

    def _after(self, order: list[int], members: list[int], rank: int, layer: Layer) -> tuple[np.ndarray, np.ndarray]:
        """Per next-stage first unit k: the best of link + rest over the next stage's group size."""
        if layer.values.shape[0] == 1 and len(members) == 1:
            link = self._links.get((members[0], order[rank - 1]),
                                   lambda: self._group_links(members, [order[rank - 1]])[0])
            values = np.maximum(link, layer.values[0]) if self.cap is None else link + layer.values[0]
            return values, self._single_groups
        receivers = order[rank - layer.values.shape[0]:rank][::-1]  # the next group grows backwards from rank-1
        links = self._links.get((frozenset(members), tuple(receivers)), lambda: self._group_links(members, receivers))
        candidates = np.maximum(links, layer.values) if self.cap is None else links + layer.values
        best = candidates.argmin(axis=0)
        return candidates[best, np.arange(candidates.shape[1])], best + 1

    def _group_links(self, members: list[int], receivers: list[int]) -> np.ndarray:
        """Row g'-1: link time from the group to the first g' receivers (the slowest pair decides)."""
        per_receiver = self.tables.links[:, members][:, :, receivers].max(axis=1)  # (codecs, receivers, U+1)
        links = np.maximum.accumulate(per_receiver, axis=1)
        return links[-1] if self.cap is None else self._weakest_within_cap(links)

    def _weakest_within_cap(self, link: np.ndarray) -> np.ndarray:
        """Link time with the weakest codec that keeps it within the cap (inf if none does)."""
        chosen = np.full(link.shape[1:], np.inf)
        for times in link[::-1]:
            chosen = np.where(times <= self.cap, times, chosen)
        return chosen

    def _bounded(self, times: np.ndarray) -> np.ndarray:
        return times if self.cap is None else np.where(times <= self.cap, times, np.inf)


class _Cache:
    """A dict of arrays (or tuples of arrays) that forgets everything when it holds too many numbers."""

    def __init__(self, numbers: int = CACHE_NUMBERS):
        self.numbers, self.held = numbers, 0
        self.entries: dict = {}

    def get(self, key, compute):
        value = self.entries.get(key)
        if value is None:
            value = compute()
            size = sum(np.size(part) for part in value) if isinstance(value, tuple) else np.size(value)
            if self.held + size > self.numbers:
                self.entries.clear()
                self.held = 0
            self.entries[key] = value
            self.held += size
        return value
