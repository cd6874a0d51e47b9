"""mobilenet-mini: a stem and four depthwise-separable Conv blocks with BN and ReLU6.

Each ``dsK`` block is a 3x3 depthwise Conv (group = channels) + BN + ReLU6, then a 1x1
pointwise Conv + BN + ReLU6. ReLU6 is ``Clip`` with its bounds (0, 6) as frozen
initializer inputs. Blocks: stem (3x3 Conv 1->16; 8x8), ds1 (16->32; 8x8), ds2 (32->64,
stride 2; 4x4), ds3 (64->64; 4x4), ds4 (64->128, stride 2; 2x2), head
(GlobalAveragePool, Flatten, Gemm 128->10). A chain: one tensor crosses every cut.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgert.models.graph import GraphBuilder
from edgert.models.layers import batch_norm, conv, linear, relu6

if TYPE_CHECKING:
    import onnx

    from edgert.models import ModelSpec

STEM_WIDTH = 16
# (block, output channels, depthwise stride)
SEPARABLE_BLOCKS = (("ds1", 32, 1), ("ds2", 64, 2), ("ds3", 64, 1), ("ds4", 128, 2))


def build(spec: ModelSpec, seed: int) -> onnx.ModelProto:
    """The mobilenet-mini model for ``spec`` (input [N, 1, 8, 8] float32, logits [N, classes])."""
    b = GraphBuilder(spec.name, seed)
    x = b.input(spec.input_name, spec.input_dtype, ["N", *spec.input_shape])
    with b.block("stem"):
        x = conv(b, x, "conv", spec.input_shape[0], STEM_WIDTH, kernel=3)
        x = relu6(b, batch_norm(b, x, "bn", STEM_WIDTH), "act")
    channels = STEM_WIDTH
    for name, width, stride in SEPARABLE_BLOCKS:
        with b.block(name):
            x = conv(b, x, "dw_conv", channels, channels, kernel=3, stride=stride, groups=channels)
            x = relu6(b, batch_norm(b, x, "dw_bn", channels), "dw_act")
            x = conv(b, x, "pw_conv", channels, width, kernel=1)
            x = relu6(b, batch_norm(b, x, "pw_bn", width), "pw_act")
        channels = width
    with b.block("head"):
        x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
        logits = linear(
            b, x, "linear", channels, spec.num_classes, relu_follows=False, output=spec.output_name
        )
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed))
