"""The copies a recovery rolls back to: where they are, which step they all cover, where to fetch them.

Every stage copies its state every few steps to the next workers (``--replicate-every``) and
to the coordinator (``--central-every``); after a failure (FTPipeHD, Asteroid):

- :func:`gather_holdings` asks every survivor which copies it holds;
- :func:`newest_snapshot` finds the newest step for which every parameter has a copy on
  some surviving holder (its own snapshot, a neighbour's replica, or the coordinator's):
  the consistent cut to roll back to;
- :func:`sources_for` tells each worker where to fetch its new stage's state as of that step.

:class:`CentralCopies` is the coordinator's own copy store, kept on disk as well, so a
restarted coordinator can resume from it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from edgert.errors import EdgertError
from edgert.manifest import MANIFEST_NAME, Manifest
from edgert.protocol import REPLICA, SELF, MigrateRequest, MigrationSource
from edgert.replica import SELF_ORIGIN, CopyStore, Holding, holdings_from_meta
from edgert.transport import TensorClient, TransportError
from edgert.weights import StageState, load_state, save_state

COORDINATOR = "coordinator"  # the coordinator, as a holder of copies
KEEP_SNAPSHOTS = 2
CENTRAL_MAX_BYTES = 1 << 30  # the workers' copies the coordinator keeps in memory, every stage and version together
COMPLETE_FILE = "complete.json"  # in a snapshot's folder once every stage's copy is there: step, stages, plan_dir


async def gather_holdings(client: TensorClient, urls: list[str], run_id: str) -> dict[str, list[Holding]]:
    """Every surviving worker's copies of run ``run_id`` (GET /replica); a worker still in another
    run (an idle one that joined) holds none of this run's."""

    async def one(url: str) -> list[Holding]:
        try:
            response = await client.get(url, REPLICA, timeout=5.0, retries=1)
            envelope = response.envelope()
            if envelope.run_id != run_id:
                return []
            return holdings_from_meta(envelope.meta.get("holdings", []))
        except (TransportError, OSError):
            return []

    results = await asyncio.gather(*(one(url) for url in urls))
    return dict(zip(urls, results))


def newest_snapshot(holdings: dict[str, list[Holding]], names: set[str]) -> int | None:
    """The newest step after which every name in ``names`` has a copy somewhere, or None."""
    steps = sorted({h.step for copies in holdings.values() for h in copies}, reverse=True)
    for step in steps:
        covered = {n for copies in holdings.values() for h in copies if h.step == step for n in h.names}
        if names <= covered:
            return step
    return None


def sources_for(step: int, names: list[str], taker: str, holdings: dict[str, list[Holding]],
                coordinator_url: str) -> MigrateRequest:
    """Where ``taker`` fetches ``names`` as of ``step``: itself first, then a worker, then the coordinator."""
    ranked = sorted(holdings, key=lambda holder: (holder != taker, holder == COORDINATOR))
    by_holder: dict[str, list[str]] = {}
    for name in names:
        for holder in ranked:
            if any(h.step == step and name in h.names for h in holdings[holder]):
                by_holder.setdefault(holder, []).append(name)
                break
        else:
            raise EdgertError(f"no holder has {name!r} as of step {step}")
    sources = []
    for holder, wanted in by_holder.items():
        url = SELF if holder == taker else (coordinator_url if holder == COORDINATOR else holder)
        sources.append(MigrationSource(url, tuple(wanted), previous=False, copy_step=step))
    return MigrateRequest(tuple(sources))


@dataclass(frozen=True)
class StoredSnapshot:
    """A complete snapshot on disk: the step its copies were taken after, the plan they are of, where that
    plan was built (it may be gone)."""

    step: int
    manifest: Manifest
    plan_dir: Path


class CentralCopies:
    """The coordinator's copies: in memory for serving, on disk (``snapshots/``) for resuming.

    A snapshot's folder, ``step_<t>/``, holds a ``stage<k>.cbor`` per stage; once it has every stage it
    gets the plan's ``manifest.json`` and :data:`COMPLETE_FILE`. The newest :data:`KEEP_SNAPSHOTS`
    complete ones are kept.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self.store = CopyStore(keep_versions=KEEP_SNAPSHOTS, max_peer_bytes=CENTRAL_MAX_BYTES)

    def put(self, state: StageState, origin: str, stages: int, manifest_text: str, plan_dir: str = "") -> bool:
        """Keep a copy of a stage of the plan ``manifest_text`` (of ``stages`` stages, built in ``plan_dir``); True
        when the step's snapshot became complete (every stage here). Raises
        :class:`~edgert.replica.ReplicaStoreFull`, keeping nothing, beyond :data:`CENTRAL_MAX_BYTES`."""
        self.store.put(state, origin)
        step_dir = self._step_dir(state.step)
        save_state(state, step_dir / f"stage{state.stage}.cbor")
        have = len(list(step_dir.glob("stage*.cbor")))
        if have < stages:
            return False
        (step_dir / MANIFEST_NAME).write_text(manifest_text)
        (step_dir / COMPLETE_FILE).write_text(json.dumps({"step": state.step, "stages": stages,
                                                          "plan_dir": plan_dir}))
        self._prune()
        return True

    def _prune(self) -> None:
        complete = self._complete()
        for old in complete[:-KEEP_SNAPSHOTS]:
            shutil.rmtree(old, ignore_errors=True)
        newest = complete[-1].name if complete else None
        for partial in self.folder.glob("step_*"):
            if not (partial / COMPLETE_FILE).exists() and newest and partial.name < newest:
                shutil.rmtree(partial, ignore_errors=True)

    def holdings(self) -> list[Holding]:
        return self.store.holdings()

    def snapshot(self, step: int, stages: int) -> list[StageState]:
        """Every stage's copy after ``step``, in stage order (the snapshot must be complete):
        from memory, or from disk when newer copies have already taken their place there."""
        try:
            return [self.store.state(step, stage) for stage in range(stages)]
        except EdgertError:
            return [load_state(self._step_dir(step) / f"stage{stage}.cbor") for stage in range(stages)]

    def _step_dir(self, step: int) -> Path:
        """Where the copies after ``step`` are kept on disk."""
        return self.folder / f"step_{step:08d}"

    def _complete(self) -> list[Path]:
        """The folders of the complete snapshots on disk, oldest first."""
        return sorted(p.parent for p in self.folder.glob(f"step_*/{COMPLETE_FILE}"))

    def load_latest(self) -> StoredSnapshot | None:
        """The newest complete snapshot on disk, its copies put back in memory for serving (None: there is none)."""
        complete = self._complete()
        if not complete:
            return None
        step_dir = complete[-1]
        info = json.loads((step_dir / COMPLETE_FILE).read_text())
        for path in sorted(step_dir.glob("stage*.cbor"), key=lambda p: int(p.stem.removeprefix("stage"))):
            self.store.put(load_state(path), SELF_ORIGIN)
        manifest = Manifest.from_json(json.loads((step_dir / MANIFEST_NAME).read_text()))
        return StoredSnapshot(int(info["step"]), manifest, Path(info.get("plan_dir", "")))
