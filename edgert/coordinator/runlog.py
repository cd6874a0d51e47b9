"""The run folder: ``run.json``, ``metrics.jsonl``, ``trace.json`` (docs/RUNS.md).

``metrics.jsonl`` gets one JSON object per line as the run goes (steps, evaluations,
events), so a crashed run still leaves its history; ``trace.json`` is streamed the same
way (edgert/coordinator/tracefile.py). Nothing that grows with the steps is kept in memory. A resumed
run appends to both, with times counted from the run's first start. A folder holds one
run: :func:`claim_run_folder` refuses one that already holds another.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from edgert.coordinator.errors import TrainingError
from edgert.coordinator.tracefile import TraceWriter
from edgert.models.data_settings import DATA_FILE

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
TRACE_FILE = "trace.json"
# what a run writes into its folder (docs/RUNS.md); --overwrite removes exactly these
RUN_RECORDS = (RUN_FILE, METRICS_FILE, TRACE_FILE, "checkpoints", "snapshots", "plans", "stage-cache", "profile",
               "devices.json", DATA_FILE)
ROLLBACK_EVENTS = ("recovery", "resume")  # events whose resume_step supersedes later step and eval records
REPLAYED_TYPES = ("step", "eval")


def new_run_id() -> str:
    """An id no other run has: workers keep and serve copies of one run only (docs/FAULTS.md)."""
    return uuid.uuid4().hex


def new_run_folder(parent: Path = Path("runs"), prefix: str = "") -> Path:
    """A fresh folder ``parent/<prefix><date>-<n>``, created here, so two runs never share it."""
    parent.mkdir(parents=True, exist_ok=True)
    day = time.strftime("%Y-%m-%d")
    for n in itertools.count(1):
        folder = parent / f"{prefix}{day}-{n}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run's records already."""
    return any((Path(folder) / name).exists() for name in (RUN_FILE, METRICS_FILE, TRACE_FILE))


def claim_run_folder(folder: Path, overwrite: bool = False) -> None:
    """Make ``folder`` the folder of a new run: refuse one holding another run, unless ``overwrite``
    (then that run's records go)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise TrainingError(f"--out {folder}: not a folder")
    if not holds_run(folder):
        return
    if not overwrite:
        raise TrainingError(f"--out {folder} already holds a run; continue it with --resume {folder}, "
                            f"replace it with --overwrite, or choose another --out")
    for name in RUN_RECORDS:
        path = folder / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


class RunLog:
    """Appends metrics and trace events to one run folder."""

    def __init__(self, run_dir: Path, started: float | None = None):
        """``started``: the run's first start (wall clock), kept by a resumed run; default now."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        opened = time.time()
        self.started = opened if started is None else started
        self.opened_s = round(opened - self.started, 6)  # when this process opened the folder, as a time_s
        metrics = self.run_dir / METRICS_FILE
        _drop_cut_line(metrics)
        self._metrics = open(metrics, "a", buffering=1)
        self.trace = TraceWriter(self.run_dir / TRACE_FILE, self.started)

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        path = self.run_dir / name
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        return path

    def elapsed(self) -> float:
        """Seconds since the run first started: the ``time_s`` of a line written now."""
        return round(time.time() - self.started, 6)

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one line ``{"type": kind, "time_s": ..., **fields}`` to metrics.jsonl."""
        line = {"type": kind, "time_s": self.elapsed(), **fields}
        self._metrics.write(json.dumps(line, default=_jsonable) + "\n")
        return line

    def event(self, name: str, **fields: Any) -> None:
        """An event (re-plan, recovery, ...): a metrics line and an instant on the trace."""
        self.record("event", event=name, **fields)
        self.trace.instant(name, time.time(), fields)

    def spans(self, stage: int, worker: str, spans: list[tuple[str, float, float]]) -> None:
        """A stage's timed spans (name, wall-clock start, seconds), on the track of the worker that ran them."""
        self.trace.spans(worker, stage, spans)

    def close(self) -> None:
        """Close trace.json and metrics.jsonl."""
        self.trace.close()
        self._metrics.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _drop_cut_line(path: Path) -> None:
    """Cut a last line a killed run left unfinished, so appended lines start on a line of their own."""
    if not path.is_file():
        return
    with open(path, "rb+") as stream:
        size = stream.seek(0, 2)
        if size == 0:
            return
        stream.seek(max(size - (1 << 20), 0))
        tail = stream.read()
        if not tail.endswith(b"\n"):
            stream.truncate(size - len(tail) + tail.rfind(b"\n") + 1)


def read_metrics(run_dir: Path, superseded: bool = False) -> list[dict[str, Any]]:
    """A run's metrics.jsonl as a reader sees it: each step and evaluation once, as last run
    (``superseded``: every line as written, replays and all)."""
    records = []
    with open(Path(run_dir) / METRICS_FILE) as stream:
        for line in stream:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the last line of a run killed while writing it
    return records if superseded else current_records(records)


def current_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop the records a later rollback superseded (docs/RUNS.md, "Replayed steps").

    A ``recovery`` or ``resume`` event with ``resume_step`` R means the steps from R on ran
    again: the earlier ``step`` and ``eval`` records of those steps no longer count.
    """
    kept: list[dict[str, Any]] = []
    for record in records:
        if record.get("type") == "event" and record.get("event") in ROLLBACK_EVENTS and "resume_step" in record:
            again = record["resume_step"]
            kept = [r for r in kept if r.get("type") not in REPLAYED_TYPES or r.get("step", -1) < again]
        kept.append(record)
    return kept
