"""Fault tolerance with real worker processes and real SIGKILLs on loopback.

Every test checks that training finishes, that the recovery is recorded, and, for the
synchronous schedules, that no step was applied twice or skipped: the parameters equal a
clean run's over the same samples within 1e-4.
"""

import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from edgert.coordinator import TrainConfig, train
from edgert.exporter.export import ExportOptions, export_plan
from edgert.fault_injection import run_and_kill as kill_during
from edgert.localcluster import LocalCluster
from edgert.manifest import TrainingConfig
from edgert.models import build_model, save_model
from edgert.protocol import JOIN
from edgert.runlog import read_metrics
from edgert.transport import Envelope, SyncClient
from edgert.weights import load_state

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
STEPS = 40
STEPS2 = 80  # the 2-stage model's steps are short: more of them leave time to join and to kill


@pytest.fixture(scope="module")
def plan4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    save_model(build_model("cnn"), folder / "cnn.onnx")
    training = TrainingConfig(learning_rate=3e-3)
    export_plan(folder / "cnn.onnx", folder / "plan", ExportOptions(stages=4, training=training))
    return folder / "plan"


@pytest.fixture(scope="module")
def clean(plan4, tmp_path_factory):
    """The undisturbed run every recovered run must equal."""
    out = tmp_path_factory.mktemp("clean") / "run"
    with LocalCluster(4) as cluster:
        summary = run(plan4, cluster.urls, out)
    return summary, parameters(out)


@pytest.fixture(scope="module")
def plan2(tmp_path_factory):
    """A small model in 2 stages: fewer stages than the workers of the tests with idle ones."""
    folder = tmp_path_factory.mktemp("faults2")
    save_model(build_model("mlp"), folder / "mlp.onnx")
    export_plan(folder / "mlp.onnx", folder / "plan", ExportOptions(stages=2, training=TrainingConfig()))
    return folder / "plan"


@pytest.fixture(scope="module")
def clean2(plan2, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean2") / "run"
    with LocalCluster(2) as cluster:
        run(plan2, cluster.urls, out, steps=STEPS2)
    return parameters(out)


def run(plan, workers, out, **options):
    options = {"steps": STEPS, "epochs": 10, "replicate_every": 5, "central_every": 10, "schedule": "1f1b",
               "listen": "coap+tcp://127.0.0.1:0", **options}
    config = TrainConfig(plan_dir=plan, workers=tuple(workers), out_dir=out, progress=False, **options)
    return train(config)


def parameters(run_dir):
    values = {}
    for path in sorted((run_dir / "checkpoints" / "latest").glob("stage*.cbor")):
        values.update(load_state(path).parameters)
    return values


def relative_difference(a, b):
    return max(float(np.max(np.abs(a[n] - b[n]))) / max(float(np.max(np.abs(b[n]))), 1e-3) for n in b)


def run_and_kill(plan, cluster, out, victims, when, **options):
    """Train in a thread; SIGKILL ``victims`` once ``when(health of the first victim, completed step)`` holds."""
    return kill_during(lambda: run(plan, cluster.urls, out, **options), cluster, out, victims, when).result


def _metrics(out):
    try:
        return read_metrics(out)
    except FileNotFoundError:
        return []


def recoveries(out):
    return [m for m in read_metrics(out) if m.get("event") == "recovery"]


@pytest.mark.parametrize("point,slowdown", [("forward", "4"), ("backward", "4"), ("replicating", "200")])
def test_kill_during_compute_and_replication(plan4, clean, tmp_path, point, slowdown):
    clean_summary, clean_params = clean
    with LocalCluster(4, slowdowns=["1", "1", slowdown, "1"]) as cluster:
        summary = run_and_kill(plan4, cluster, tmp_path / "run", [2],
                               lambda health, step: step >= 12 and health.activity.startswith(point))
    assert summary.steps == STEPS and summary.recoveries == 1
    events = recoveries(tmp_path / "run")
    # the planner may leave a survivor idle when that is faster on this shared 2-core host
    survivors = {"local-0", "local-1", "local-3"}
    assert len(events) == 1 and events[0]["steps_lost"] <= 5 and set(events[0]["workers"]) <= survivors
    assert len(events[0]["workers"]) >= 2
    assert relative_difference(parameters(tmp_path / "run"), clean_params) <= 1e-4
    assert summary.test_accuracy == pytest.approx(clean_summary.test_accuracy, abs=0.01)


def test_kill_during_a_replan(plan4, clean, tmp_path):
    _, clean_params = clean
    with LocalCluster(4, slowdowns=["1", "40", "1", "1"]) as cluster:  # the victim loads its new stage slowly
        summary = run_and_kill(plan4, cluster, tmp_path / "run", [1],
                               lambda health, step: step >= 10 and health.activity == "loading",
                               replan_at=((15, (1, 2, 4)),))
    assert summary.steps == STEPS and summary.recoveries == 1
    assert relative_difference(parameters(tmp_path / "run"), clean_params) <= 1e-4


@pytest.mark.parametrize("victims,replicas", [([0, 2], 1), ([1, 2], 2)])
def test_two_simultaneous_failures(plan4, clean, tmp_path, victims, replicas):
    """Non-adjacent failures with one replica each; adjacent ones need two. No coordinator copies here."""
    _, clean_params = clean
    with LocalCluster(4) as cluster:
        summary = run_and_kill(plan4, cluster, tmp_path / "run", victims, lambda health, step: step >= 14,
                               replicas=replicas, central_every=0)
    assert summary.steps == STEPS and summary.recoveries >= 1
    assert all(len(e["workers"]) == 2 for e in recoveries(tmp_path / "run")[-1:])
    assert relative_difference(parameters(tmp_path / "run"), clean_params) <= 1e-4


def test_async_schedule_survives_a_kill(plan4, tmp_path):
    with LocalCluster(4, slowdowns=["3"] * 4) as cluster:  # slow enough that the kill lands mid-run
        summary = run_and_kill(plan4, cluster, tmp_path / "run", [3], lambda health, step: step >= 12,
                               schedule="async")
    assert summary.steps == STEPS
    assert summary.recoveries == 1, recoveries(tmp_path / "run")
    assert summary.test_accuracy > 0.85


def test_a_worker_joins_a_running_job(plan4, tmp_path):
    """Three slow workers train; a fast one joins; the planner puts it to work."""
    # slow enough that a fast worker pays for its re-plan even when the host is busy (a 1 s pause)
    with LocalCluster(4, slowdowns=["12", "12", "12", "12"]) as cluster:
        coordinator_port = _free_port()
        result = {}
        out = tmp_path / "run"

        def go():
            config = TrainConfig(plan_dir=plan4, workers=tuple(cluster.urls), out_dir=out, steps=STEPS,
                                 listen=f"coap+tcp://127.0.0.1:{coordinator_port}", progress=False,
                                 replicate_every=5, replan_every=5)
            result["summary"] = train(config)

        thread = threading.Thread(target=go)
        thread.start()
        while not [m for m in _metrics(out) if m["type"] == "step"]:
            time.sleep(0.1)
        joiner = subprocess.Popen([sys.executable, "-m", "edgert", "worker", "--listen", "coap+tcp://127.0.0.1:0",
                                   "--insecure", "--name", "fast", "--join", f"coap+tcp://127.0.0.1:{coordinator_port}"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            thread.join(300)
        finally:
            joiner.send_signal(signal.SIGTERM)
            joiner.wait(10)
            joiner.stdout.close()
    summary = result["summary"]
    events = read_metrics(out)
    assert any(m.get("event") == "join" and m["worker"] == "fast" for m in events)
    replans = [m for m in events if m.get("event") == "replan"]
    assert replans and "fast" in replans[-1]["workers"]
    assert summary.steps == STEPS


def _free_port():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _train_process(plan, workers, out, steps=STEPS):
    """``edgert train`` as a process (to be killed), with the options of :func:`run`."""
    command = [sys.executable, "-m", "edgert", "train", str(plan), "--workers", ",".join(workers),
               "--out", str(out), "--steps", str(steps), "--epochs", "10", "--replicate-every", "5",
               "--central-every", "5", "--listen", "coap+tcp://127.0.0.1:0", "--insecure"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_step(out, step, process, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not [m for m in _metrics(out) if m["type"] == "step" and m["step"] >= step]:
        assert process.poll() is None, "the coordinator ended before it could be killed"
        assert time.monotonic() < deadline, f"step {step} was not reached within {timeout:.0f} s"
        time.sleep(0.05)


def test_coordinator_restart_resumes_from_its_snapshot(plan4, clean, tmp_path):
    """SIGKILL the coordinator mid-run; `edgert train --resume` finishes the job exactly."""
    _, clean_params = clean
    out = tmp_path / "run"
    with LocalCluster(4) as cluster:
        resumed = _kill_and_resume(_train_process(plan4, cluster.urls, out), out)
    _check_resumed(resumed, out, clean_params)


def _kill_and_resume(coordinator: subprocess.Popen, out, *options) -> subprocess.CompletedProcess:
    """SIGKILL ``coordinator`` once step 17 is recorded (snapshots every 5 steps), then `edgert train --resume`."""
    try:
        _wait_for_step(out, 17, coordinator)
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(10)
    finally:
        coordinator.kill()
    return subprocess.run([sys.executable, "-m", "edgert", "train", "--resume", str(out), *options, "--json"],
                          capture_output=True, text=True, timeout=300)


def _check_resumed(resumed: subprocess.CompletedProcess, out, clean_params) -> None:
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    events = [m for m in read_metrics(out) if m.get("event") == "resume"]
    assert len(events) == 1 and events[0]["snapshot_step"] >= 9
    assert relative_difference(parameters(out), clean_params) <= 1e-4


def test_recovery_with_more_survivors_than_stages(plan2, clean2, tmp_path):
    """Two slow workers join a 2-stage run and sit idle; a stage's worker dies: 3 survivors, 2 stages."""
    out, port = tmp_path / "run", _free_port()
    coordinator = f"coap+tcp://127.0.0.1:{port}"
    with LocalCluster(2, slowdowns=["30", "30"]) as cluster, \
            LocalCluster(2, names=["idle-0", "idle-1"], slowdowns=["60", "60"]) as idle, SyncClient.start() as client:
        def joined(health, step):
            if step >= 1 and not _metrics_events(out, "join"):
                for url, name in zip(idle.urls, idle.names):  # what `edgert worker --join` posts
                    client.post(coordinator, JOIN, Envelope("control", meta={"url": url, "name": name}), timeout=30)
            return len(_metrics_events(out, "join")) == 2 and step >= 3

        summary = kill_during(lambda: run(plan2, cluster.urls, out, listen=coordinator, steps=STEPS2),
                              cluster, out, [1], joined).result
    records = read_metrics(out)
    first_recovery = next(k for k, m in enumerate(records) if m.get("event") == "recovery")
    assert not [m for m in records[:first_recovery] if m.get("event") == "replan"], "the idle workers were used"
    assert summary.steps == STEPS2 and summary.recoveries == 1
    events = recoveries(out)
    assert len(events) == 1 and set(events[0]["workers"]) <= {"local-0", "idle-0", "idle-1"}
    assert relative_difference(parameters(out), clean2) <= 1e-4


def _metrics_events(out, name):
    return [m for m in _metrics(out) if m.get("event") == name]


def test_resume_with_more_workers_than_the_snapshot_has_stages(plan2, clean2, tmp_path):
    """The coordinator of a 2-stage run dies; `edgert train --resume` goes on with 4 workers."""
    out = tmp_path / "run"
    with LocalCluster(4, slowdowns=["8"] * 4) as cluster:
        coordinator = _train_process(plan2, cluster.urls[:2], out, steps=STEPS2)
        resumed = _kill_and_resume(coordinator, out, "--workers", ",".join(cluster.urls))
    _check_resumed(resumed, out, clean2)
