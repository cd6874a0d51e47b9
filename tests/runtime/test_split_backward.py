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


def test_profile_times_the_weight_half_of_every_unit_after_the_first(tmp_path):
    from edgert.coordinator.profiling import profile_devices

    save_model(build_model("mlp"), tmp_path / "mlp.onnx")
    with LocalCluster(1) as one:
        (split,) = profile_devices(tmp_path / "mlp.onnx", one.urls, repeats=2, split_backward=True).devices
        (whole,) = profile_devices(tmp_path / "mlp.onnx", one.urls, repeats=1).devices
    assert split.blocks[0].weight_ms == 0.0  # the first unit is a first stage: its backward is not split
    assert all(0.0 < t.weight_ms < t.backward_ms for t in split.blocks[1:]), split.blocks
    assert all(t.weight_ms == 0.0 for t in whole.blocks)


def test_a_plan_made_for_the_split_moves_the_cut_and_train_runs_it_split(tmp_path):
    """Four equal blocks (forward 1 ms, backward 4 ms of which 2 weight gradients) on two devices: one backward per
    micro-batch, cut 2 is best (10, 8); split, the last stage pays 2 a block, and cut 1 is (5, 6)."""
    from click.testing import CliRunner

    from edgert.cli import main
    from edgert.devices import BlockTiming, DeviceProfile, DevicesFile, LinkProfile, save_devices
    from edgert.exporter.device_plan import load_placement
    from edgert.exporter.source import load_source_model

    save_model(build_model("mlp"), tmp_path / "mlp.onnx")
    blocks = ("fc1", "fc2", "fc3", "head")
    sha = load_source_model(tmp_path / "mlp.onnx").sha256
    runner = CliRunner()
    with LocalCluster(2, log_dir=tmp_path / "logs", extra_args=["--log-level", "info"]) as cluster:
        for name, weight in (("measured", 2.0), ("unmeasured", 0.0)):
            timings = tuple(BlockTiming(block, forward_ms=1.0, backward_ms=4.0, weight_ms=weight) for block in blocks)
            devices = tuple(DeviceProfile(name=f"dev{k}", url=url, memory_bytes=1 << 32, blocks=timings)
                            for k, url in enumerate(cluster.urls))
            links = tuple(LinkProfile(a.name, b.name, bandwidth_bytes_per_s=1e9, rtt_ms=0.05)
                          for a in devices for b in devices if a is not b)
            save_devices(DevicesFile(model_sha256=sha, blocks=blocks, micro_batch=16, devices=devices, links=links),
                         tmp_path / f"{name}.json")
        shown = {}
        for name, devices_file, flag in (("whole", "measured", "--whole-backward"),
                                         ("split", "measured", "--split-backward"),
                                         ("uncosted", "unmeasured", "--split-backward")):
            shown[name] = runner.invoke(main, ["plan", str(tmp_path / "mlp.onnx"), "--devices",
                                               str(tmp_path / f"{devices_file}.json"), "-o", str(tmp_path / name),
                                               "--no-groups", "--micro-batches", "4", flag])
            assert shown[name].exit_code == 0, shown[name].output
        whole, split, uncosted = (load_placement(tmp_path / name) for name in ("whole", "split", "uncosted"))
        assert not whole.split_backward and [len(s.blocks) for s in whole.stages] == [2, 2]
        assert split.split_backward and [len(s.blocks) for s in split.stages] == [1, 3]
        assert split.bottleneck_ms == pytest.approx(6.0, abs=0.1) and whole.bottleneck_ms == pytest.approx(10, abs=0.1)
        assert "weight gradients once a step" in shown["split"].output and "warning" not in shown["split"].output
        assert "has no weight-gradient times" in shown["uncosted"].output
        assert [len(s.blocks) for s in uncosted.stages] == [2, 2]  # costed whole
        for name, options in (("run", {}), ("run-whole", {"split_backward": False})):
            summary = train(TrainConfig(plan_dir=tmp_path / "split", workers=tuple(split.workers),
                                        out_dir=tmp_path / name, steps=3, listen="coap+tcp://127.0.0.1:0",
                                        progress=False, **options))
            assert summary.steps == 3
    assert weight_spans(tmp_path / "run") == {1: 3}  # as planned: the stage after the first split
    assert weight_spans(tmp_path / "run-whole") == {}  # --whole-backward overrides the plan
    log = (tmp_path / "logs" / f"{cluster.names[cluster.urls.index(split.stages[1].url)]}.log").read_text()
    assert "weight gradients once a step" in log
