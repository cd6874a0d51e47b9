"""Every zoo model learns its data set quickly when trained through its stages.

This exercises the whole stage runtime: forward with batch statistics, backward,
optimizer, BatchNorm running statistics, and evaluation with the inference graphs.
"""

import numpy as np
import pytest

from edgert.chain import StageChain
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
from edgert.exporter.source import from_model_proto
from edgert.manifest import TrainingConfig
from edgert.models import build_model, get_model_spec, load_dataset

# (model, stages, epochs, learning rate, lowest acceptable test accuracy)
CASES = [
    ("mlp", 2, 3, 3e-3, 0.90),
    ("cnn", 3, 3, 3e-3, 0.90),
    ("resnet-mini", 4, 3, 3e-3, 0.90),
    ("mobilenet-mini", 2, 4, 3e-3, 0.85),
    ("transformer-mini", 3, 6, 3e-3, 0.80),
]


@pytest.mark.parametrize("name,stages,epochs,lr,floor", CASES)
def test_zoo_model_learns(tmp_path, name, stages, epochs, lr, floor):
    spec = get_model_spec(name)
    source = from_model_proto(build_model(name), f"{name}.onnx")
    training = TrainingConfig(learning_rate=lr)
    options = ExportOptions(stages=stages, training=training)
    analysis = prepare_analysis(source, options)
    write_plan(source, analysis, choose_cuts(analysis, options), tmp_path / "plan", training)
    chain = StageChain(tmp_path / "plan")
    data = load_dataset(spec.dataset, spec)
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        order = rng.permutation(len(data.x_train))
        for start in range(0, len(order) - 63, 64):
            index = order[start:start + 64]
            chain.train_batch({"input": data.x_train[index]}, {"labels": data.y_train[index]}, micro_batches=2)
            chain.step()
    logits = chain.infer({"input": data.x_test})
    accuracy = float(np.mean(logits.argmax(-1) == data.y_test))
    assert accuracy >= floor, f"{name}: test accuracy {accuracy:.3f} after {epochs} epochs"
