"""``trace.json`` written as the run goes: Chrome trace events in the JSON array format.

The file is ``[`` and then one event per line (every line after the first event starts
with a comma), so it is on disk as soon as the spans arrive, the coordinator holds none of
them, and a run killed with ``kill -9`` leaves a trace that lacks only the closing ``]``,
which the JSON array format allows (Perfetto and chrome://tracing read it; so does
:func:`read_trace`). A resumed run appends to it. Each worker has its own track, named by
the worker, so a stage's spans land on the track of the worker that ran them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROCESS = {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "edgert pipeline"}}
EVENTS_TRACK = 0  # instants (re-plans, recoveries) go on track 0; workers' tracks start at 1
EVENTS = {"name": "thread_name", "ph": "M", "pid": 1, "tid": EVENTS_TRACK, "args": {"name": "events"}}


class TraceWriter:
    """Appends events to a trace file; holds only the track of each worker, never the events."""

    def __init__(self, path: Path, started: float):
        self.path = Path(path)
        self.started = started  # wall-clock time the run started: ts 0 (a resumed run keeps it)
        self._tracks: dict[str, int] = {}
        self._empty = not _opened(self.path)
        if not self._empty:  # a resumed run: its workers keep their tracks
            self._tracks = {e["args"]["name"]: e["tid"] for e in _iter_events(self.path, "thread_name")
                            if e["tid"] != EVENTS_TRACK}
            _drop_closing(self.path)
        self._file = open(self.path, "w" if self._empty else "a")
        if self._empty:
            self._file.write("[")
            self._write([PROCESS, EVENTS])

    def instant(self, name: str, at: float, fields: dict[str, Any]) -> None:
        """An event of the run at wall-clock time ``at``."""
        self._write([{"name": name, "ph": "i", "s": "g", "pid": 1, "tid": EVENTS_TRACK,
                      "ts": round((at - self.started) * 1e6, 1), "args": fields}])

    def spans(self, worker: str, stage: int, spans: list[tuple[str, float, float]]) -> None:
        """A worker's timed spans (name, wall-clock start, seconds) of ``stage``, on the worker's track."""
        events = []
        tid = self._tracks.get(worker)
        if tid is None:
            tid = self._tracks[worker] = len(self._tracks) + 1
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": worker}})
        for name, start, duration in spans:
            category = "wait" if name.startswith("wait") else "compute"
            events.append({"name": name, "cat": category, "ph": "X", "pid": 1, "tid": tid,
                           "ts": round((start - self.started) * 1e6, 1), "dur": round(duration * 1e6, 1),
                           "args": {"stage": stage}})
        self._write(events)

    def close(self) -> None:
        """End the array: the file is then plain JSON."""
        self._file.write("\n]\n")
        self._file.close()

    def _write(self, events: list[dict[str, Any]]) -> None:
        lines = []
        for event in events:
            lines.append(("\n" if self._empty else "\n,") + json.dumps(event, default=str))
            self._empty = False
        self._file.write("".join(lines))
        self._file.flush()


def read_trace(path: Path) -> list[dict[str, Any]]:
    """Every event of a trace file, also one a killed run left without its closing bracket."""
    return list(_iter_events(Path(path)))


def _opened(path: Path) -> bool:
    """Whether ``path`` is a trace already begun (its first byte is the array's bracket)."""
    try:
        with open(path, "rb") as stream:
            return stream.read(1) == b"["
    except FileNotFoundError:
        return False


def _iter_events(path: Path, name: str | None = None) -> Iterator[dict[str, Any]]:
    """The events in the file (only those called ``name``, if given), one line at a time."""
    with open(path) as stream:
        for line in stream:
            if name is not None and f'"{name}"' not in line:
                continue
            text = line.strip().lstrip("[,").strip()
            if not text.startswith("{"):
                continue
            try:
                event = json.loads(text)
            except json.JSONDecodeError:
                return  # the last line of a run killed while writing it
            if name is None or event.get("name") == name:
                yield event


def _drop_closing(path: Path, tail: int = 1 << 20) -> None:
    """Make the file end after its last whole event (no closing bracket, no cut line), to append to it."""
    with open(path, "rb+") as stream:
        offset = max(stream.seek(0, 2) - tail, 0)
        stream.seek(offset)
        data = stream.read()
        end = len(data)
        while end > 0:
            start = data.rfind(b"\n", 0, end) + 1
            text = data[start:end].strip().lstrip(b",").strip()
            if text == b"[" or _parses(text):
                break
            end = max(start - 1, 0)
        stream.truncate(offset + end)


def _parses(text: bytes) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
