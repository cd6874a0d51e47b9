"""Copies of stage states kept for recovery: a worker's own snapshots and its peers' replicas.

Every ``--replicate-every`` steps a worker snapshots its stage (parameters, running
statistics, optimizer state) after the optimizer step, keeps it, and sends it to the next
``--replicas`` workers in the ring; every ``--central-every`` steps also to the
coordinator (FTPipeHD). A copy is keyed by the step it was taken after and by the stage
(of the plan then in force) it came from; migration uses the parameter names inside, so a
copy stays usable across re-partitions. The store keeps the newest few versions per stage
and a byte budget per origin, refusing (never swallowing memory) beyond it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from edgert.errors import EdgertError
from edgert.weights import StageState

KEEP_VERSIONS = 2
SELF_ORIGIN = "self"
DEFAULT_MAX_BYTES = 1 << 30


class ReplicaStoreFull(EdgertError):
    """A peer sent more replica bytes than this worker keeps for it."""


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

    def __init__(self, keep_versions: int = KEEP_VERSIONS, max_bytes_per_origin: int = DEFAULT_MAX_BYTES):
        self.keep_versions = keep_versions
        self.max_bytes_per_origin = max_bytes_per_origin
        self._copies: dict[tuple[int, int], tuple[StageState, str]] = {}
        self._lock = threading.Lock()

    def put(self, state: StageState, origin: str) -> None:
        """Keep ``state`` (taken after ``state.step``, of stage ``state.stage``) sent by ``origin``."""
        with self._lock:
            self._copies[(state.step, state.stage)] = (state, origin)
            steps = sorted({step for step, stage in self._copies if stage == state.stage}, reverse=True)
            for old in steps[self.keep_versions:]:
                del self._copies[(old, state.stage)]
            used = sum(s.bytes for s, o in self._copies.values() if o == origin)
            if used > self.max_bytes_per_origin:
                del self._copies[(state.step, state.stage)]
                raise ReplicaStoreFull(f"replicas from {origin} would take {used} bytes here; the limit is "
                                       f"{self.max_bytes_per_origin}")

    def get(self, step: int, names: list[str]) -> StageState:
        """The named parameters (and their optimizer state) as they were after ``step``."""
        with self._lock:
            copies = [s for (s_step, _), (s, _) in self._copies.items() if s_step == step]
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


def holdings_to_meta(holdings: list[Holding]) -> list[list]:
    return [[h.step, h.stage, h.origin, list(h.names), h.bytes] for h in holdings]


def holdings_from_meta(rows: list) -> list[Holding]:
    return [Holding(int(step), int(stage), str(origin), tuple(names), int(size))
            for step, stage, origin, names, size in rows]
