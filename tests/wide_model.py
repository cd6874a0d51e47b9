"""A wide MLP built without torch (the zoo's layers, seeded): stages whose state is far over one message.

Width 2048 and 6 hidden layers on the flattened digits: 25.3 million parameters; with AdamW's two
buffers a stage of half of it holds about 150 MB of state, over twice the 64 MiB one CoAP message carries.
"""

from __future__ import annotations

from pathlib import Path

from edgert.models import ModelSpec, mlp_deep, save_model

WIDTH = 2048
LAYERS = 6
SPEC = ModelSpec(name="mlp-wide", description="a wide MLP for large stage states", builder="mlp_deep",
                 input_shape=(64,), input_dtype="float32", num_classes=10, dataset="digits-flat",
                 blocks=("embed", *(f"layer{k}" for k in range(LAYERS)), "head"), skip_cuts=())


def wide_mlp(path: Path, width: int = WIDTH, layers: int = LAYERS, seed: int = 0) -> Path:
    """The wide MLP saved at ``path``: 64 -> ``width`` -> ``layers`` x (``width`` -> ``width``) -> 10."""
    metadata = {key: value for key, value in SPEC.metadata(seed).items() if key != "edgert.model"}  # not the zoo's
    save_model(mlp_deep.build(SPEC, seed, width, layers, metadata), path)
    return path
