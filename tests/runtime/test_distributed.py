"""Real worker processes on loopback: training, schedules, merge, and bad input."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import onnxruntime
import pytest

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.errors import TrainingError
from edgert.coordinator.evaluation import StateScorer
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.errors import EdgertError
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.merge import merge_run
from edgert.manifest import TrainingConfig, load_manifest
from edgert.models import build_model, load_dataset, save_model
from edgert.protocol import RUN, STAGE, STOP, Peers, Segment, StageAssignment
from edgert.run_settings import RunSettings
from edgert.transport import BadRequest, Envelope, SyncClient
from edgert.weights import load_state

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(3, log_dir=tmp_path_factory.mktemp("worker-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    save_model(build_model("cnn"), folder / "cnn.onnx")
    training = TrainingConfig(learning_rate=3e-3)
    plans = {}
    for stages in (1, 3):
        export_plan(folder / "cnn.onnx", folder / f"plan{stages}", ExportOptions(stages=stages, training=training))
        plans[stages] = folder / f"plan{stages}"
    return plans


def run(plan, workers, out, **options):
    options.setdefault("data", "digits")
    config = TrainConfig(plan_dir=plan, workers=tuple(workers), out_dir=out, listen="coap+tcp://127.0.0.1:0",
                         progress=False, **options)
    return train(config)


def stage_parameters(run_dir, stages):
    values = {}
    for k in range(stages):
        values.update(load_state(run_dir / "checkpoints" / "latest" / f"stage{k}.cbor").parameters)
    return values


@pytest.mark.parametrize("schedule,memory_mode", [("gpipe", "recompute"), ("1f1b", "recompute"), ("1f1b", "stash")])
def test_three_stages_equal_one_stage_after_20_steps(cluster, plans, tmp_path, schedule, memory_mode):
    three = run(plans[3], cluster.urls, tmp_path / "three", schedule=schedule, steps=20, micro_batches=4,
                memory_mode=memory_mode)
    one = run(plans[1], cluster.urls[:1], tmp_path / "one", schedule=schedule, steps=20, micro_batches=4)
    assert three.steps == one.steps == 20
    split, whole = stage_parameters(tmp_path / "three", 3), stage_parameters(tmp_path / "one", 1)
    assert split.keys() == whole.keys()
    worst = max(float(np.max(np.abs(split[n] - whole[n]))) / max(float(np.max(np.abs(whole[n]))), 1e-3)
                for n in whole)
    assert worst <= 1e-4, f"largest relative parameter difference {worst:.2e}"
    assert three.train_loss == pytest.approx(one.train_loss, rel=1e-4)


def test_training_run_records_metrics_trace_and_merges(cluster, plans, tmp_path):
    out = tmp_path / "run"
    summary = run(plans[3], cluster.urls, out, epochs=3, schedule="1f1b")
    assert summary.test_accuracy >= 0.93
    assert summary.samples_per_s > 0 and len(summary.stage_utilisation) == 3
    metrics = read_metrics(out)
    steps = [m for m in metrics if m["type"] == "step"]
    assert [m["step"] for m in steps] == list(range(summary.steps))
    for field in ("loss", "samples_per_s", "stages"):
        assert field in steps[-1]
    assert set(steps[-1]["stages"][0]) >= {"forward_ms", "backward_ms", "idle_ms", "transfer_ms"}
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert len([m for m in metrics if m["type"] == "eval"]) == 3
    trace = json.loads((out / "trace.json").read_text())  # a finished run's trace is plain JSON
    tracks = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert {e["tid"] for e in trace if e.get("ph") == "X"} == {1, 2, 3}  # one track per worker
    assert tracks.pop(0) == "events"  # the run's events (instants) have their own track
    assert sorted(tracks.values()) == sorted(summary.workers)
    assert any(e["name"].startswith("B") for e in trace if e.get("ph") == "X")

    merged = tmp_path / "trained.onnx"
    merge_run(out, merged)
    data = load_dataset("digits-image")
    session = onnxruntime.InferenceSession(str(merged), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": data.x_test})[0]
    manifest = load_manifest(plans[3])
    evaluator = StateScorer(plans[3], manifest)
    states = [load_state(out / "checkpoints" / "latest" / f"stage{k}.cbor") for k in range(3)]
    chained_loss, chained_accuracy = evaluator.evaluate(states, data.x_test, data.y_test)
    assert float(np.mean(logits.argmax(1) == data.y_test)) == pytest.approx(chained_accuracy)
    assert chained_accuracy == pytest.approx(summary.test_accuracy)


def test_async_schedule_trains_through_epoch_ends_without_draining(cluster, plans, tmp_path):
    out = tmp_path / "async"
    summary = run(plans[3], cluster.urls, out, epochs=3, schedule="async")
    assert summary.test_accuracy >= 0.9
    per_epoch = len(load_dataset("digits-image").x_train) // 64
    assert summary.steps == 3 * per_epoch
    # The first two epochs are evaluated from the copies the stages sent after their last
    # step, while the pipeline went on; the last one after the run drained.
    evals = [m for m in read_metrics(out) if m["type"] == "eval"]
    assert [(m["epoch"], m["step"], m["source"]) for m in evals] == [
        (0, per_epoch - 1, "snapshot"), (1, 2 * per_epoch - 1, "snapshot"), (2, 3 * per_epoch - 1, "drained")]
    snapshot = out / "snapshots" / f"step_{2 * per_epoch - 1:08d}"
    states = [load_state(snapshot / f"stage{k}.cbor") for k in range(3)]
    assert all(state.step == 2 * per_epoch - 1 for state in states)
    data = load_dataset("digits-image")
    loss, accuracy = StateScorer(plans[3], load_manifest(plans[3])).evaluate(states, data.x_test, data.y_test)
    assert (loss, accuracy) == pytest.approx((evals[1]["test_loss"], evals[1]["test_accuracy"]), rel=1e-9)


def test_worker_refuses_a_stage_whose_file_fails_its_hash(cluster, plans):
    manifest = load_manifest(plans[3])
    entry = manifest.stages[1]
    files = {a.role: (plans[3] / a.path).read_bytes() for a in entry.artifacts}
    files["backward"] = files["backward"][:-1] + bytes([files["backward"][-1] ^ 1])
    assignment = StageAssignment(run_id="tamper", entry=entry, stages=3,
                                 peers=Peers(None, None, "coap+tcp://127.0.0.1:9"),
                                 settings=RunSettings(manifest.training))
    with SyncClient.start() as client:
        with pytest.raises(BadRequest, match="backward.onnx does not match the manifest"):
            client.request("PUT", cluster.urls[1], STAGE, assignment.to_envelope(files))
        assert client.get(cluster.urls[1], "health").ok  # still serving


def test_worker_refuses_tensors_of_the_wrong_shape(cluster, plans):
    manifest = load_manifest(plans[3])
    entry = manifest.stages[1]
    files = {a.role: (plans[3] / a.path).read_bytes() for a in entry.artifacts}
    nowhere = "coap+tcp://127.0.0.1:9"
    assignment = StageAssignment(run_id="shapes", entry=entry, stages=3, peers=Peers(nowhere, nowhere, nowhere),
                                 settings=RunSettings(manifest.training))
    (spec,) = entry.inputs
    good = [4 if d == "N" else int(d) for d in spec.shape]
    with SyncClient.start() as client:
        client.request("PUT", cluster.urls[1], STAGE, assignment.to_envelope(files))
        client.send(cluster.urls[1], RUN, Segment("gpipe", 3, 0, 2, 8, 2).to_envelope("shapes"))
        try:
            wrong = Envelope(kind="activations", run_id="shapes", step=0, microbatch=0, stage=1,
                             tensors={spec.name: np.zeros([*good[:-1], good[-1] + 1], np.float32)})
            with pytest.raises(BadRequest, match=rf"{spec.name!r} has shape \[4, .*\], expected \['N', "):
                client.send(cluster.urls[1], "act", wrong)
            unknown = Envelope(kind="activations", run_id="other-run", stage=1,
                               tensors={spec.name: np.zeros(good, np.float32)})
            with pytest.raises(BadRequest, match="run 'other-run'"):
                client.send(cluster.urls[1], "act", unknown)
            assert client.get(cluster.urls[1], "health").ok
        finally:
            client.post(cluster.urls[1], STOP, b"test over")


def test_data_that_does_not_fit_the_plan(plans, tmp_path):
    path = tmp_path / "wrong.npz"
    np.savez(path, x=np.zeros((100, 64), np.float32), y=np.zeros(100, np.int64))
    with pytest.raises(EdgertError, match=r"samples of shape \(64,\).* takes \(1, 8, 8\)"):
        run(plans[3], ["coap+tcp://127.0.0.1:9"] * 3, tmp_path / "x", data=str(path))


def test_unreachable_worker_is_a_clear_error_not_a_hang(plans, tmp_path):
    started = time.monotonic()
    with pytest.raises(TrainingError, match=r"worker coap\+tcp://127.0.0.1:9 is not reachable"):
        run(plans[1], ["coap+tcp://127.0.0.1:9"], tmp_path / "x", connect_timeout=2.0)
    assert time.monotonic() - started < 20


def test_worker_shuts_down_cleanly_on_sigterm():
    process = subprocess.Popen([sys.executable, "-m", "edgert", "worker", "--listen", "coap+tcp://127.0.0.1:0",
                                "--insecure", "--name", "short-lived"], stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on coap+tcp://127.0.0.1:" in process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
        assert "stopped" in process.stdout.read()
    finally:
        process.kill()
        process.stdout.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_forced_replan_changes_nothing_learned(cluster, plans, tmp_path, schedule):
    """Cuts move before step 10 (parameters and optimizer state migrate between workers)."""
    moved = run(plans[3], cluster.urls, tmp_path / "moved", schedule=schedule, steps=20,
                replan_at=((10, (1, 4)),))
    still = run(plans[3], cluster.urls, tmp_path / "still", schedule=schedule, steps=20)
    assert moved.replans == 1 and moved.steps == still.steps == 20
    events = [m for m in read_metrics(tmp_path / "moved") if m.get("event") == "replan"]
    assert len(events) == 1 and events[0]["before_step"] == 10 and events[0]["bytes_moved"] > 0
    assert events[0]["new_cuts"] != events[0]["old_cuts"] and events[0]["pause_s"] > 0
    assert load_manifest(tmp_path / "moved" / "plan", verify=False).cuts == tuple(events[0]["new_cuts"])
    split, whole = stage_parameters(tmp_path / "moved", 3), stage_parameters(tmp_path / "still", 3)
    worst = max(float(np.max(np.abs(split[n] - whole[n]))) / max(float(np.max(np.abs(whole[n]))), 1e-3)
                for n in whole)
    assert worst <= 1e-4, f"largest relative parameter difference {worst:.2e}"
