"""Gradient rules of the normalisations: BatchNormalization (training mode), LayerNormalization,
InstanceNormalization.

BatchNormalization in training mode is written in its training form: one stock training-mode
BatchNormalization with momentum 0, whose "running" outputs are then the batch mean and biased
variance (one fused pass over the input), the running statistics moved by momentum from them,
and the inverse standard deviation the backward reads. Each per-channel affine map of the
backward is one more inference-mode BatchNormalization pass: a ``Mul`` broadcasting a
``[1, C, 1, 1]`` view runs several times slower in ORT on small images (docs/EXPORTER.md).
"""

from __future__ import annotations

import math

import numpy as np

from edgert.exporter.gradients.registry import GradientContext, NodeContext, gradient, training_form

# ReduceSum over [0, 2, ...] walks runs as long as an image; up to this many values an image, the batch goes first.
_SMALL_IMAGE = 16
BATCH_MEAN, INV_STD = "batch_mean", "inv_std"


def channel_sum(c: NodeContext, value: str, like: str) -> str:
    """The sum over every axis but the channels (axis 1) of ``value``, shaped like ``like`` (N, C, spatial...)."""
    w = c.writer
    kind = c.type_of(like)
    spatial = kind.static_dims(2)
    if kind.rank > 2 and spatial is not None and math.prod(spatial) <= _SMALL_IMAGE:
        per_channel = w.reduce("ReduceSum", value, [0], keepdims=False)  # (C, spatial...)
        return w.reduce("ReduceSum", per_channel, list(range(1, kind.rank - 1)), keepdims=False)
    return w.reduce("ReduceSum", value, [0, *range(2, kind.rank)], keepdims=False)


def _affine(c: NodeContext, x: str, scale: str, bias: str | None, gamma: str) -> str:
    """``x * scale + bias`` per channel in one pass: an inference-mode BatchNormalization with mean 0, variance 1
    (``gamma``, the layer's scale, gives the channel count and the element type)."""
    w = c.writer
    channels, dtype = c.static(gamma, what="the shape"), c.type_of(gamma).numpy_dtype
    zeros, ones = w.const(np.zeros(channels), dtype, hint="zeros"), w.const(np.ones(channels), dtype, hint="ones")
    return w.op("BatchNormalization", [x, scale, zeros if bias is None else bias, zeros, ones], epsilon=0.0)


@training_form("BatchNormalization")
def batch_norm_training(c: NodeContext) -> dict[str, str]:
    """Batch statistics from one momentum-0 pass; the running ones moved by momentum (biased variance)."""
    w = c.writer
    x, gamma, beta, running_mean, running_var = (c.input(i) for i in range(5))
    if not c.attr("training_mode", 0):
        w.nodes.append(c.node)  # inference form: the running statistics are constants of the forward
        return {}
    eps, momentum = c.attr("epsilon", 1e-5), c.attr("momentum", 0.9)
    if w.opset < 14:
        raise c.refuse(f"needs ai.onnx opset >= 14 (training-mode BatchNormalization; the model has {w.opset})")
    # With momentum 0 the statistics fed in are only multiplied by 0. ORT's training-mode kernel writes its
    # statistics over these inputs, so they are computed from x (one value per channel): never constants,
    # which ORT would fold and share with other nodes.
    rank = c.rank(x)
    corner = w.op("Slice", [x, w.ints([0] * rank), w.ints([1, 2**62] + [1] * (rank - 2))])
    zeros = w.op("Mul", [w.reshape(corner, [-1]), c.zero_like(x)])
    ones = w.op("Add", [zeros, c.scalar_like(1.0, x)])
    y, mean, variance = (c.output(0) or w.fresh("y"), w.fresh("batch_mean"), w.fresh("batch_var"))
    w.op("BatchNormalization", [x, gamma, beta, zeros, ones], outputs=[y, mean, variance],
         epsilon=eps, momentum=0.0, training_mode=1)
    keep, take = c.scalar_like(momentum, x), c.scalar_like(1 - momentum, x)
    for output, running, batch in ((1, running_mean, mean), (2, running_var, variance)):
        if c.output(output):
            w.op("Add", [w.op("Mul", [running, keep]), w.op("Mul", [batch, take])], outputs=[c.output(output)])
    inv_std = w.op("Reciprocal", [w.op("Sqrt", [w.op("Add", [variance, c.scalar_like(eps, x)])])])
    return {BATCH_MEAN: mean, INV_STD: inv_std}


@gradient("BatchNormalization", inputs=(0, 1, 2))
def batch_norm(c: GradientContext) -> dict[int, str]:
    """dX = gamma inv_std (dY - (dBeta + x_hat dGamma) / m), m the values per channel; dGamma = sum(dY x_hat),
    dBeta = sum(dY)."""
    if not c.saved:
        raise c.refuse("only training-mode BatchNormalization is differentiated (edgert sets training_mode=1)")
    w, dy = c.writer, c.dy()
    x, gamma = c.input(0), c.input(1)
    mean, inv_std = c.saved[BATCH_MEAN], c.saved[INV_STD]
    x_hat = _affine(c, x, inv_std, w.op("Neg", [w.op("Mul", [mean, inv_std])]), gamma)
    d_beta = channel_sum(c, dy, x)
    d_gamma = channel_sum(c, w.op("Mul", [dy, x_hat]), x)
    result = {1: d_gamma, 2: d_beta}
    if c.wants(0):
        count = w.cast(w.op("Div", [w.op("Size", [x]), w.op("Size", [gamma])]), c.type_of(x).elem_type)
        gain = w.op("Mul", [gamma, inv_std])
        shrink = w.op("Neg", [w.op("Div", [gain, count])])
        correction = _affine(c, x_hat, w.op("Mul", [shrink, d_gamma]), w.op("Mul", [shrink, d_beta]), gamma)
        result[0] = w.op("Add", [_affine(c, dy, gain, None, gamma), correction])
    return result


@training_form("LayerNormalization")
def layer_norm_training(c: NodeContext) -> dict[str, str]:
    """The forward with its Mean and InvStdDev outputs, which the backward reads."""
    node = type(c.node)()
    node.CopyFrom(c.node)
    outputs = list(node.output) + [""] * (3 - len(node.output))
    outputs[1] = outputs[1] or c.writer.fresh("mean")
    outputs[2] = outputs[2] or c.writer.fresh("inv_std")
    del node.output[:]
    node.output.extend(outputs)
    c.writer.nodes.append(node)
    return {BATCH_MEAN: outputs[1], INV_STD: outputs[2]}


@gradient("LayerNormalization", inputs=(0, 1, 2))
def layer_norm(c: GradientContext) -> dict[int, str]:
    """dX = inv_std (g - mean(g) - x_hat mean(g x_hat)), g = dY gamma, means over the normalised axes."""
    w, dy = c.writer, c.dy()
    x, gamma = c.input(0), c.input(1)
    mean, inv_std = c.saved[BATCH_MEAN], c.saved[INV_STD]
    rank = c.rank(x)
    axis = c.attr("axis", -1)
    axis = axis + rank if axis < 0 else axis
    normalised, leading = list(range(axis, rank)), list(range(axis))
    x_hat = w.op("Mul", [w.op("Sub", [x, mean]), inv_std])
    result = {}
    if c.wants(0):
        g = w.op("Mul", [dy, gamma])
        centred = w.op("Sub", [g, w.reduce("ReduceMean", g, normalised)])
        projection = w.op("Mul", [x_hat, w.reduce("ReduceMean", w.op("Mul", [g, x_hat]), normalised)])
        result[0] = w.op("Mul", [w.op("Sub", [centred, projection]), inv_std])
    if c.wants(1):
        product = w.op("Mul", [dy, x_hat])
        result[1] = w.reduce("ReduceSum", product, leading, keepdims=False) if leading else product
    if c.wants(2):
        result[2] = w.reduce("ReduceSum", dy, leading, keepdims=False) if leading else dy
    return result


@gradient("InstanceNormalization", inputs=(0, 1, 2))
def instance_norm(c: GradientContext) -> dict[int, str]:
    """LayerNorm's formula per (sample, channel) over the spatial axes, the statistics recomputed."""
    w, dy = c.writer, c.dy()
    x, scale = c.input(0), c.input(1)
    rank = c.rank(x)
    spatial = list(range(2, rank))
    column = w.reshape(scale, [-1, *([1] * (rank - 2))])
    mean = w.reduce("ReduceMean", x, spatial)
    centred_x = w.op("Sub", [x, mean])
    variance = w.reduce("ReduceMean", w.op("Mul", [centred_x, centred_x]), spatial)
    inv_std = w.op("Reciprocal", [w.op("Sqrt", [w.op("Add", [variance, c.scalar_like(c.attr("epsilon", 1e-5), x)])])])
    x_hat = w.op("Mul", [centred_x, inv_std])
    result = {}
    if c.wants(0):
        g = w.op("Mul", [dy, column])
        centred = w.op("Sub", [g, w.reduce("ReduceMean", g, spatial)])
        projection = w.op("Mul", [x_hat, w.reduce("ReduceMean", w.op("Mul", [g, x_hat]), spatial)])
        result[0] = w.op("Mul", [w.op("Sub", [centred, projection]), inv_std])
    if c.wants(1):
        result[1] = channel_sum(c, w.op("Mul", [dy, x_hat]), x)
    if c.wants(2):
        result[2] = channel_sum(c, dy, x)
    return result
