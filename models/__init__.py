"""edgert.models: the model zoo (ONNX builders) and the small offline datasets.

Map of the package:

- ``__init__.py``     :class:`ModelSpec`, the registry: :func:`list_models`,
                      :func:`get_model_spec`, :func:`build_model`, :func:`save_model`
- ``errors.py``       :class:`UnknownModelError`, :class:`ModelBuildError`, :class:`DatasetError`
- ``datasets.py``     ``load_dataset``: every data format behind one resolver (a name, or what a path holds)
- ``samples.py``      :class:`Dataset`, rows read on demand (:class:`RowSubset`), the seeded splits
- ``digits.py``       ``digits``: scikit-learn's bundled 8x8 digits (imported by name: it needs scikit-learn)
- ``tokens.py``       ``synthetic_tokens``: the majority-marker task (imported by name)
- ``npz_data.py``     ``load_npz``: your own arrays in an .npz archive
- ``csv_data.py``     ``load_csv``: a CSV of features with a label column, streamed into a memory map
- ``image_folder.py`` ``load_image_folder``, ``read_image``: images in class subfolders (Pillow, when read)
- ``data_settings.py`` :class:`DataSettings`: how a run read its data, kept in its ``data.json``
- ``graph.py``        :class:`GraphBuilder`: ``/<block>/<sub>/<OpType>`` node names, seeded
                      ``<block>.<sub>.<kind>`` initializers, opset 17 / IR 8 models
- ``layers.py``       conv, batch_norm, relu6, linear, projection, layer_norm, gelu
- ``mlp.py``          ``mlp``: three ReLU hidden layers on the flattened digits
- ``mlp_deep.py``     ``mlp-deep``: a stack of identical ReLU layers (equal blocks for benchmarks)
- ``cnn.py``          ``cnn``: three Conv-BN-ReLU blocks and a two-layer head on 8x8 digits
- ``resnet.py``       ``resnet-mini``: residual blocks split in two cut units (cuts cross skips)
- ``mobilenet.py``    ``mobilenet-mini``: depthwise-separable Conv blocks with BN and ReLU6
- ``transformer.py``  ``transformer-mini``: two pre-LN transformer layers on token sequences
- ``fitting_set.py``  :data:`EXTRA_MODELS`: the models the latency predictor is fitted on besides the zoo

Each model module has one ``build(spec, seed)``. Importing this package, the registry and the data
formats imports neither onnx nor scikit-learn (a board reads data and evaluates models without
them): builders and named data sets are imported by name when one is built or loaded.
docs/MODELS.md describes every model and data format. Of ``edgert`` it imports only ``edgert.errors``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgert.models.datasets import Dataset, load_dataset
from edgert.models.errors import DatasetError, ModelBuildError, UnknownModelError

ModelProto = Any  # onnx.ModelProto, named without importing onnx, which a board does not have

__all__ = [
    "Dataset",
    "DatasetError",
    "ModelBuildError",
    "ModelSpec",
    "UnknownModelError",
    "build_model",
    "get_model_spec",
    "list_models",
    "load_dataset",
    "save_model",
]


@dataclass(frozen=True)
class ModelSpec:
    """What a zoo model takes, returns and trains on; shapes are without the batch dimension."""

    name: str
    description: str
    builder: str  # module in edgert.models whose build(spec, seed) emits the model
    input_shape: tuple[int, ...]
    input_dtype: str
    num_classes: int
    dataset: str  # "digits-flat", "digits-image" or "tokens"
    blocks: tuple[str, ...]  # the cut units, in graph order
    skip_cuts: tuple[tuple[str, str], ...]  # (before, after) cuts crossed by a skip connection
    input_name: str = "input"
    output_name: str = "logits"
    vocab_size: int = 0  # token ids are 0..vocab_size-1 for integer inputs; 0 for float inputs
    label_name: str = "labels"
    label_shape: tuple[int, ...] = ()
    label_dtype: str = "int64"
    loss: str = "cross_entropy"

    def metadata(self, seed: int) -> dict[str, str]:
        """The ``edgert.*`` metadata_props the exporter reads as defaults."""
        return {
            "edgert.model": self.name,
            "edgert.loss": self.loss,
            "edgert.dataset": self.dataset,
            "edgert.num_classes": str(self.num_classes),
            "edgert.label": self.label_name,
            "edgert.seed": str(seed),
        }


_SPECS = (
    ModelSpec(
        name="mlp",
        description="three ReLU hidden layers (128, 64, 64) on the 64 flattened digit pixels",
        builder="mlp",
        input_shape=(64,),
        input_dtype="float32",
        num_classes=10,
        dataset="digits-flat",
        blocks=("fc1", "fc2", "fc3", "head"),
        skip_cuts=(),
    ),
    ModelSpec(
        name="mlp-deep",
        description="24 identical ReLU layers (256 wide) on the flattened digits: equal blocks for benchmarks",
        builder="mlp_deep",
        input_shape=(64,),
        input_dtype="float32",
        num_classes=10,
        dataset="digits-flat",
        blocks=("embed", *(f"layer{k}" for k in range(24)), "head"),
        skip_cuts=(),
    ),
    ModelSpec(
        name="cnn",
        description="three Conv-BN-ReLU blocks (two max-pooled) and a two-layer head on 8x8 digits",
        builder="cnn",
        input_shape=(1, 8, 8),
        input_dtype="float32",
        num_classes=10,
        dataset="digits-image",
        blocks=("conv1", "conv2", "conv3", "fc", "head"),
        skip_cuts=(),
    ),
    ModelSpec(
        name="resnet-mini",
        description="stem and three residual blocks, each split in two cut units: cuts cross skips",
        builder="resnet",
        input_shape=(1, 8, 8),
        input_dtype="float32",
        num_classes=10,
        dataset="digits-image",
        blocks=("stem", "res1a", "res1b", "res2a", "res2b", "res3a", "res3b", "head"),
        skip_cuts=(("res1a", "res1b"), ("res2a", "res2b"), ("res3a", "res3b")),
    ),
    ModelSpec(
        name="mobilenet-mini",
        description="stem and four depthwise-separable Conv blocks with BN and ReLU6 on 8x8 digits",
        builder="mobilenet",
        input_shape=(1, 8, 8),
        input_dtype="float32",
        num_classes=10,
        dataset="digits-image",
        blocks=("stem", "ds1", "ds2", "ds3", "ds4", "head"),
        skip_cuts=(),
    ),
    ModelSpec(
        name="transformer-mini",
        description="two pre-LN transformer layers (2 heads, d=32) classifying 16-token sequences",
        builder="transformer",
        input_shape=(16,),
        input_dtype="int64",
        num_classes=4,
        dataset="tokens",
        blocks=("embed", "attn1", "mlp1", "attn2", "mlp2", "head"),
        skip_cuts=(),
        vocab_size=32,
    ),
)
_BY_NAME = {spec.name: spec for spec in _SPECS}


def list_models() -> list[ModelSpec]:
    """Every zoo model, in the order they are documented."""
    return list(_SPECS)


def get_model_spec(name: str) -> ModelSpec:
    """The spec of zoo model ``name``; an unknown name raises with the known ones listed."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        known = ", ".join(_BY_NAME)
        raise UnknownModelError(f"unknown model {name!r}; the zoo has: {known}") from None


def build_model(name: str, seed: int = 0) -> ModelProto:
    """Build zoo model ``name`` with weights drawn from ``seed`` (same seed, same bytes)."""
    spec = get_model_spec(name)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ModelBuildError(f"seed must be a non-negative integer, got {seed!r}")
    builder = importlib.import_module(f"edgert.models.{spec.builder}")
    return builder.build(spec, seed)


def save_model(model: ModelProto, path: str | Path) -> Path:
    """Write ``model`` to ``path`` (parent folders are created) and return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(model.SerializeToString())
    return target
