"""Kill worker processes at a chosen point of a running job, and time what follows.

For the fault tests (tests/runtime/test_faults.py) and the recovery benchmark
(edgert.bench.recovery): a job (a training run) runs in a thread while this module
watches its ``metrics.jsonl`` and the first victim's ``/health``, sends SIGKILL to the
victims once a condition holds (e.g. "step 12 completed and the victim is computing a
forward"), then keeps reading the metrics as they are written, noting when each line
appeared, so the wall-clock time from the kill to the first step after the recovery can
be read off afterwards.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from edgert.coordinator.localcluster import LocalCluster
from edgert.errors import EdgertError
from edgert.protocol import HEALTH, Health
from edgert.transport import SyncClient
from edgert.transport.tls import TlsCredentials

T = TypeVar("T")
KillCondition = Callable[[Health, int], bool]  # (health of the first victim, last completed step) -> kill now


class MetricsTail:
    """Reads a run's ``metrics.jsonl`` as it grows; each record comes with the monotonic time it was seen."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.records: list[tuple[float, dict[str, Any]]] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        """The records written since the last call."""
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self._offset)
                chunk = stream.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        seen = time.monotonic()
        fresh = [json.loads(line) for line in lines if line.strip()]
        self.records.extend((seen, record) for record in fresh)
        return fresh

    @property
    def last_step(self) -> int:
        """The newest completed step recorded so far (-1: none)."""
        return next((r["step"] for _, r in reversed(self.records) if r["type"] == "step"), -1)


@dataclass
class Kill:
    """When and where the victims were killed, and what the run recorded afterwards."""

    victims: list[int]
    at: float  # time.monotonic() just before the first SIGKILL
    step: int  # the newest completed step recorded at that moment
    activity: str  # what the first victim was doing (its /health activity)
    after: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (seen at, record) since the kill

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for _, r in self.after if r["type"] == "event" and r.get("event") == name]

    def resumed_after_s(self, event: str = "recovery") -> float | None:
        """Seconds from the kill until the first step recorded after the last ``event`` (None: no such step)."""
        marks = [k for k, (_, r) in enumerate(self.after) if r["type"] == "event" and r.get("event") == event]
        if not marks:
            return None
        first = next(((seen, r) for seen, r in self.after[marks[-1] + 1:] if r["type"] == "step"), None)
        return None if first is None else first[0] - self.at


@dataclass
class Outcome(Generic[T]):
    result: T
    kill: Kill


def run_and_kill(job: Callable[[], T], cluster: LocalCluster, run_dir: Path, victims: list[int],
                 when: KillCondition, timeout: float = 120.0, join_timeout: float = 300.0,
                 poll_s: float = 0.0, on_kill: Callable[[], None] | None = None,
                 tls: TlsCredentials | None = None) -> Outcome[T]:
    """Run ``job`` in a thread; SIGKILL ``cluster``'s ``victims`` once ``when`` holds; return its result.

    ``when`` gets the first victim's health and the newest completed step of the run in
    ``run_dir``; it is asked every ``poll_s`` seconds (0: as fast as the victim answers).
    ``on_kill`` runs right after the SIGKILLs (e.g. to kill a coordinator process too).
    ``tls``: credentials to ask a ``coaps+tcp`` cluster's victim with (the coordinator's).
    An exception of ``job`` is raised here.
    """
    outcome: dict[str, Any] = {}

    def go() -> None:
        try:
            outcome["result"] = job()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = error

    tail = MetricsTail(run_dir)
    thread = threading.Thread(target=go, name="edgert-job", daemon=True)
    thread.start()
    kill = None
    with SyncClient.start(tls=tls) as client:
        deadline = time.monotonic() + timeout
        while kill is None and thread.is_alive() and time.monotonic() < deadline:
            tail.poll()
            try:
                health = Health.from_envelope(client.get(cluster.urls[victims[0]], HEALTH, timeout=1.0).envelope())
            except Exception:  # noqa: BLE001 - the worker may be loading; ask again
                continue
            if when(health, tail.last_step):
                kill = Kill(victims=list(victims), at=time.monotonic(), step=tail.last_step,
                            activity=health.activity)
                for victim in victims:
                    cluster.kill(victim)
                if on_kill is not None:
                    on_kill()
            elif poll_s:
                time.sleep(poll_s)
    if kill is None:
        thread.join(join_timeout)
        if "error" in outcome:
            raise outcome["error"]
        raise EdgertError(f"the kill condition did not hold within {timeout:.0f} s (or before the job ended)")
    seen = len(tail.records)
    ends = time.monotonic() + join_timeout
    while thread.is_alive() and time.monotonic() < ends:
        tail.poll()
        thread.join(0.005)
    tail.poll()
    kill.after = tail.records[seen:]
    if thread.is_alive():
        raise EdgertError(f"the job did not finish within {join_timeout:.0f} s of the kill")
    if "error" in outcome:
        raise outcome["error"]
    return Outcome(outcome["result"], kill)
