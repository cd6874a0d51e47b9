"""Data-parallel groups: a stage held by several workers that split every micro-batch (Asteroid, DLion).

A :class:`StageGroup` names the workers holding one stage and each one's share of every micro-batch.
:func:`share_rows` turns the shares into whole rows of a micro-batch of a given size, the same on
every worker and the coordinator (largest remainder, every member at least one row), so member
``i`` owns rows ``row_ranges(...)[i]`` of it. :class:`StageRouting` is what one member derives from
its assignment: its own rows, the row pieces it receives from each neighbouring stage's members and
the pieces it sends them (the intersections of the two stages' row ranges), so no member forwards
another's tensors (docs/RUNTIME.md, "Groups").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from edgert.errors import EdgertError, ProtocolError
from edgert.typed_data import satisfies

Rows = tuple[int, int]  # [start, end) rows of a micro-batch


@dataclass(frozen=True)
class StageGroup:
    """The workers (URLs) holding one stage, in order (the first is the group's holder of record), each
    one's share of every micro-batch (positive; normalised by their sum) and, over TLS, credential names."""

    members: tuple[str, ...] = field(metadata=satisfies(lambda urls: len(urls) >= 1 and len(set(urls)) == len(urls),
                                                        "must be one or more distinct worker URLs"))
    shares: tuple[float, ...] = field(metadata=satisfies(lambda s: all(v > 0 and math.isfinite(v) for v in s),
                                                         "must be positive numbers"))
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(set(self.members)) != len(self.members):
            raise ProtocolError(f"group members must be one or more distinct worker URLs: {list(self.members)}")
        if not all(share > 0 and math.isfinite(share) for share in self.shares):
            raise ProtocolError(f"group shares must be positive numbers: {list(self.shares)}")
        if len(self.shares) != len(self.members):
            raise ProtocolError(f"group of {len(self.members)} member(s) has {len(self.shares)} share(s)")
        if self.names and len(self.names) != len(self.members):
            raise ProtocolError(f"group of {len(self.members)} member(s) has {len(self.names)} name(s)")

    @property
    def size(self) -> int:
        return len(self.members)

    def ranges(self, rows: int) -> list[Rows]:
        """Each member's rows of a micro-batch of ``rows`` samples."""
        return row_ranges(self.shares, rows)


def single(url: str | None) -> StageGroup | None:
    """A stage held by one worker, as a group of one (None for no worker)."""
    return None if url is None else StageGroup((url,), (1.0,))


def share_rows(shares: tuple[float, ...] | list[float], rows: int) -> list[int]:
    """Whole rows of a ``rows``-sample micro-batch per share: largest remainder, ties to the lower index,
    each member at least one row; raises when there are fewer rows than members."""
    if rows < len(shares):
        raise EdgertError(f"a micro-batch of {rows} sample(s) cannot be split across a group of {len(shares)}: "
                          f"every member needs at least one row (raise the batch size or lower --micro-batches)")
    total = float(sum(shares))
    exact = [share / total * rows for share in shares]
    counts = [max(1, math.floor(value)) for value in exact]
    while sum(counts) < rows:  # the largest remainders get a row more
        counts[max(range(len(counts)), key=lambda i: (exact[i] - counts[i], -i))] += 1
    while sum(counts) > rows:  # minimum rows pushed the sum over: the smallest remainders give one back
        counts[min((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: (exact[i] - counts[i], i))] -= 1
    return counts


def row_ranges(shares: tuple[float, ...] | list[float], rows: int) -> list[Rows]:
    """Each share's ``[start, end)`` rows of a ``rows``-sample micro-batch, in member order."""
    ranges, start = [], 0
    for count in share_rows(shares, rows):
        ranges.append((start, start + count))
        start += count
    return ranges


def overlaps(own: Rows, theirs: list[Rows]) -> list[tuple[int, int, int]]:
    """``(member, start, end)`` for every range of ``theirs`` that meets ``own``, clipped to it, in row order."""
    pieces = []
    for member, (start, end) in enumerate(theirs):
        low, high = max(own[0], start), min(own[1], end)
        if low < high:
            pieces.append((member, low, high))
    return pieces


@dataclass(frozen=True)
class StageRouting:
    """One member's view of the rows it owns and exchanges: its ``group`` (None: a stage of one worker),
    its index in it, and the groups of the previous and next stages (None: the first or last stage)."""

    group: StageGroup | None
    member: int
    previous: StageGroup | None
    next: StageGroup | None

    @property
    def grouped(self) -> bool:
        """Whether this stage is held by more than one worker."""
        return self.group is not None and self.group.size > 1

    def split(self, link: str) -> bool:
        """Whether the link to the ``link`` neighbour ("previous" or "next") carries row pieces:
        either side is a group of several."""
        neighbour = getattr(self, link)
        return neighbour is not None and (self.grouped or neighbour.size > 1)

    def own(self, rows: int) -> Rows:
        """This member's rows of a micro-batch of ``rows`` samples."""
        if self.group is None:
            return (0, rows)
        return self.group.ranges(rows)[self.member]

    def pieces(self, link: str, rows: int) -> list[tuple[str, int, int]]:
        """``(url, start, end)``: the rows of a ``rows``-sample micro-batch this member exchanges with each
        member of the ``link`` neighbour (receives from it, sends to it), in row order."""
        neighbour = getattr(self, link)
        if neighbour is None:
            return []
        return [(neighbour.members[j], start, end)
                for j, start, end in overlaps(self.own(rows), neighbour.ranges(rows))]

    def fraction(self, rows: int) -> float:
        """This member's share of a ``rows``-sample micro-batch, as rows it owns over ``rows``."""
        start, end = self.own(rows)
        return (end - start) / rows
