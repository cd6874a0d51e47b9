"""A training run taken through every move of a stage's state: a worker killed (kill -9) and recovered, the
coordinator killed and the run resumed (``edgert train --resume``), then merged (``edgert merge``); what the
large-state tests run on their models (tests/runtime/test_large_state*.py)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edgert.bench.faults import MetricsTail
from edgert.coordinator.localcluster import LocalCluster
from edgert.scoring import Score
from edgert.transport.limits import DEFAULT_LIMITS
from edgert.weights import load_state
from tests.running_coordinator import free_port


@dataclass(frozen=True)
class FaultyRun:
    """How long the run is, when its worker and then its coordinator are killed."""

    steps: int
    batch_size: int
    kill_worker_at: int
    kill_coordinator_at: int
    extra: tuple[str, ...] = ()  # more ``edgert train`` options


def train_through_faults(plan: Path, data: Path, workers: int, run: FaultyRun, folder: Path) -> Path:
    """Train ``plan`` on ``workers`` local workers with ``data``, kill worker 1 and then the coordinator, resume
    on the survivors, merge; checks every step of it and returns the merged model."""
    out, port = folder / "run", free_port()
    common = ["--insecure", "--replicate-every", "2", "--central-every", "2", "--step-timeout", "600"]
    cluster = LocalCluster(workers, log_dir=folder / "logs", start_timeout=120)
    tail = MetricsTail(out)
    processes: list[subprocess.Popen] = []
    try:
        cluster.start()
        coordinator = _run(["train", str(plan), "--workers", ",".join(cluster.urls), "--out", str(out), "--data",
                            str(data), "--steps", str(run.steps), "--epochs", "1000", "--batch-size",
                            str(run.batch_size), "--listen", f"coap+tcp://127.0.0.1:{port}", *common, *run.extra],
                           folder, "first")
        processes.append(coordinator)
        _wait(tail, lambda: tail.last_step >= run.kill_worker_at and _events(tail, "central_snapshot"),
              coordinator, f"step {run.kill_worker_at} and a central snapshot", folder)
        victim = cluster.urls[1]
        cluster.kill(1)  # kill -9 of a worker holding a stage
        _wait(tail, lambda: _events(tail, "recovery") and tail.last_step >= run.kill_coordinator_at, coordinator,
              f"a recovery and step {run.kill_coordinator_at}", folder)
        coordinator.send_signal(signal.SIGKILL)  # and of the coordinator
        coordinator.wait(10)
        survivors = [url for url in cluster.urls if url != victim]
        devices = folder / "devices.json"  # the first run's profile of the same workers: not measured again
        shutil.copyfile(out / "devices.json", devices)
        resumed = _run(["train", "--resume", str(out), "--workers", ",".join(survivors), "--devices", str(devices),
                        "--json", *common[:1]], folder, "resumed", stdout=subprocess.PIPE)
        processes.append(resumed)
        stdout, _ = resumed.communicate(timeout=1800)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        cluster.stop()
    assert resumed.returncode == 0, (folder / "resumed.log").read_text()[-3000:]
    summary = json.loads(stdout)
    assert summary["steps"] == run.steps and summary["recoveries"] >= 1
    tail.poll()
    (recovery,) = _events(tail, "recovery")
    assert recovery["failed"] == [victim] and recovery["snapshot_step"] is not None
    assert _events(tail, "resume")

    checkpoint = out / "checkpoints" / "latest"
    sizes = [p.stat().st_size for p in sorted(checkpoint.glob("stage*.cbor"))]
    assert max(sizes) > DEFAULT_LIMITS.max_payload_bytes, sizes  # a state no single message could carry
    assert not list(out.rglob("*.partial")), "a transfer left a partial file behind"

    merged = folder / "merged.onnx"
    done = subprocess.run([sys.executable, "-m", "edgert", "merge", str(out), "-o", str(merged)], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    check_merged(merged, checkpoint, data, tail)
    return merged


def check_merged(merged: Path, checkpoint: Path, data: Path, tail: MetricsTail) -> None:
    """The merged model holds the checkpoint's parameters and scores the test set as the run's last evaluation."""
    import onnx
    import onnxruntime
    from onnx import numpy_helper

    model = onnx.load(str(merged))
    initializers = {init.name: init for init in model.graph.initializer}
    for path in sorted(checkpoint.glob("stage*.cbor")):
        for name, value in load_state(path).parameters.items():
            np.testing.assert_array_equal(numpy_helper.to_array(initializers[name]), value, err_msg=name)
    arrays = np.load(data)
    session = onnxruntime.InferenceSession(str(merged), providers=["CPUExecutionProvider"])
    logits = np.concatenate([session.run(None, {session.get_inputs()[0].name: arrays["x_test"][i:i + 16]})[0]
                             for i in range(0, len(arrays["x_test"]), 16)])
    score = Score("cross_entropy")
    score.add(logits, arrays["y_test"])
    loss, accuracy = score.mean_loss, score.accuracy
    last = [r for _, r in tail.records if r.get("type") == "eval"][-1]
    assert accuracy == pytest.approx(last["test_accuracy"], abs=1e-9), (accuracy, last)
    assert loss == pytest.approx(last["test_loss"], rel=1e-3), (loss, last)  # the same logits, to float rounding


def _run(arguments: list[str], folder: Path, log: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgert", *arguments], stdout=stdout,
                            stderr=(folder / f"{log}.log").open("w"), text=True)


def _events(tail: MetricsTail, event: str) -> list[dict]:
    return [record for _, record in tail.records if record.get("event") == event]


def _wait(tail: MetricsTail, condition, process: subprocess.Popen, what: str, folder: Path,
          timeout: float = 1200.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        tail.poll()
        if condition():
            return
        assert process.poll() is None, (f"the coordinator ended (code {process.returncode}) before {what}: "
                                        f"{(folder / 'first.log').read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.05)
