"""Copies of stage states kept for recovery: a worker's own snapshots and its peers' replicas.

Every ``--replicate-every`` steps a worker snapshots its stage (parameters, running
statistics, optimizer state) after the optimizer step, keeps it, and sends it to the next
``--replicas`` workers in the ring; every ``--central-every`` steps also to the
coordinator (FTPipeHD). A copy is keyed by the step it was taken after and by the stage
(of the plan then in force) it came from; migration uses the parameter names inside, so a
copy stays usable across re-partitions. The store keeps the newest few versions per stage
and at most :data:`DEFAULT_MAX_PEER_BYTES` of copies from peers in all, refusing (never
swallowing memory) beyond it; a worker takes copies only of the stages :func:`held_stages`
names, with the origin its transport authenticated (docs/SECURITY.md, "Replicas").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from edgert.errors import EdgertError, ReplicaStoreFull
from edgert.weights import StageState

KEEP_VERSIONS = 2
SELF_ORIGIN = "self"
DEFAULT_MAX_PEER_BYTES = 256 << 20  # all copies from peers together (a worker's own are not counted)


@dataclass(frozen=True)
class Holding:
    """One copy a holder has: after which step, from which stage, which parameters."""

    step: int
    stage: int
    origin: str
    names: tuple[str, ...]
    bytes: int


class CopyStore:
    """Thread-safe store of stage states by (step, stage)."""

    def __init__(self, keep_versions: int = KEEP_VERSIONS, max_peer_bytes: int = DEFAULT_MAX_PEER_BYTES):
        self.keep_versions = keep_versions
        self.max_peer_bytes = max_peer_bytes
        self._copies: dict[tuple[int, int], tuple[StageState, str]] = {}
        self._reserved = 0  # bytes of copies from peers still arriving (in pieces)
        self._lock = threading.Lock()

    def reserve(self, size: int) -> Callable[[], None]:
        """Hold ``size`` bytes of room for a copy arriving in pieces; returns what gives them back."""
        with self._lock:
            self._reserved += size

        def release() -> None:
            with self._lock:
                self._reserved -= size

        return release

    def put(self, state: StageState, origin: str) -> None:
        """Keep ``state`` (taken after ``state.step``, of stage ``state.stage``) sent by ``origin``; the oldest
        versions of that stage beyond ``keep_versions`` go. Raises :class:`ReplicaStoreFull`, changing nothing,
        when copies from peers would exceed ``max_peer_bytes``."""
        key = (state.step, state.stage)
        with self._lock:
            steps = sorted({step for step, stage in self._copies if stage == state.stage} | {state.step}, reverse=True)
            evicted = {(old, state.stage) for old in steps[self.keep_versions:]}
            if origin != SELF_ORIGIN:
                used = state.bytes + sum(s.bytes for k, (s, o) in self._copies.items()
                                         if o != SELF_ORIGIN and k != key and k not in evicted)
                if used > self.max_peer_bytes:
                    raise ReplicaStoreFull(f"copies from peers would take {used} bytes here; the limit is "
                                           f"{self.max_peer_bytes}")
            self._copies[key] = (state, origin)
            for old in evicted:
                del self._copies[old]

    def room(self) -> int:
        """Bytes of copies from peers this store still takes."""
        with self._lock:
            return self.max_peer_bytes - self._reserved - sum(
                s.bytes for s, o in self._copies.values() if o != SELF_ORIGIN)

    def get(self, step: int, names: list[str]) -> StageState:
        """The named parameters (and their optimizer state) as they were after ``step``."""
        with self._lock:
            copies = [s for (s_step, _), (s, _) in self._copies.items() if s_step == step]
        return picked(copies, names, step)

    def state(self, step: int, stage: int) -> StageState:
        """The copy of ``stage`` after ``step``."""
        with self._lock:
            found = self._copies.get((step, stage))
        if found is None:
            raise EdgertError(f"no copy of stage {stage} after step {step} here")
        return found[0]

    def holdings(self) -> list[Holding]:
        with self._lock:
            return [Holding(step, stage, origin, tuple(state.parameters), state.bytes)
                    for (step, stage), (state, origin) in sorted(self._copies.items())]

    def clear(self) -> None:
        with self._lock:
            self._copies.clear()


def picked(copies: Iterable[StageState], names: list[str], step: int) -> StageState:
    """The named parameters (and their optimizer state) from ``copies`` (states after ``step``), each from the
    first copy that has it; every name must be somewhere."""
    found: dict = {}
    optimizer: dict = {}
    for state in copies:
        for name in names:
            if name in state.parameters and name not in found:
                found[name] = state.parameters[name]
                if name in state.optimizer:
                    optimizer[name] = state.optimizer[name]
    missing = [n for n in names if n not in found]
    if missing:
        raise EdgertError(f"no copy after step {step} of {', '.join(missing[:5])} here")
    return StageState(parameters=found, optimizer=optimizer, step=step)


def held_stages(stage: int, stages: int, replicas: int) -> set[int]:
    """The stages whose copies the worker of ``stage`` keeps: the ``replicas`` before it in the ring
    (first -> ... -> last -> first), as :func:`edgert.coordinator.assignment.ring_neighbours` sends them."""
    return {(stage - k) % stages for k in range(1, min(replicas, stages - 1) + 1)}


def holdings_to_meta(holdings: list[Holding]) -> list[list]:
    return [[h.step, h.stage, h.origin, list(h.names), h.bytes] for h in holdings]


def holdings_from_meta(rows: list) -> list[Holding]:
    return [Holding(int(step), int(stage), str(origin), tuple(names), int(size))
            for step, stage, origin, names, size in rows]
