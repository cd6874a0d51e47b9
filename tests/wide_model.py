"""A wide MLP built without torch (the zoo's layers, seeded): stages whose state is far over one message.

Width 2048 and 6 hidden layers on the flattened digits: 25.3 million parameters; with AdamW's two
buffers a stage of half of it holds about 150 MB of state, over twice the 64 MiB one CoAP message carries.
"""

from __future__ import annotations

from pathlib import Path

from edgert.models import ModelSpec, save_model
from edgert.models.graph import GraphBuilder
from edgert.models.layers import linear

WIDTH = 2048
LAYERS = 6
SPEC = ModelSpec(name="mlp-wide", description="a wide MLP for large stage states", builder="",
                 input_shape=(64,), input_dtype="float32", num_classes=10, dataset="digits-flat",
                 blocks=("embed", *(f"layer{k}" for k in range(LAYERS)), "head"), skip_cuts=())


def wide_mlp(path: Path, width: int = WIDTH, layers: int = LAYERS, seed: int = 0) -> Path:
    """The wide MLP saved at ``path``: 64 -> ``width`` -> ``layers`` x (``width`` -> ``width``) -> 10."""
    b = GraphBuilder(SPEC.name, seed)
    x = b.input(SPEC.input_name, SPEC.input_dtype, ["N", *SPEC.input_shape])
    with b.block("embed"):
        x = b.op("Relu", [linear(b, x, "linear", SPEC.input_shape[0], width, relu_follows=True)])
    for index in range(layers):
        with b.block(f"layer{index}"):
            x = b.op("Relu", [linear(b, x, "linear", width, width, relu_follows=True)])
    with b.block("head"):
        logits = linear(b, x, "linear", width, SPEC.num_classes, relu_follows=False, output=SPEC.output_name)
    metadata = {key: value for key, value in SPEC.metadata(seed).items() if key != "edgert.model"}  # not the zoo's
    save_model(b.model(logits, "float32", ["N", SPEC.num_classes], metadata), path)
    return path
