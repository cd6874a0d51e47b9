"""Worker processes on this machine: for ``edgert demo``, the tests and the benchmarks.

Each worker is a real ``edgert worker`` process listening on a free loopback port; the
cluster learns the port from the worker's first line of output, keeps what it prints after
(``consoles``), and stops every process on exit (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from edgert.errors import EdgertError

_LISTENING = re.compile(r"listening on (\S+)")


class LocalCluster:
    """``with LocalCluster(4) as cluster: cluster.urls`` -> four running workers."""

    def __init__(self, count: int, slowdowns: list[str] | None = None, names: list[str] | None = None,
                 log_dir: Path | None = None, start_timeout: float = 60.0, extra_args: list[str] | None = None,
                 credentials: list[Path] | None = None, cores: list[set[int]] | None = None):
        """``credentials`` (one per worker) run them over coaps+tcp; without, plaintext (``--insecure``).
        ``cores`` (one set per worker) pins each to those CPUs, as ``taskset`` would: a device of that many."""
        self.count = count
        self.credentials = credentials
        self.slowdowns = slowdowns or ["1"] * count
        self.names = names or [f"local-{k}" for k in range(count)]
        self.log_dir = log_dir
        self.start_timeout = start_timeout
        self.extra_args = extra_args or []
        self.cores = cores
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.consoles: list[list[str]] = []  # what each worker printed after its "listening" line

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> list[str]:
        try:
            for k in range(self.count):
                self.processes.append(self._spawn(k))
            self.urls = [self._wait_for_url(k, p) for k, p in enumerate(self.processes)]
            self.consoles = [[] for _ in self.processes]
            for process, console in zip(self.processes, self.consoles):  # a full pipe would stop the worker
                threading.Thread(target=_read_lines, args=(process.stdout, console), daemon=True).start()
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _spawn(self, k: int) -> subprocess.Popen:
        slowdown = self.slowdowns[k]
        option = "--slowdown-schedule" if ":" in slowdown else "--slowdown"
        security = (["--listen", "coap+tcp://127.0.0.1:0", "--insecure"] if self.credentials is None
                    else ["--listen", "coaps+tcp://127.0.0.1:0", "--credential", str(self.credentials[k])])
        command = [sys.executable, "-m", "edgert", "worker", *security, "--name", self.names[k],
                   option, slowdown, *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        pin = None if self.cores is None else functools.partial(os.sched_setaffinity, 0, self.cores[k])
        if self.log_dir is None:
            return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                                    preexec_fn=pin)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{self.names[k]}.log", "ab") as stderr:  # the worker keeps its own descriptor
            return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, env=env, text=True,
                                    preexec_fn=pin)

    def _wait_for_url(self, k: int, process: subprocess.Popen) -> str:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                if process.poll() is not None:
                    raise EdgertError(f"worker {self.names[k]} exited with code {process.returncode} before listening")
                continue
            match = _LISTENING.search(line)
            if match:
                return match.group(1)
        raise EdgertError(f"worker {self.names[k]} did not start listening within {self.start_timeout:.0f} s")

    def kill(self, k: int) -> None:
        """SIGKILL worker ``k`` (failure tests)."""
        self.processes[k].send_signal(signal.SIGKILL)
        self.processes[k].wait(10)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
            if process.stdout:
                process.stdout.close()
        self.processes.clear()


def _read_lines(stream, lines: list[str]) -> None:
    """Append each line of ``stream`` to ``lines`` until it closes."""
    try:
        for line in stream:
            lines.append(line.rstrip("\n"))
    except (OSError, ValueError):  # closed by stop()
        pass
