"""Extra small models the latency predictor is fitted on, besides the zoo.

Leave-one-model-out needs variety: these differ from every zoo model in widths, input
sizes, kernel sizes and op mix (wider Gemms, 16x16 three-channel convolutions, 5x5
depthwise kernels, a wider transformer with ReLU MLPs). They are built with the zoo's
:class:`GraphBuilder`, so the exporter reads their blocks and loss the same way.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from edgert.models import ModelSpec
from edgert.models.graph import GraphBuilder
from edgert.models.layers import batch_norm, conv, gelu, layer_norm, linear, projection, relu6


def _spec(name: str, shape: tuple[int, ...], dtype: str = "float32", classes: int = 10, vocab: int = 0) -> ModelSpec:
    return ModelSpec(name=name, description="predictor fitting model", builder="", input_shape=shape,
                     input_dtype=dtype, num_classes=classes, dataset="", blocks=(), skip_cuts=(), vocab_size=vocab)


def wide_mlp(seed: int = 0) -> onnx.ModelProto:
    """Gemm 64->384->384->192->10 with ReLUs, a Tanh in the middle."""
    spec = _spec("wide-mlp", (64,))
    b = GraphBuilder(spec.name, seed)
    x = b.input(spec.input_name, spec.input_dtype, ["N", 64])
    width = 64
    for index, (hidden, act) in enumerate(((384, "Relu"), (384, "Tanh"), (192, "Relu")), start=1):
        with b.block(f"fc{index}"):
            x = b.op(act, [linear(b, x, "linear", width, hidden, relu_follows=act == "Relu")])
        width = hidden
    with b.block("head"):
        logits = linear(b, x, "linear", width, spec.num_classes, relu_follows=False, output=spec.output_name)
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed))


def deep_cnn(seed: int = 0) -> onnx.ModelProto:
    """3x16x16 input through six Conv-BN-ReLU blocks (3x3 and 1x1, three pooled, down to 2x2), a GAP head."""
    spec = _spec("deep-cnn", (3, 16, 16))
    b = GraphBuilder(spec.name, seed)
    x = b.input(spec.input_name, spec.input_dtype, ["N", *spec.input_shape])
    channels = 3
    layers = (("c1", 16, 3, False), ("c2", 24, 3, True), ("c3", 48, 1, False), ("c4", 48, 3, True),
              ("c5", 96, 3, True), ("c6", 128, 3, False))
    for block, width, kernel, pool in layers:
        with b.block(block):
            x = b.op("Relu", [batch_norm(b, conv(b, x, "conv", channels, width, kernel), "bn", width)])
            if pool:
                x = b.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
        channels = width
    with b.block("head"):
        x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
        logits = linear(b, x, "linear", channels, spec.num_classes, relu_follows=False, output=spec.output_name)
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed))


def separable_cnn(seed: int = 0) -> onnx.ModelProto:
    """3x12x12 input, 5x5 and 3x3 depthwise + 1x1 pointwise blocks (6x6 and 3x3), an average-pooled head."""
    spec = _spec("separable-cnn", (3, 12, 12))
    b = GraphBuilder(spec.name, seed)
    x = b.input(spec.input_name, spec.input_dtype, ["N", *spec.input_shape])
    with b.block("stem"):
        x = b.op("Relu", [batch_norm(b, conv(b, x, "conv", 3, 24, 3, stride=2), "bn", 24)])
    channels = 24
    for block, width, kernel, stride in (("sep1", 48, 5, 1), ("sep2", 96, 3, 2), ("sep3", 96, 3, 1)):
        with b.block(block):
            x = conv(b, x, "dw_conv", channels, channels, kernel=kernel, stride=stride, groups=channels)
            x = relu6(b, batch_norm(b, x, "dw_bn", channels), "dw_act")
            x = b.op("Relu", [batch_norm(b, conv(b, x, "pw_conv", channels, width, 1), "pw_bn", width)])
        channels = width
    with b.block("head"):
        x = b.op("AveragePool", [x], kernel_shape=[3, 3], strides=[3, 3])
        x = b.op("Flatten", [x], axis=1)
        logits = linear(b, x, "linear", channels, spec.num_classes, relu_follows=False, output=spec.output_name)
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed))


def wide_transformer(seed: int = 0) -> onnx.ModelProto:
    """24 tokens, d=48, 3 heads; one GELU MLP and one ReLU MLP of width 192."""
    seq, d, heads, d_ff, vocab = 24, 48, 3, 192, 50
    spec = _spec("wide-transformer", (seq,), dtype="int64", classes=4, vocab=vocab)
    b = GraphBuilder(spec.name, seed)
    tokens = b.input(spec.input_name, spec.input_dtype, ["N", seq])
    with b.block("embed"):
        table = b.normal("tok", "weight", (vocab, d), 1 / math.sqrt(d))
        positions = b.normal("pos", "weight", (seq, d), 1 / math.sqrt(d))
        x = b.op("Add", [b.op("Gather", [table, tokens], "tok", axis=0), positions], "pos")
    for layer, activation in ((1, "gelu"), (2, "relu")):
        with b.block(f"attn{layer}"):
            x = b.op("Add", [x, _attention(b, layer_norm(b, x, "ln", d), seq, d, heads)], "residual")
        with b.block(f"mlp{layer}"):
            h = projection(b, layer_norm(b, x, "ln", d), "fc1", d, d_ff, relu_follows=True)
            h = gelu(b, h, "gelu") if activation == "gelu" else b.op("Relu", [h], "relu")
            x = b.op("Add", [x, projection(b, h, "fc2", d_ff, d, relu_follows=False)], "residual")
    with b.block("head"):
        x = b.op("ReduceMean", [layer_norm(b, x, "ln", d)], "pool", axes=[1], keepdims=0)
        logits = linear(b, x, "linear", d, spec.num_classes, relu_follows=False, output=spec.output_name)
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed))


def _attention(b: GraphBuilder, x: str, seq: int, d: int, heads: int) -> str:
    d_head = d // heads
    split = b.constant("heads", "shape", np.array([0, seq, heads, d_head], np.int64))
    merge = b.constant("context", "shape", np.array([0, seq, d], np.int64))
    scale = b.constant("scores", "scale", np.array(1 / math.sqrt(d_head), np.float32))

    def project(sub: str, perm: list[int]) -> str:
        h = b.op("Reshape", [projection(b, x, sub, d, d, relu_follows=False), split], sub)
        return b.op("Transpose", [h], sub, perm=perm)

    q, k, v = project("q", [0, 2, 1, 3]), project("k", [0, 2, 3, 1]), project("v", [0, 2, 1, 3])
    scores = b.op("Softmax", [b.op("Mul", [b.op("MatMul", [q, k], "scores"), scale], "scores")], "scores", axis=-1)
    context = b.op("Transpose", [b.op("MatMul", [scores, v], "context")], "context", perm=[0, 2, 1, 3])
    return projection(b, b.op("Reshape", [context, merge], "context"), "out", d, d, relu_follows=False)


EXTRA_MODELS = {
    "wide-mlp": wide_mlp,
    "deep-cnn": deep_cnn,
    "separable-cnn": separable_cnn,
    "wide-transformer": wide_transformer,
}
