"""A model whose stages' states are far over one CoAP message (64 MiB) trains, survives a ``kill -9`` of a
worker and of the coordinator, resumes and merges: every state moves in pieces (docs/PROTOCOL.md §12).

The model is the wide MLP of tests/wide_model.py (25.3 million parameters, built without torch) in 3
stages: each stage's state (parameters and AdamW's two buffers) is 100 to 150 MB. Stage assignments,
the coordinator's quick profile (the whole model at once), replicas, central copies, checkpoints,
the recovery's migration, the resume and the merge all carry it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgert.manifest import load_manifest
from tests.faulty_runs import FaultyRun, train_through_faults
from tests.wide_model import wide_mlp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TRAIN_SAMPLES, TEST_SAMPLES = 128, 64  # an epoch is 8 steps of 16: a checkpoint every 8


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
    train_through_faults(wide_plan, small_data(tmp_path / "data.npz"), 3,
                         FaultyRun(steps=32, batch_size=16, kill_worker_at=10, kill_coordinator_at=20), tmp_path)
