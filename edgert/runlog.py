"""The run folder: ``run.json``, ``metrics.jsonl``, ``trace.json`` (docs/RUNS.md).

``metrics.jsonl`` gets one JSON object per line as the run goes (steps, evaluations,
events), so a crashed run still leaves its history. ``trace.json`` is Chrome trace-event
format, one track per stage, viewable in Perfetto or chrome://tracing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class RunLog:
    """Appends metrics and collects trace events for one run folder."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._trace: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "edgert pipeline"}}]
        self._tracks: set[int] = set()

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        path = self.run_dir / name
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        return path

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one line ``{"type": kind, "time_s": ..., **fields}`` to metrics.jsonl."""
        line = {"type": kind, "time_s": round(time.time() - self.started, 6), **fields}
        self._metrics.write(json.dumps(line, default=_jsonable) + "\n")
        return line

    def event(self, name: str, **fields: Any) -> None:
        """An event (re-plan, recovery, ...): a metrics line and an instant on the trace."""
        self.record("event", event=name, **fields)
        self._trace.append({"name": name, "ph": "i", "s": "g", "pid": 1, "tid": 0,
                            "ts": (time.time() - self.started) * 1e6, "args": fields})

    def spans(self, stage: int, label: str, spans: list[tuple[str, float, float]]) -> None:
        """Add a stage's timed spans (name, wall-clock start, seconds) to its track."""
        tid = stage + 1
        if tid not in self._tracks:
            self._tracks.add(tid)
            self._trace.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                                "args": {"name": f"stage {stage} ({label})"}})
        for name, start, duration in spans:
            category = "wait" if name.startswith("wait") else "compute"
            self._trace.append({"name": name, "cat": category, "ph": "X", "pid": 1, "tid": tid,
                                "ts": round((start - self.started) * 1e6, 1), "dur": round(duration * 1e6, 1)})

    def close(self) -> None:
        """Write trace.json and close metrics.jsonl."""
        (self.run_dir / "trace.json").write_text(json.dumps({"traceEvents": self._trace,
                                                             "displayTimeUnit": "ms"}))
        self._metrics.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every line of a run's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
