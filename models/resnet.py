"""resnet-mini: a stem and three basic residual blocks, each split into two cut units.

Residual block ``k`` is two blocks: ``reska`` (3x3 Conv, BN, ReLU: the first half of the
branch) and ``reskb`` (3x3 Conv, BN, the shortcut, Add, ReLU). The shortcut reads the
block's input, so a cut between ``reska`` and ``reskb`` is crossed by two tensors: the
branch and the skip. ``res2`` and ``res3`` halve the side with a stride-2 first conv and
use a projection shortcut (1x1 stride-2 Conv + BN) inside ``reskb``.

Blocks: stem (3x3 Conv 1->16, BN, ReLU; 8x8), res1a/res1b (16; 8x8), res2a/res2b (32; 4x4),
res3a/res3b (64; 2x2), head (GlobalAveragePool, Flatten, Gemm 64->10).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgert.models.graph import GraphBuilder
from edgert.models.layers import batch_norm, conv, linear

if TYPE_CHECKING:
    import onnx

    from edgert.models import ModelSpec

STEM_WIDTH = 16
# (residual block, output channels, stride of its first conv)
STAGES = (("res1", 16, 1), ("res2", 32, 2), ("res3", 64, 2))


def build(spec: ModelSpec, seed: int) -> onnx.ModelProto:
    """The resnet-mini model for ``spec`` (input [N, 1, 8, 8] float32, logits [N, classes])."""
    b = GraphBuilder(spec.name, seed)
    x = b.input(spec.input_name, spec.input_dtype, ["N", *spec.input_shape])
    with b.block("stem"):
        x = conv(b, x, "conv", spec.input_shape[0], STEM_WIDTH, kernel=3)
        x = b.op("Relu", [batch_norm(b, x, "bn", STEM_WIDTH)])
    channels = STEM_WIDTH
    for name, width, stride in STAGES:
        x = _residual(b, x, name, channels, width, stride)
        channels = width
    with b.block("head"):
        x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
        logits = linear(
            b, x, "linear", channels, spec.num_classes, relu_follows=False, output=spec.output_name
        )
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed))


def _residual(b: GraphBuilder, x: str, name: str, c_in: int, c_out: int, stride: int) -> str:
    """relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)) as blocks ``<name>a`` and ``<name>b``."""
    with b.block(f"{name}a"):
        branch = conv(b, x, "conv", c_in, c_out, kernel=3, stride=stride)
        branch = b.op("Relu", [batch_norm(b, branch, "bn", c_out)])
    with b.block(f"{name}b"):
        branch = conv(b, branch, "conv", c_out, c_out, kernel=3)
        branch = batch_norm(b, branch, "bn", c_out)
        skip = x
        if stride != 1 or c_in != c_out:
            skip = conv(b, x, "proj_conv", c_in, c_out, kernel=1, stride=stride)
            skip = batch_norm(b, skip, "proj_bn", c_out)
        return b.op("Relu", [b.op("Add", [branch, skip], "add")])
