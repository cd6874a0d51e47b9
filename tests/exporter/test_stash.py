"""Activation stashing: the split training graph computes exactly what recomputation does."""

import numpy as np
import pytest

from edgert.chain import StageChain
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
from edgert.exporter.source import from_model_proto
from edgert.manifest import TrainingConfig
from edgert.models import build_model, get_model_spec, load_dataset


@pytest.mark.parametrize("name", ["cnn", "resnet-mini", "transformer-mini", "mobilenet-mini"])
def test_stashing_equals_recomputation(tmp_path, name):
    source = from_model_proto(build_model(name), f"{name}.onnx")
    training = TrainingConfig(learning_rate=3e-3)
    options = ExportOptions(stages=3, training=training)
    analysis = prepare_analysis(source, options)
    manifest = write_plan(source, analysis, choose_cuts(analysis, options), tmp_path / "plan", training)
    assert all(stage.saved for stage in manifest.stages[:-1]) and not manifest.stages[-1].saved
    assert {"forward_stash", "backward_stash"} <= {a.role for a in manifest.stages[0].artifacts}
    spec = get_model_spec(name)
    data = load_dataset(spec.dataset, spec)
    x, y = data.x_train[:32], data.y_train[:32]
    chains = {mode: StageChain(tmp_path / "plan", memory_mode=mode) for mode in ("recompute", "stash")}
    for _ in range(3):
        losses = {mode: chain.train_batch({"input": x}, {"labels": y}, micro_batches=2).loss
                  for mode, chain in chains.items()}
        assert losses["stash"] == pytest.approx(losses["recompute"], rel=1e-6)
        for chain in chains.values():
            chain.step()
    recompute, stash = chains["recompute"].parameters(), chains["stash"].parameters()
    for key in recompute:  # includes BatchNorm running statistics, which move once per micro-batch in both
        np.testing.assert_allclose(stash[key], recompute[key], rtol=1e-5, atol=1e-6, err_msg=key)
