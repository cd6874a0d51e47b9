"""The copies a recovery rolls back to: where they are, which step they all cover, where to fetch them.

Every stage copies its state every few steps to the next workers (``--replicate-every``) and
to the coordinator (``--central-every``); after a failure (FTPipeHD, Asteroid):

- :func:`gather_holdings` asks every survivor which copies it holds;
- :func:`newest_snapshot` finds the newest step for which every parameter has a copy on
  some surviving holder (its own snapshot, a neighbour's replica, or the coordinator's):
  the consistent cut to roll back to;
- :func:`sources_for` tells each worker where to fetch its new stage's state as of that step.

:class:`CentralCopies` is the coordinator's own copy store, kept on disk only (written as the copies
arrive in pieces), so a restarted coordinator can resume from it.
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
from edgert.replica import SELF_ORIGIN, Holding, holdings_from_meta, picked
from edgert.transport import TensorClient, TransportError
from edgert.weights import StageState, load_state, save_state

COORDINATOR = "coordinator"  # the coordinator, as a holder of copies
KEEP_SNAPSHOTS = 2
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
    """The coordinator's copies, on disk only (``snapshots/``): written as they arrive, served from there
    (mapped, so they live in the page cache, never whole in the coordinator's heap), resumed from.

    A snapshot's folder, ``step_<t>/``, holds a ``stage<k>.cbor`` per stage; once it has every stage it
    gets the plan's ``manifest.json`` and :data:`COMPLETE_FILE`. The newest :data:`KEEP_SNAPSHOTS`
    complete ones are kept, and the copies of later steps still arriving.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self._held: dict[tuple[int, int], Holding] = {}  # (step, stage): the copy on disk

    def path(self, step: int, stage: int) -> Path:
        """Where the copy of ``stage`` after ``step`` is kept."""
        return self._step_dir(step) / f"stage{stage}.cbor"

    def put(self, state: StageState, origin: str, stages: int, manifest_text: str, plan_dir: str = "",
            on_disk: bool = False) -> bool:
        """Keep a copy of a stage of the plan ``manifest_text`` (of ``stages`` stages, built in ``plan_dir``): write
        it (unless it arrived in pieces straight into :meth:`path`, ``on_disk``); True when the step's snapshot
        became complete (every stage here)."""
        if not on_disk:
            save_state(state, self.path(state.step, state.stage))
        self._held[(state.step, state.stage)] = Holding(state.step, state.stage, origin, tuple(state.parameters),
                                                        state.bytes)
        if sum(1 for step, _ in self._held if step == state.step) < stages:
            return False
        step_dir = self._step_dir(state.step)
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
        self._held = {key: held for key, held in self._held.items() if self.path(*key).is_file()}

    def holdings(self) -> list[Holding]:
        return [held for _, held in sorted(self._held.items())]

    def get(self, step: int, names: list[str]) -> StageState:
        """The named parameters (and their optimizer state) as they were after ``step``, read from disk (only the
        files that hold some of them)."""
        wanted = set(names)
        files = [self.path(step, stage) for (held_step, stage), held in sorted(self._held.items())
                 if held_step == step and wanted & set(held.names)]
        return picked((load_state(path) for path in files), names, step)

    def snapshot(self, step: int, stages: int) -> list[StageState]:
        """Every stage's copy after ``step``, in stage order (the snapshot must be complete), mapped from disk."""
        return [load_state(self.path(step, stage)) for stage in range(stages)]

    def _step_dir(self, step: int) -> Path:
        """Where the copies after ``step`` are kept on disk."""
        return self.folder / f"step_{step:08d}"

    def _complete(self) -> list[Path]:
        """The folders of the complete snapshots on disk, oldest first."""
        return sorted(p.parent for p in self.folder.glob(f"step_*/{COMPLETE_FILE}"))

    def load_latest(self) -> StoredSnapshot | None:
        """The newest complete snapshot on disk, its copies listed for serving (None: there is none)."""
        complete = self._complete()
        if not complete:
            return None
        step_dir = complete[-1]
        info = json.loads((step_dir / COMPLETE_FILE).read_text())
        for path in sorted(step_dir.glob("stage*.cbor"), key=lambda p: int(p.stem.removeprefix("stage"))):
            state = load_state(path)
            self._held[(state.step, state.stage)] = Holding(state.step, state.stage, SELF_ORIGIN,
                                                            tuple(state.parameters), state.bytes)
        manifest = Manifest.from_json(json.loads((step_dir / MANIFEST_NAME).read_text()))
        return StoredSnapshot(int(info["step"]), manifest, Path(info.get("plan_dir", "")))
