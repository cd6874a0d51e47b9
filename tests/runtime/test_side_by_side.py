"""Forward and backward side by side: real workers run a stage's forwards on a lane of their own, beside
its backwards, and train to the same parameters as one after the other."""

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from edgert.cli import main
from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.devices import BlockTiming, DeviceProfile, DevicesFile, LinkProfile, save_devices
from edgert.exporter.device_plan import load_placement
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.source import load_source_model
from edgert.manifest import TrainingConfig
from edgert.models import build_model, save_model
from tests.running_coordinator import final_parameters

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # emulated 3x slower devices: each call's time is long enough for the two lanes to overlap visibly
    with LocalCluster(3, slowdowns=["3"] * 3, log_dir=tmp_path_factory.mktemp("worker-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    plans = {}
    for model in ("mlp", "cnn"):  # cnn's BatchNorm forwards update running statistics
        save_model(build_model(model), folder / f"{model}.onnx")
        export_plan(folder / f"{model}.onnx", folder / model,
                    ExportOptions(stages=3, training=TrainingConfig(learning_rate=3e-3)))
        plans[model] = folder / model
    return plans


def run(plan, cluster, out, **options):
    config = TrainConfig(plan_dir=plan, workers=tuple(cluster.urls), out_dir=out, data="digits", steps=6,
                         micro_batches=8, seed=3, listen="coap+tcp://127.0.0.1:0", progress=False,
                         replicate_every=0, central_every=0, **options)
    return train(config)


def overlaps(out):
    """Per worker track: how many forward spans overlap a backward span in time."""
    spans = [e for e in json.loads((out / "trace.json").read_text()) if e.get("ph") == "X"]
    counted = {}
    for track in {e["tid"] for e in spans}:
        forwards = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == track and e["name"][0] == "F"]
        backwards = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == track and e["name"][0] == "B"]
        counted[track] = sum(any(f0 < b1 and b0 < f1 for b0, b1 in backwards) for f0, f1 in forwards)
    return counted


@pytest.mark.parametrize("memory_mode", ["recompute", "stash"])
def test_side_by_side_trains_to_the_same_parameters(cluster, plans, tmp_path, memory_mode):
    one_after = run(plans["mlp"], cluster, tmp_path / "sequential", memory_mode=memory_mode)
    beside = run(plans["mlp"], cluster, tmp_path / "side", memory_mode=memory_mode, side_by_side=True)
    assert one_after.steps == beside.steps == 6
    expected, got = final_parameters(tmp_path / "sequential"), final_parameters(tmp_path / "side")
    assert expected.keys() == got.keys() and expected
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6, err_msg=name)
    assert beside.test_loss == pytest.approx(one_after.test_loss, abs=1e-5)
    assert not any(overlaps(tmp_path / "sequential").values())  # one thread: a forward never meets a backward
    assert sum(overlaps(tmp_path / "side").values()) >= 1  # the first two stages computed both at once


def test_stages_whose_forward_updates_running_statistics_stay_one_after_the_other(cluster, plans, tmp_path):
    summary = run(plans["cnn"], cluster, tmp_path / "cnn", side_by_side=True)
    assert summary.steps == 6
    assert not any(overlaps(tmp_path / "cnn").values())


def test_a_plan_made_side_by_side_moves_the_cut_and_splits_the_cores_and_train_runs_it(tmp_path):
    """Four equal blocks (forward 1 ms, backward 2 ms) on two 4-core devices: one after the other a non-last stage
    costs 3 ms a block and the last 2, so the first stage gets one block; side by side both cost 2, so the
    cut moves to the middle and the first stage's cores split 1 forward, 3 backward."""
    save_model(build_model("mlp"), tmp_path / "mlp.onnx")
    blocks = ("fc1", "fc2", "fc3", "head")
    timings = tuple(BlockTiming(block, forward_ms=1.0, backward_ms=2.0) for block in blocks)
    with LocalCluster(2, log_dir=tmp_path / "logs", extra_args=["--log-level", "info"]) as cluster:
        devices = tuple(DeviceProfile(name=f"dev{k}", url=url, memory_bytes=1 << 32, cores=4, blocks=timings,
                                      whole=BlockTiming("whole", forward_ms=4.0, backward_ms=8.0))
                        for k, url in enumerate(cluster.urls))
        links = tuple(LinkProfile(a.name, b.name, bandwidth_bytes_per_s=1e9, rtt_ms=0.05)
                      for a in devices for b in devices if a is not b)
        path = save_devices(DevicesFile(model_sha256=load_source_model(tmp_path / "mlp.onnx").sha256, blocks=blocks,
                                        micro_batch=16, devices=devices, links=links), tmp_path / "devices.json")
        runner = CliRunner()
        for name, flag in (("one-after", "--one-after-the-other"), ("side", "--side-by-side")):
            shown = runner.invoke(main, ["plan", str(tmp_path / "mlp.onnx"), "--devices", str(path), "-o",
                                         str(tmp_path / name), "--no-groups", flag])
            assert shown.exit_code == 0, shown.output
        one_after, side = load_placement(tmp_path / "one-after"), load_placement(tmp_path / "side")
        assert not one_after.side_by_side and [len(s.blocks) for s in one_after.stages] == [1, 3]
        assert side.side_by_side and [len(s.blocks) for s in side.stages] == [2, 2]
        assert [(s.forward_threads, s.backward_threads) for s in side.stages] == [(1, 3), (4, 4)]
        assert side.predicted_step_ms < one_after.predicted_step_ms and "1/3" in shown.output
        summary = train(TrainConfig(plan_dir=tmp_path / "side", workers=tuple(side.workers), out_dir=tmp_path / "run",
                                    steps=4, listen="coap+tcp://127.0.0.1:0", progress=False))
        assert summary.steps == 4
    logs = [(tmp_path / "logs" / f"{cluster.names[cluster.urls.index(stage.url)]}.log").read_text()
            for stage in side.stages]
    assert "stage 0 of run" in logs[0] and "ORT threads 1 forward, 3 backward, side by side" in logs[0]
    assert "stage 1 of run" in logs[1] and "ORT threads 4 forward, 4 backward, side by side" in logs[1]


def test_profile_times_the_whole_model_at_more_threads_and_the_planner_fits_them(tmp_path):
    from edgert.coordinator.profiling import profile_devices, thread_counts
    from edgert.devices import load_devices, save_devices
    from edgert.exporter.planner.profile_costs import parallel_fractions
    from edgert.exporter.planner.replanner import Replanner
    from edgert.manifest import load_manifest

    assert thread_counts(1) == [] and thread_counts(2) == [2] and thread_counts(6) == [2, 4, 6]
    save_model(build_model("mlp"), tmp_path / "mlp.onnx")
    with LocalCluster(1) as one:
        measured = profile_devices(tmp_path / "mlp.onnx", one.urls, repeats=2)
    (device,) = load_devices(save_devices(measured, tmp_path / "devices.json")).devices
    assert [s.threads for s in device.scaling] == thread_counts(device.cores)
    assert all(s.forward_ms > 0 and s.backward_ms > 0 for s in device.scaling)
    fractions = parallel_fractions(device)
    assert set(fractions) == ({"forward_parallel", "backward_parallel"} if device.cores > 1 else set())
    assert all(0.0 <= value <= 1.0 for value in fractions.values())
    export_plan(tmp_path / "mlp.onnx", tmp_path / "plan", ExportOptions(stages=1))
    replanner = Replanner(tmp_path / "plan", load_manifest(tmp_path / "plan"), tmp_path / "cache",
                          devices=tmp_path / "devices.json", side_by_side=True)
    (costs,) = replanner.problem([device.name]).devices
    assert (costs.forward_parallel, costs.backward_parallel) == (fractions.get("forward_parallel", 0.0),
                                                                 fractions.get("backward_parallel", 0.0))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_worker_pinned_to_one_core_reports_one_core_and_is_not_timed_at_more_threads(tmp_path):
    from edgert.coordinator.profiling import profile_devices

    save_model(build_model("mlp"), tmp_path / "mlp.onnx")
    with LocalCluster(1, cores=[{min(os.sched_getaffinity(0))}]) as pinned:  # as under taskset
        (device,) = profile_devices(tmp_path / "mlp.onnx", pinned.urls, repeats=1).devices
    assert device.cores == 1 and device.scaling == ()
