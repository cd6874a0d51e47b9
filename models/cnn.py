"""cnn: digits as 1x8x8 images through three Conv-BN-ReLU blocks and a two-layer head.

Blocks: ``conv1`` (3x3 Conv 1->16, BN, ReLU; 8x8), ``conv2`` (3x3 Conv 16->32, BN, ReLU,
MaxPool; 4x4), ``conv3`` (3x3 Conv 32->64, BN, ReLU, MaxPool; 2x2), ``fc`` (Flatten,
Gemm 256->64, ReLU), ``head`` (Gemm 64->10). A chain: one tensor crosses every cut.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgert.models.graph import GraphBuilder
from edgert.models.layers import batch_norm, conv, linear

if TYPE_CHECKING:
    import onnx

    from edgert.models import ModelSpec

# (block, output channels, max-pool after) per conv block
CONV_BLOCKS = (("conv1", 16, False), ("conv2", 32, True), ("conv3", 64, True))
FC_WIDTH = 64


def build(spec: ModelSpec, seed: int) -> onnx.ModelProto:
    """The cnn model for ``spec`` (input [N, 1, 8, 8] float32, logits [N, classes])."""
    b = GraphBuilder(spec.name, seed)
    x = b.input(spec.input_name, spec.input_dtype, ["N", *spec.input_shape])
    channels, side = spec.input_shape[0], spec.input_shape[1]
    for block, width, pool in CONV_BLOCKS:
        with b.block(block):
            x = conv(b, x, "conv", channels, width, kernel=3)
            x = b.op("Relu", [batch_norm(b, x, "bn", width)])
            if pool:
                x = b.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
                side //= 2
        channels = width
    with b.block("fc"):
        x = b.op("Flatten", [x], axis=1)
        x = linear(b, x, "linear", channels * side * side, FC_WIDTH, relu_follows=True)
        x = b.op("Relu", [x])
    with b.block("head"):
        logits = linear(
            b, x, "linear", FC_WIDTH, spec.num_classes, relu_follows=False, output=spec.output_name
        )
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed))
