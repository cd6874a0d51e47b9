"""`edgert plan --groups` proposes a group where one pays, prints it, and `edgert train` runs what it wrote."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from edgert.cli import main
from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.devices import BlockTiming, DeviceProfile, DevicesFile, LinkProfile, save_devices
from edgert.exporter.device_plan import load_placement
from edgert.exporter.source import load_source_model
from edgert.models import build_model, save_model

pytestmark = pytest.mark.timeout(300)

BLOCKS = ("fc1", "fc2", "fc3", "head")


def devices_json(model, urls, path):
    """Two equal devices on a fast link, measured on a model whose first block does nearly all the work: no cut
    can share it, a group can."""
    timings = tuple(BlockTiming(block, forward_ms=40.0 if block == "fc1" else 0.2,
                                backward_ms=80.0 if block == "fc1" else 0.4) for block in BLOCKS)
    whole = BlockTiming("whole", forward_ms=41.0, backward_ms=82.0)
    devices = tuple(DeviceProfile(name=f"dev{k}", url=url, memory_bytes=1 << 32, cores=1, blocks=timings,
                                  whole=whole) for k, url in enumerate(urls))
    links = tuple(LinkProfile(a.name, b.name, bandwidth_bytes_per_s=1e9, rtt_ms=0.05)
                  for a in devices for b in devices if a is not b)
    return save_devices(DevicesFile(model_sha256=load_source_model(model).sha256, blocks=BLOCKS, micro_batch=16,
                                    devices=devices, links=links), path)


def test_plan_offers_a_group_when_it_pays_and_train_runs_it(tmp_path):
    save_model(build_model("mlp"), tmp_path / "mlp.onnx")
    with LocalCluster(2) as cluster:
        devices = devices_json(tmp_path / "mlp.onnx", cluster.urls, tmp_path / "devices.json")
        runner = CliRunner()
        without = runner.invoke(main, ["plan", str(tmp_path / "mlp.onnx"), "--devices", str(devices), "-o",
                                       str(tmp_path / "plain"), "--json", "--no-groups"])
        assert without.exit_code == 0, without.output
        assert all(not stage["devices"] for stage in json.loads(without.output.splitlines()[-1])["stages"])
        shown = runner.invoke(main, ["plan", str(tmp_path / "mlp.onnx"), "--devices", str(devices), "-o",
                                     str(tmp_path / "grouped")])  # groups are offered by default
        assert shown.exit_code == 0, shown.output
        placement = load_placement(tmp_path / "grouped")
        (stage,) = placement.stages  # the whole model on both devices, each half of every micro-batch
        assert stage.devices == ("dev0", "dev1") and stage.urls == tuple(cluster.urls)
        assert stage.shares == pytest.approx((0.5, 0.5))
        assert "dev0 0.50 + dev1 0.50" in shown.output
        assert f"--workers {','.join(cluster.urls)}" in shown.output
        summary = train(TrainConfig(plan_dir=tmp_path / "grouped", workers=tuple(placement.workers),
                                    out_dir=tmp_path / "run", steps=4, listen="coap+tcp://127.0.0.1:0",
                                    progress=False))
        assert summary.steps == 4
