"""mlp-deep: the 64 digit pixels through a stack of identical ReLU layers to 10 logits.

Blocks: ``embed`` (Gemm 64->256, ReLU), ``layer0`` .. ``layer23`` (Gemm 256->256, ReLU),
``head`` (Gemm 256->10). Equal blocks make equal stages, and many of them let a planner
share the model among devices of very different speeds: the pipeline and heterogeneity
benchmarks train it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgert.models.graph import GraphBuilder
from edgert.models.layers import linear

if TYPE_CHECKING:
    import onnx

    from edgert.models import ModelSpec

WIDTH = 256
LAYERS = 24


def build(spec: ModelSpec, seed: int, width: int = WIDTH, layers: int = LAYERS,
          metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """The mlp-deep model for ``spec`` (input [N, 64] float32, logits [N, classes]); another ``width`` or
    number of ``layers`` makes a model of another size (blocks ``layer0`` .. ``layer<layers - 1>``)."""
    b = GraphBuilder(spec.name, seed)
    x = b.input(spec.input_name, spec.input_dtype, ["N", *spec.input_shape])
    with b.block("embed"):
        x = b.op("Relu", [linear(b, x, "linear", spec.input_shape[0], width, relu_follows=True)])
    for index in range(layers):
        with b.block(f"layer{index}"):
            x = b.op("Relu", [linear(b, x, "linear", width, width, relu_follows=True)])
    with b.block("head"):
        logits = linear(b, x, "linear", width, spec.num_classes, relu_follows=False, output=spec.output_name)
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed) if metadata is None else metadata)
