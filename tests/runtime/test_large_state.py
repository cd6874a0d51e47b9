"""A model whose stages' states are far over one CoAP message (64 MiB) trains, survives a ``kill -9`` of a
worker and of the coordinator, resumes and merges: every state moves in pieces (docs/PROTOCOL.md §12).

The model is the wide MLP of tests/wide_model.py (25.3 million parameters, built without torch) in 3
stages: each stage's state (parameters and AdamW's two buffers) is 100 to 150 MB. Stage assignments,
the coordinator's quick profile (the whole model at once), replicas, central copies, checkpoints,
the recovery's migration, the resume and the merge all carry it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edgert.bench.faults import MetricsTail
from edgert.coordinator.localcluster import LocalCluster
from edgert.manifest import load_manifest
from edgert.transport.limits import DEFAULT_LIMITS
from edgert.weights import load_state
from tests.running_coordinator import free_port
from tests.wide_model import wide_mlp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 32
BATCH = 16
TRAIN_SAMPLES, TEST_SAMPLES = 128, 64  # an epoch is 8 steps: a checkpoint every 8
KILL_WORKER_AT, KILL_COORDINATOR_AT = 10, 20


@pytest.fixture(scope="module")
def wide_plan(tmp_path_factory) -> Path:
    from edgert.exporter.export import ExportOptions, export_plan

    folder = tmp_path_factory.mktemp("wide")
    export_plan(wide_mlp(folder / "mlp-wide.onnx"), folder / "plan", ExportOptions(stages=3))
    return folder / "plan"


def small_data(path: Path) -> Path:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((TRAIN_SAMPLES + TEST_SAMPLES, 64)).astype(np.float32)
    y = (x[:, :10].argmax(axis=1)).astype(np.int64)  # learnable: the largest of the first ten features
    np.savez(path, x=x[:TRAIN_SAMPLES], y=y[:TRAIN_SAMPLES], x_test=x[TRAIN_SAMPLES:], y_test=y[TRAIN_SAMPLES:])
    return path


def test_stages_over_one_message_train_recover_resume_and_merge(wide_plan, tmp_path):
    manifest = load_manifest(wide_plan)
    assert sum(p.bytes for s in manifest.stages for p in s.parameters) > 100e6  # 25M float32 parameters
    data = small_data(tmp_path / "data.npz")
    out, port = tmp_path / "run", free_port()
    common = ["--insecure", "--replicate-every", "2", "--central-every", "4", "--step-timeout", "300"]
    cluster = LocalCluster(3, log_dir=tmp_path / "logs", start_timeout=120)
    tail = MetricsTail(out)
    processes: list[subprocess.Popen] = []
    try:
        cluster.start()
        coordinator = _run(["train", str(wide_plan), "--workers", ",".join(cluster.urls), "--out", str(out),
                            "--data", str(data), "--steps", str(STEPS), "--epochs", "100", "--batch-size",
                            str(BATCH), "--listen", f"coap+tcp://127.0.0.1:{port}", *common], tmp_path, "first")
        processes.append(coordinator)
        _wait(tail, lambda: tail.last_step >= KILL_WORKER_AT and _events(tail, "central_snapshot"), coordinator,
              f"step {KILL_WORKER_AT} and a central snapshot", tmp_path)
        victim = cluster.urls[1]
        cluster.kill(1)  # kill -9 of a worker holding a stage of about 150 MB
        _wait(tail, lambda: _events(tail, "recovery") and tail.last_step >= KILL_COORDINATOR_AT, coordinator,
              f"a recovery and step {KILL_COORDINATOR_AT}", tmp_path)
        coordinator.send_signal(signal.SIGKILL)  # and of the coordinator
        coordinator.wait(10)
        survivors = [url for url in cluster.urls if url != victim]
        resumed = _run(["train", "--resume", str(out), "--workers", ",".join(survivors), "--json", *common[:1]],
                       tmp_path, "resumed", stdout=subprocess.PIPE)
        processes.append(resumed)
        stdout, _ = resumed.communicate(timeout=900)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        cluster.stop()
    assert resumed.returncode == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    summary = json.loads(stdout)
    assert summary["steps"] == STEPS and summary["recoveries"] >= 1
    tail.poll()
    (recovery,) = _events(tail, "recovery")
    assert recovery["failed"] == [victim] and recovery["snapshot_step"] is not None
    assert _events(tail, "resume")

    checkpoint = out / "checkpoints" / "latest"
    sizes = [p.stat().st_size for p in sorted(checkpoint.glob("stage*.cbor"))]
    assert max(sizes) > DEFAULT_LIMITS.max_payload_bytes, sizes  # a state no single message could carry
    assert not list(out.rglob("*.partial")), "a transfer left a partial file behind"

    merged = tmp_path / "merged.onnx"
    done = subprocess.run([sys.executable, "-m", "edgert", "merge", str(out), str(merged)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    _check_merged(merged, checkpoint, data, tail)


def _check_merged(merged: Path, checkpoint: Path, data: Path, tail: MetricsTail) -> None:
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
    logits = session.run(None, {session.get_inputs()[0].name: arrays["x_test"]})[0]
    accuracy = float(np.mean(logits.argmax(axis=1) == arrays["y_test"]))
    last = [r for _, r in tail.records if r.get("type") == "eval"][-1]
    assert accuracy == pytest.approx(last["test_accuracy"], abs=1e-9), (accuracy, last)


def _run(arguments: list[str], folder: Path, log: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgert", *arguments], stdout=stdout,
                            stderr=(folder / f"{log}.log").open("w"), text=True)


def _events(tail: MetricsTail, event: str) -> list[dict]:
    return [record for _, record in tail.records if record.get("event") == event]


def _wait(tail: MetricsTail, condition, process: subprocess.Popen, what: str, folder: Path,
          timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        tail.poll()
        if condition():
            return
        assert process.poll() is None, (f"the coordinator ended (code {process.returncode}) before {what}: "
                                        f"{(folder / 'first.log').read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.05)
