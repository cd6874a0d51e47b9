"""The backward split in two on real workers: each stage after the first computes its parameter gradients once
a step (its ``W`` span), and the run trains to the parameters of one backward per micro-batch."""

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
STEPS = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(3, log_dir=tmp_path_factory.mktemp("worker-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    save_model(build_model("mlp"), folder / "mlp.onnx")
    export_plan(folder / "mlp.onnx", folder / "plan",
                ExportOptions(stages=3, training=TrainingConfig(learning_rate=3e-3)))
    return folder / "plan"


def run(plan, cluster, out, **options):
    config = TrainConfig(plan_dir=plan, workers=tuple(cluster.urls), out_dir=out, data="digits", steps=STEPS,
                         micro_batches=4, seed=3, listen="coap+tcp://127.0.0.1:0", progress=False,
                         replicate_every=0, central_every=0, **options)
    return train(config)


def weight_spans(out):
    """Per stage, how many ``W`` spans its worker's trace holds."""
    spans = [e for e in json.loads((out / "trace.json").read_text()) if e.get("ph") == "X" and e["name"][0] == "W"]
    counted: dict[int, int] = {}
    for span in spans:
        counted[span["args"]["stage"]] = counted.get(span["args"]["stage"], 0) + 1
    return counted


@pytest.mark.parametrize("memory_mode,schedule", [("recompute", "1f1b"), ("stash", "1f1b"), ("stash", "gpipe"),
                                                  ("recompute", "async")])
def test_split_backward_trains_to_the_same_parameters(cluster, plan, tmp_path, memory_mode, schedule):
    whole = run(plan, cluster, tmp_path / "whole", memory_mode=memory_mode, schedule=schedule)
    split = run(plan, cluster, tmp_path / "split", memory_mode=memory_mode, schedule=schedule, split_backward=True)
    assert whole.steps == split.steps == STEPS
    expected, got = final_parameters(tmp_path / "whole"), final_parameters(tmp_path / "split")
    assert expected.keys() == got.keys() and expected
    for name in expected:  # the weight gradients summed in another order, which Adam's updates magnify
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=2e-5, err_msg=name)
    assert split.test_loss == pytest.approx(whole.test_loss, rel=1e-5)
    assert not weight_spans(tmp_path / "whole")
    if schedule != "async":  # under async each backward's weights are computed at once, with its stashed weights
        assert weight_spans(tmp_path / "split") == {1: STEPS, 2: STEPS}  # the first stage keeps its backward
