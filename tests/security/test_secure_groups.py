"""A group over coaps+tcp: members take row pieces from the neighbouring members' credentials, their peers'
gradients from the group's, and the coordinator their reports; the run equals the same run on plaintext."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict

import numpy as np
import pytest

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.exporter.device_plan import PLACEMENT_NAME, PlannedPlacement, PlannedStage
from edgert.manifest import load_manifest
from tests.running_coordinator import final_parameters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 10


def with_group(plan_dir, urls):
    """placement.json: stage 0 on urls[0], stage 1 on urls[1] and urls[2] (0.7 / 0.3), stage 2 on urls[3]."""
    entries = load_manifest(plan_dir).stages
    stages = (PlannedStage(0, entries[0].blocks, "w0", urls[0], 1.0, 1, 1),
              PlannedStage(1, entries[1].blocks, "w1", urls[1], 1.0, 1, 1, devices=("w1", "w2"),
                           urls=(urls[1], urls[2]), shares=(0.7, 0.3)),
              PlannedStage(2, entries[2].blocks, "w3", urls[3], 1.0, 1, 1))
    placement = PlannedPlacement(stages=stages, link_codecs=("none", "none"), link_ms=(1.0, 1.0), bottleneck_ms=1.0,
                                 predicted_step_ms=1.0, unused_devices=(), schedule="1f1b", batch_size=64,
                                 micro_batches=4, memory_mode="recompute")
    (plan_dir / PLACEMENT_NAME).write_text(json.dumps(asdict(placement)))


def test_a_group_trains_over_tls_as_on_plaintext(cluster, mlp_plan3, tmp_path):
    plan = shutil.copytree(mlp_plan3, tmp_path / "plan")
    names = ["w0", "w1", "w2", "w3"]
    with LocalCluster(4, names=names, credentials=cluster.workers, log_dir=tmp_path / "logs") as workers:
        with_group(plan, workers.urls)
        summary = train(TrainConfig(plan_dir=plan, workers=tuple(workers.urls), out_dir=tmp_path / "tls",
                                    steps=STEPS, listen="coaps+tcp://127.0.0.1:0", keys=cluster.keys, progress=False))
    assert summary.steps == STEPS
    with LocalCluster(4) as plain:
        with_group(plan, plain.urls)
        train(TrainConfig(plan_dir=plan, workers=tuple(plain.urls), out_dir=tmp_path / "plain", steps=STEPS,
                          listen="coap+tcp://127.0.0.1:0", progress=False))
    secure, plaintext = final_parameters(tmp_path / "tls"), final_parameters(tmp_path / "plain")
    assert all(np.array_equal(secure[name], plaintext[name]) for name in plaintext)
