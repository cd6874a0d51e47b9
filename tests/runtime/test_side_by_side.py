"""Forward and backward side by side: real workers run a stage's forwards on a lane of their own, beside
its backwards, and train to the same parameters as one after the other."""

import json

import numpy as np
import pytest

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.exporter.export import ExportOptions, export_plan
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
    assert sum(overlaps(tmp_path / "side").values()) >= 3  # the first two stages computed both at once


def test_stages_whose_forward_updates_running_statistics_stay_one_after_the_other(cluster, plans, tmp_path):
    summary = run(plans["cnn"], cluster, tmp_path / "cnn", side_by_side=True)
    assert summary.steps == 6
    assert not any(overlaps(tmp_path / "cnn").values())
