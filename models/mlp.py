"""mlp: the 64 digit pixels through three ReLU hidden layers to 10 logits.

Blocks: ``fc1`` (Gemm 64->128, ReLU), ``fc2`` (Gemm 128->64, ReLU), ``fc3`` (Gemm 64->64,
ReLU), ``head`` (Gemm 64->10): four blocks, so it can be cut into up to four stages.
The smallest zoo model: a chain, so every cut is crossed by exactly one tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgert.models.graph import GraphBuilder
from edgert.models.layers import linear

if TYPE_CHECKING:
    import onnx

    from edgert.models import ModelSpec

HIDDEN = (128, 64, 64)


def build(spec: ModelSpec, seed: int) -> onnx.ModelProto:
    """The mlp model for ``spec`` (input [N, 64] float32, logits [N, classes])."""
    b = GraphBuilder(spec.name, seed)
    x = b.input(spec.input_name, spec.input_dtype, ["N", *spec.input_shape])
    width = spec.input_shape[0]
    for index, hidden in enumerate(HIDDEN, start=1):
        with b.block(f"fc{index}"):
            x = b.op("Relu", [linear(b, x, "linear", width, hidden, relu_follows=True)])
        width = hidden
    with b.block("head"):
        logits = linear(
            b, x, "linear", width, spec.num_classes, relu_follows=False, output=spec.output_name
        )
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed))
