"""The layers the zoo is built from, each emitted into a GraphBuilder's current block.

Every function takes the input tensor name and a ``sub`` name (the middle path part of
its nodes and initializers) and returns its output tensor name. Weights are seeded:
Kaiming-normal before a ReLU, Xavier-uniform elsewhere; biases start at zero; norm
scales at one.
"""

from __future__ import annotations

import math

import numpy as np

from edgert.models.graph import GraphBuilder

BN_EPSILON = 1e-5
BN_MOMENTUM = 0.9
LN_EPSILON = 1e-5


def conv(
    b: GraphBuilder,
    x: str,
    sub: str,
    c_in: int,
    c_out: int,
    kernel: int,
    stride: int = 1,
    groups: int = 1,
) -> str:
    """A bias-free square Conv ("same" padding), Kaiming-initialised for a following ReLU."""
    fan_in = c_in // groups * kernel * kernel
    weight = b.normal(sub, "weight", (c_out, c_in // groups, kernel, kernel), math.sqrt(2 / fan_in))
    pad = kernel // 2
    return b.op(
        "Conv",
        [x, weight],
        sub,
        kernel_shape=[kernel, kernel],
        strides=[stride, stride],
        pads=[pad, pad, pad, pad],
        group=groups,
    )


def batch_norm(b: GraphBuilder, x: str, sub: str, channels: int) -> str:
    """BatchNormalization in its inference form; the exporter switches it to training mode."""
    scale = b.param(sub, "weight", np.ones(channels, np.float32))
    bias = b.param(sub, "bias", np.zeros(channels, np.float32))
    mean = b.constant(sub, "running_mean", np.zeros(channels, np.float32))
    var = b.constant(sub, "running_var", np.ones(channels, np.float32))
    return b.op(
        "BatchNormalization",
        [x, scale, bias, mean, var],
        sub,
        epsilon=BN_EPSILON,
        momentum=BN_MOMENTUM,
    )


def relu6(b: GraphBuilder, x: str, sub: str) -> str:
    """ReLU6 as Clip with its bounds as frozen initializer inputs (opset >= 11 form)."""
    low = b.constant(sub, "clip_min", np.array(0.0, np.float32))
    high = b.constant(sub, "clip_max", np.array(6.0, np.float32))
    return b.op("Clip", [x, low, high], sub)


def linear(
    b: GraphBuilder,
    x: str,
    sub: str,
    d_in: int,
    d_out: int,
    relu_follows: bool,
    output: str | None = None,
) -> str:
    """Gemm on [N, d_in] with a torch-layout weight [d_out, d_in] (transB=1)."""
    weight = _weight(b, sub, (d_out, d_in), d_in, d_out, relu_follows)
    bias = b.param(sub, "bias", np.zeros(d_out, np.float32))
    return b.op("Gemm", [x, weight, bias], sub, output=output, transB=1)


def projection(b: GraphBuilder, x: str, sub: str, d_in: int, d_out: int, relu_follows: bool) -> str:
    """MatMul + Add on [..., d_in] with weight [d_in, d_out]: a linear layer for 3-D inputs."""
    weight = _weight(b, sub, (d_in, d_out), d_in, d_out, relu_follows)
    bias = b.param(sub, "bias", np.zeros(d_out, np.float32))
    return b.op("Add", [b.op("MatMul", [x, weight], sub), bias], sub)


def layer_norm(b: GraphBuilder, x: str, sub: str, d: int) -> str:
    """LayerNormalization over the last axis, single-output form (the exporter adds the rest)."""
    scale = b.param(sub, "weight", np.ones(d, np.float32))
    bias = b.param(sub, "bias", np.zeros(d, np.float32))
    return b.op("LayerNormalization", [x, scale, bias], sub, axis=-1, epsilon=LN_EPSILON)


def gelu(b: GraphBuilder, x: str, sub: str) -> str:
    """Exact GELU, 0.5 * x * (1 + erf(x / sqrt(2))): opset 17 has no Gelu op."""
    sqrt2 = b.constant(sub, "sqrt2", np.array(math.sqrt(2.0), np.float32))
    one = b.constant(sub, "one", np.array(1.0, np.float32))
    half = b.constant(sub, "half", np.array(0.5, np.float32))
    erf = b.op("Erf", [b.op("Div", [x, sqrt2], sub)], sub)
    return b.op("Mul", [b.op("Mul", [x, b.op("Add", [erf, one], sub)], sub), half], sub)


def _weight(
    b: GraphBuilder, sub: str, shape: tuple[int, int], d_in: int, d_out: int, relu_follows: bool
) -> str:
    if relu_follows:
        return b.normal(sub, "weight", shape, math.sqrt(2 / d_in))
    return b.uniform(sub, "weight", shape, math.sqrt(6 / (d_in + d_out)))
