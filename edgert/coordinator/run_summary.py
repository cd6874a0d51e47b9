"""The end-of-run summary, computed from the run folder: the whole run, across resumes.

A run may span several coordinator processes (``edgert train --resume``) and recoveries;
the summary counts them all from ``metrics.jsonl`` (docs/RUNS.md), not from one process's
memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgert.coordinator.runlog import ROLLBACK_EVENTS, RUN_FILE, current_records, read_metrics


@dataclass
class RunSummary:
    """What ``edgert train --json`` prints."""

    run_dir: str
    steps: int
    epochs: int
    samples: int
    train_seconds: float
    samples_per_s: float
    train_loss: float | None
    test_loss: float | None
    test_accuracy: float | None
    stage_utilisation: list[float] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    schedule: str = ""
    replans: int = 0
    recoveries: int = 0
    links: list[dict[str, Any]] = field(default_factory=list)  # the last ``links`` event's (docs/RUNS.md)


def summarise(run_dir: Path) -> RunSummary:
    """The summary of the run in ``run_dir`` as its records stand.

    ``steps``: the steps the model has taken (every step before a rollback's ``resume_step``
    is in it, recorded or not); ``train_seconds``: the time of every segment that ran, replays
    and segments a failure cut short included, so ``samples_per_s`` is the rate the run achieved.
    """
    run_dir = Path(run_dir)
    run = json.loads((run_dir / RUN_FILE).read_text())
    config = run["config"]
    written = read_metrics(run_dir, superseded=True)
    kept = current_records(written)
    steps = _of_type(kept, "step")
    rollbacks = [r for r in kept if r.get("event") in ROLLBACK_EVENTS and "resume_step" in r]
    done = max([r["step"] + 1 for r in steps] + [r["resume_step"] for r in rollbacks], default=0)
    samples = done * int(config["batch_size"])  # every step trains one full batch (edgert/coordinator/data.py)
    seconds = _training_seconds(written)
    workers = _workers(steps, rollbacks, run.get("workers", []))
    busy: dict[str, float] = {}
    for record in _of_type(written, "step"):
        for stage in record["stages"]:
            busy[stage["worker"]] = busy.get(stage["worker"], 0.0) + sum(
                stage[key] for key in ("forward_ms", "backward_ms", "optimizer_ms"))
    evaluation = (_of_type(kept, "eval") or [{}])[-1]
    wall = max(seconds, 1e-9)
    return RunSummary(
        run_dir=str(run_dir), steps=done, epochs=int(config["epochs"]), samples=samples,
        train_seconds=round(seconds, 3), samples_per_s=round(samples / wall, 2),
        train_loss=steps[-1]["loss"] if steps else None, test_loss=evaluation.get("test_loss"),
        test_accuracy=evaluation.get("test_accuracy"),
        stage_utilisation=[round(busy.get(name, 0.0) / 1000 / wall, 4) for name in workers], workers=workers,
        schedule=str(config["schedule"]), replans=len(_events(written, "replan")),
        recoveries=len(_events(written, "recovery")), links=(_events(written, "links") or [{}])[-1].get("links", []))


def count_events(run_dir: Path, *names: str) -> list[int]:
    """How many events of each of ``names`` the run has recorded (none: no metrics yet)."""
    try:
        written = read_metrics(run_dir, superseded=True)
    except FileNotFoundError:
        written = []
    return [len(_events(written, name)) for name in names]


def joined_workers(run_dir: Path) -> dict[str, str]:
    """The workers (URL -> name) that joined the run in ``run_dir``, in any of its processes (a resume
    remembers them)."""
    try:
        written = read_metrics(run_dir, superseded=True)
    except FileNotFoundError:
        return {}
    return {r["url"]: r["worker"] for r in written if r.get("event") in ("join", "join_remembered")}


def _training_seconds(written: list[dict[str, Any]]) -> float:
    """The time every segment ran: its ``segment`` line, or, for one a killed coordinator never
    closed, up to its last ``step`` line."""
    segments: dict[float, float] = {}
    for record in _of_type(written, "step"):
        if "segment_started_s" in record:
            start = record["segment_started_s"]
            segments[start] = max(segments.get(start, 0.0), record["time_s"] - start)
    for record in _of_type(written, "segment"):
        segments[record["started_s"]] = record["seconds"]
    return sum(segments.values())


def _of_type(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("type") == kind]


def _events(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in _of_type(records, "event") if r.get("event") == name]


def _workers(steps: list[dict[str, Any]], rollbacks: list[dict[str, Any]], first: list[str]) -> list[str]:
    """The workers of the last placement, by stage (``first``: those the run started with)."""
    if steps and (not rollbacks or steps[-1]["time_s"] >= rollbacks[-1]["time_s"]):
        return [stage["worker"] for stage in steps[-1]["stages"]]
    if rollbacks:
        return list(rollbacks[-1]["workers"])
    return list(first)
