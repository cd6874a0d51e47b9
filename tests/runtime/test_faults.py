"""Fault tolerance with real worker processes and real SIGKILLs on loopback.

Every test checks that training finishes, that the recovery is recorded, and, for the
synchronous schedules, that no step was applied twice or skipped: the parameters equal a
clean run's over the same samples within 1e-4.
"""

import json
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from edgert.bench.faults import run_and_kill as kill_during
from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.coordinator.snapshots import gather_holdings
from edgert.exporter.export import ExportOptions, export_plan
from edgert.manifest import TrainingConfig
from edgert.models import build_model, save_model
from edgert.protocol import JOIN, WEIGHTS
from edgert.transport import BadRequest, Envelope, SyncClient
from tests.running_coordinator import final_parameters, free_port
from tests.zoo_plans import write_groups

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
    return summary, final_parameters(out)


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
    return final_parameters(out)


def run(plan, workers, out, **options):
    options = {"steps": STEPS, "epochs": 10, "replicate_every": 5, "central_every": 10, "schedule": "1f1b",
               "listen": "coap+tcp://127.0.0.1:0", **options}
    options.setdefault("progress", False)
    config = TrainConfig(plan_dir=plan, workers=tuple(workers), out_dir=out, **options)
    return train(config)


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
    assert relative_difference(final_parameters(tmp_path / "run"), clean_params) <= 1e-4
    assert summary.test_accuracy == pytest.approx(clean_summary.test_accuracy, abs=0.01)


def test_kill_during_a_replan(plan4, clean, tmp_path):
    _, clean_params = clean
    with LocalCluster(4, slowdowns=["1", "40", "1", "1"]) as cluster:  # the victim loads its new stage slowly
        summary = run_and_kill(plan4, cluster, tmp_path / "run", [1],
                               lambda health, step: step >= 10 and health.activity == "loading",
                               replan_at=((15, (1, 2, 4)),))
    assert summary.steps == STEPS and summary.recoveries == 1
    assert relative_difference(final_parameters(tmp_path / "run"), clean_params) <= 1e-4


@pytest.mark.parametrize("victims,replicas", [([0, 2], 1), ([1, 2], 2)])
def test_two_simultaneous_failures(plan4, clean, tmp_path, victims, replicas):
    """Non-adjacent failures with one replica each; adjacent ones need two. No coordinator copies here."""
    _, clean_params = clean
    with LocalCluster(4) as cluster:
        summary = run_and_kill(plan4, cluster, tmp_path / "run", victims, lambda health, step: step >= 14,
                               replicas=replicas, central_every=0)
    assert summary.steps == STEPS and summary.recoveries >= 1
    assert all(len(e["workers"]) == 2 for e in recoveries(tmp_path / "run")[-1:])
    assert relative_difference(final_parameters(tmp_path / "run"), clean_params) <= 1e-4


def test_async_schedule_survives_a_kill(plan4, tmp_path):
    with LocalCluster(4, slowdowns=["3"] * 4) as cluster:  # slow enough that the kill lands mid-run
        summary = run_and_kill(plan4, cluster, tmp_path / "run", [3], lambda health, step: step >= 12,
                               schedule="async")
    assert summary.steps == STEPS
    assert summary.recoveries == 1, recoveries(tmp_path / "run")
    assert summary.test_accuracy > 0.85


def test_a_run_restores_only_its_own_copies(plan4, clean, tmp_path):
    """Item 3: a first run into ``same`` leaves copies after steps 14 and 19 on the workers; a second
    run into a folder of the same name, killed after step 7, restores its own copies and replays."""
    _, clean_params = clean
    with LocalCluster(4) as cluster:
        run(plan4, cluster.urls, tmp_path / "same", steps=20)
        first_run = read_run_id(tmp_path / "same")
        (tmp_path / "same").rename(tmp_path / "first")
        outcome = kill_during(lambda: run(plan4, cluster.urls, tmp_path / "same"), cluster, tmp_path / "same", [2],
                              lambda health, step: step >= 7)
        survivor = cluster.urls[0]
        with SyncClient.start() as client:  # a worker serves no copy of another run
            with pytest.raises(BadRequest, match="this worker is in run"):
                client.request("FETCH", survivor, WEIGHTS, Envelope(kind="control", run_id=first_run,
                                                                    meta={"names": ["x"], "copy_step": 19}))
            second_run = read_run_id(tmp_path / "same")
            assert client.call(gather_holdings(client.client, [survivor], first_run)) == {survivor: []}
            assert client.call(gather_holdings(client.client, [survivor], second_run))[survivor]
    assert read_run_id(tmp_path / "same") != first_run
    events = recoveries(tmp_path / "same")
    assert outcome.result.steps == STEPS and len(events) == 1
    assert events[0]["snapshot_step"] is None or events[0]["snapshot_step"] <= outcome.kill.step + 5
    assert relative_difference(final_parameters(tmp_path / "same"), clean_params) <= 1e-4


def test_a_replayed_epoch_end_is_printed_and_read_once_and_spans_keep_their_worker(plan4, clean, tmp_path,
                                                                                   capsys):
    """Items 5 and 6: the kill after step 22 rolls back to the copies after step 19, so the end of
    epoch 1 (step 21) runs and is evaluated again; stage 2 moves off the killed worker."""
    _, clean_params = clean
    out = tmp_path / "run"
    with LocalCluster(4) as cluster:
        outcome = kill_during(lambda: run(plan4, cluster.urls, out, replicate_every=10, central_every=0,
                                          progress=True), cluster, out, [2], lambda health, step: step >= 22)
    events = recoveries(out)
    assert len(events) == 1 and events[0]["snapshot_step"] == 19, events  # the replay crosses step 21
    assert relative_difference(final_parameters(out), clean_params) <= 1e-4
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("epoch 1: test loss")]
    assert len(printed) == 1, printed
    written = [m for m in read_metrics(out, superseded=True) if m["type"] == "eval" and m["epoch"] == 0]
    kept = [m for m in read_metrics(out) if m["type"] == "eval" and m["epoch"] == 0]
    assert len(written) == 2 and kept == written[-1:]
    steps = [m["step"] for m in read_metrics(out) if m["type"] == "step"]
    assert steps == list(range(outcome.result.steps))
    trace = json.loads((out / "trace.json").read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert sorted(tracks.values()) == ["events", "local-0", "local-1", "local-2", "local-3"]
    victim = [int(e["name"][1:].split(".")[0]) for e in trace
              if e.get("ph") == "X" and tracks[e["tid"]] == "local-2" and e["name"][0] in "FBS"]
    assert victim and max(victim) <= outcome.kill.step + 8  # nothing the survivors ran after the kill


def read_run_id(out):
    return json.loads((out / "run.json").read_text())["run_id"]


def test_a_worker_joins_a_running_job(plan4, tmp_path):
    """Three slow workers train; a fast one joins; the planner puts it to work."""
    # slow enough that a fast worker pays for its re-plan even when the host is busy (a 1 s pause)
    with LocalCluster(4, slowdowns=["12", "12", "12", "12"]) as cluster:
        coordinator_port = free_port()
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
            console = joiner.communicate(timeout=10)[0]
    summary = result["summary"]
    events = read_metrics(out)
    assert any(m.get("event") == "join" and m["worker"] == "fast" for m in events)
    replans = [m for m in events if m.get("event") == "replan"]
    assert replans and "fast" in replans[-1]["workers"]
    placed = [m for m in events if m.get("event") == "join_placed"]
    assert [m["worker"] for m in placed] == ["fast"] and placed[0]["before_step"] == replans[0]["before_step"]
    links = [m for m in events if m.get("event") == "links"][-1]  # the record follows the links in use
    assert links["before_step"] == replans[-1]["before_step"]
    assert [(link["sender"], link["receiver"]) for link in links["links"]] == list(zip(replans[-1]["workers"],
                                                                                       replans[-1]["workers"][1:]))
    assert summary.steps == STEPS
    # the joining worker's console says it was accepted, then given a stage
    assert "fast: joined coap+tcp://127.0.0.1" in console and "accepted" in console, console
    assert "fast: given stage " in console, console


def _train_process(plan, workers, out, steps=STEPS, listen="coap+tcp://127.0.0.1:0"):
    """``edgert train`` as a process (to be killed), with the options of :func:`run`."""
    command = [sys.executable, "-m", "edgert", "train", str(plan), "--workers", ",".join(workers),
               "--out", str(out), "--steps", str(steps), "--epochs", "10", "--replicate-every", "5",
               "--central-every", "5", "--listen", listen, "--insecure"]
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
        moved = tmp_path / "moved"  # C2: the folder given to --resume is the run folder
        resumed = _kill_and_resume(_train_process(plan4, cluster.urls, out), out, moved=moved)
    _check_resumed(resumed, moved, clean_params)
    assert not out.exists()
    # item 5: each step read once; C4: the summary covers both processes
    written = read_metrics(moved, superseded=True)
    resumed_at = next(k for k, m in enumerate(written) if m.get("event") == "resume")
    assert not [m for m in written[:resumed_at] if m["type"] == "segment"]  # killed in its first segment
    killed = [m for m in written[:resumed_at] if m["type"] == "step"][-1]
    later = sum(m["seconds"] for m in written[resumed_at:] if m["type"] == "segment")
    assert [m["step"] for m in read_metrics(moved) if m["type"] == "step"] == list(range(STEPS))
    summary = json.loads(resumed.stdout)
    assert summary["steps"] == STEPS and summary["samples"] == STEPS * 64
    assert summary["train_seconds"] == pytest.approx(killed["time_s"] - killed["segment_started_s"] + later, abs=0.01)
    assert summary["samples_per_s"] == pytest.approx(summary["samples"] / summary["train_seconds"], rel=0.01)
    # C3: the killed coordinator's trace is kept and continued: spans of the first and the last step
    trace = json.loads((moved / "trace.json").read_text())
    spans = {e["name"] for e in trace if e.get("ph") == "X"}
    assert {"F0.0", f"F{STEPS - 1}.0"} <= spans


def _kill_and_resume(coordinator: subprocess.Popen, out, *options, moved=None) -> subprocess.CompletedProcess:
    """SIGKILL ``coordinator`` once step 17 is recorded (snapshots every 5 steps), then `edgert train --resume`
    (of the run folder moved to ``moved`` first, if given)."""
    try:
        _wait_for_step(out, 17, coordinator)
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(10)
    finally:
        coordinator.kill()
    if moved is not None:
        out.rename(moved)
    return subprocess.run([sys.executable, "-m", "edgert", "train", "--resume", str(moved or out), *options, "--json"],
                          capture_output=True, text=True, timeout=300)


def _check_resumed(resumed: subprocess.CompletedProcess, out, clean_params) -> None:
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    events = [m for m in read_metrics(out) if m.get("event") == "resume"]
    assert len(events) == 1 and events[0]["snapshot_step"] >= 9
    assert relative_difference(final_parameters(out), clean_params) <= 1e-4


def test_recovery_with_more_survivors_than_stages(plan2, clean2, tmp_path):
    """Two slow workers join a 2-stage run and sit idle; a stage's worker dies: 3 survivors, 2 stages."""
    out, port = tmp_path / "run", free_port()
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
    assert relative_difference(final_parameters(out), clean2) <= 1e-4


def test_a_resumed_coordinator_remembers_the_workers_that_joined(plan2, clean2, tmp_path):
    """A worker joins, the coordinator is killed: `edgert train --resume` counts the joined worker again."""
    out, port = tmp_path / "run", free_port()
    with LocalCluster(2) as cluster, LocalCluster(1, names=["late"], slowdowns=["50"]) as late, \
            SyncClient.start() as client:
        coordinator = _train_process(plan2, cluster.urls, out, steps=STEPS2, listen=f"coap+tcp://127.0.0.1:{port}")
        _wait_for_step(out, 2, coordinator)
        client.post(f"coap+tcp://127.0.0.1:{port}", JOIN, Envelope("control", meta={"url": late.urls[0],
                                                                                   "name": "late"}), timeout=60)
        resumed = _kill_and_resume(coordinator, out)
    _check_resumed(resumed, out, clean2)
    remembered = _metrics_events(out, "join_remembered")
    assert [(m["worker"], m["url"]) for m in remembered] == [("late", late.urls[0])]
    written = read_metrics(out, superseded=True)
    resumed_at = next(k for k, m in enumerate(written) if m.get("event") == "resume")
    weighed = [m for m in written[resumed_at:] if m.get("event") in ("join_kept_idle", "join_placed")]
    assert weighed and weighed[0]["worker"] == "late"  # weighed again after the resume, with its fate recorded
    links = [m for m in written[resumed_at:] if m.get("event") == "links"]
    assert links and links[0]["before_step"] == written[resumed_at]["resume_step"]
    assert all(m["steps_left"] > 0 for m in written[resumed_at:] if m.get("event") == "placement_check")


def _metrics_events(out, name):
    return [m for m in _metrics(out) if m.get("event") == name]


def test_resume_with_more_workers_than_the_snapshot_has_stages(plan2, clean2, tmp_path):
    """The coordinator of a 2-stage run dies; `edgert train --resume` goes on with 4 workers."""
    out = tmp_path / "run"
    with LocalCluster(4, slowdowns=["8"] * 4) as cluster:
        coordinator = _train_process(plan2, cluster.urls[:2], out, steps=STEPS2)
        resumed = _kill_and_resume(coordinator, out, "--workers", ",".join(cluster.urls))
    _check_resumed(resumed, out, clean2)


def test_a_run_whose_plan_has_groups_resumes(plan2, clean2, tmp_path):
    """The coordinator of a 2-stage run with a 0.6/0.4 group on stage 1 dies; `edgert train --resume` with the
    same 3 workers places them anew from the snapshot (groups allowed) and ends as the clean run."""
    plan = tmp_path / "plan"
    shutil.copytree(plan2, plan)
    with LocalCluster(3, slowdowns=["8"] * 3) as cluster:
        write_groups(plan, [(cluster.urls[0],), tuple(cluster.urls[1:])], [(1.0,), (0.6, 0.4)])
        out = tmp_path / "run"
        coordinator = _train_process(plan, cluster.urls, out, steps=STEPS2)
        resumed = _kill_and_resume(coordinator, out)
    _check_resumed(resumed, out, clean2)
    written = read_metrics(out, superseded=True)
    assert [m for m in written if m.get("event") == "stages_assigned"][0]["groups"]  # it ran with the group
    (resume,) = [m for m in written if m.get("event") == "resume"]
    assert sorted(resume["workers"] + [w for g in resume.get("groups", {}).values() for w in g["workers"][1:]]) \
        == sorted(cluster.names)  # every worker given is placed again
