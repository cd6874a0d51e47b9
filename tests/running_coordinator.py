"""A real coordinator (``edgert train``'s :class:`Coordinator`) run in a thread, so a test can talk to it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

from edgert.coordinator.coordinator import Coordinator, TrainConfig
from edgert.weights import load_state


class RunningCoordinator:
    """``Coordinator(config).run()`` in a thread: its URL, its run id and its state while it trains."""

    def __init__(self, config: TrainConfig) -> None:
        self.coordinator = Coordinator(config)  # the run id is known from here on
        self.out = config.out_dir
        self.result: dict = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.result["summary"] = asyncio.run(self.coordinator.run())
        except BaseException as error:  # noqa: BLE001 - the test reports it
            self.result["error"] = error

    def start(self) -> RunningCoordinator:
        self.thread.start()
        return self

    @property
    def run_id(self) -> str:
        return self.coordinator.run_id

    def wait_training(self, announced: int = 0, timeout: float = 120.0) -> str:
        """Wait until a step completed and the segments sent cover ``announced``; the coordinator's URL."""
        deadline = time.monotonic() + timeout
        coordinator = self.coordinator
        while time.monotonic() < deadline and self.thread.is_alive():
            ledger, state = coordinator.ledger, coordinator.state
            if ledger is not None and ledger.completed_through >= 0 and state.announced_through >= announced:
                return coordinator.server.urls[0]
            time.sleep(0.02)
        raise AssertionError(f"the coordinator did not start training: {self.result.get('error')}")

    def finish(self, timeout: float = 300.0):
        """The run's summary once it ended (an error it ended with is raised)."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not finish"
        if "error" in self.result:
            raise self.result["error"]
        return self.result["summary"]


def final_parameters(out: Path) -> dict:
    """Every stage's parameters in the run's latest checkpoint."""
    parameters = {}
    for path in sorted((out / "checkpoints" / "latest").glob("stage*.cbor")):
        parameters.update(load_state(path).parameters)
    return parameters


def free_port() -> int:
    """A loopback TCP port free now: for a coordinator's ``--listen`` that a test must name before it starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
