"""Gradient rules of MaxPool and AveragePool (the global pools are reductions: exporter.gradients.reductions)."""

from __future__ import annotations

import numpy as np
import onnx

from edgert.exporter.gradients.convolution import Window, fitted_transposed, window_of
from edgert.exporter.gradients.registry import GradientContext, NodeContext, gradient, training_form

INDICES = "indices"


@training_form("MaxPool")
def max_pool_training(c: NodeContext) -> dict[str, str]:
    """The forward with its Indices output (the flat position of each maximum), which the backward scatters to."""
    if c.attr("storage_order", 0) != 0:
        raise c.refuse("column-major Indices (storage_order=1) are not supported")
    node = onnx.NodeProto()
    node.CopyFrom(c.node)
    if not c.output(1):
        del node.output[1:]
        node.output.append(c.writer.fresh("indices"))
    c.writer.nodes.append(node)
    return {INDICES: node.output[1]}


@gradient("MaxPool")
def max_pool(c: GradientContext) -> dict[int, str]:
    """dY added into the input's (flattened) positions that the forward's Indices name."""
    w, x = c.writer, c.input(0)
    if w.opset < 16:
        raise c.refuse(f"its gradient adds overlapping windows with ScatterElements(reduction='add'), which needs "
                       f"ai.onnx opset >= 16 (the model has {w.opset}); re-export it at opset 17")
    flat_size = w.reshape(w.op("Size", [x]), [1])
    zeros = w.zeros(flat_size, c.type_of(x).elem_type)
    flat = w.op("ScatterElements", [zeros, w.reshape(c.saved[INDICES], [-1]), w.reshape(c.dy(), [-1])], axis=0,
                reduction="add")
    return {0: w.reshape(flat, c.shape_of(x))}


def _average_counts(window: Window, spatial: tuple[int, ...], out: tuple[int, ...], include_pad: bool) -> np.ndarray:
    """How many elements each output of an AveragePool divides by (ORT's rule, per spatial axis)."""
    per_axis = []
    for axis, (size, count) in enumerate(zip(spatial, out)):
        starts = np.arange(count) * window.strides[axis] - window.begin[axis]
        ends = np.minimum(starts + window.kernel[axis], size + window.end[axis])
        if not include_pad:
            starts, ends = np.maximum(starts, 0), np.minimum(ends, size)
        per_axis.append((ends - starts).astype(np.float64))
    counts = per_axis[0]
    for more in per_axis[1:]:
        counts = np.multiply.outer(counts, more)
    return counts


@gradient("AveragePool")
def average_pool(c: GradientContext) -> dict[int, str]:
    """Each dY over its window's size, spread back over the window: a depthwise ConvTranspose with a ones kernel."""
    w, x, y = c.writer, c.input(0), c.output(0)
    channels = c.type_of(x).shape[1]
    if not isinstance(channels, int):
        raise c.refuse(f"the channels of {x!r} must be known (got {list(c.type_of(x).shape)})")
    kernel = tuple(c.attr("kernel_shape"))
    if any(d != 1 for d in c.attr("dilations", [1] * len(kernel))):
        raise c.refuse("dilated AveragePool is not supported")
    spatial = c.type_of(x).static_dims(2)
    window = window_of(c, spatial, kernel)
    ceil = bool(c.attr("ceil_mode", 0))
    include_pad = bool(c.attr("count_include_pad", 0))
    dtype = c.type_of(x).numpy_dtype
    ones = w.const(np.ones((channels, 1, *kernel)), dtype, hint="ones_kernel")
    if spatial is not None:
        out = tuple(window.out_size(n, axis, ceil) for axis, n in enumerate(spatial))
        counts = w.const(_average_counts(window, spatial, out, include_pad), dtype, hint="window_sizes")
        scaled = w.op("Div", [c.dy(), counts])
        return {0: w.op("ConvTranspose", [scaled, ones], group=channels, **window.transposed(spatial, out))}
    if ceil:
        raise c.refuse("ceil_mode needs the spatial sizes, which are known only at run time")
    size = float(np.prod(kernel))
    if include_pad:
        counts = c.scalar_like(size, x)
    else:  # the padded average of ones is the share of each window inside the input
        ones_like_x = w.op("Add", [w.op("Mul", [x, c.zero_like(x)]), c.scalar_like(1.0, x)])
        share = w.op("AveragePool", [ones_like_x], kernel_shape=list(kernel), strides=list(window.strides),
                     pads=[*window.begin, *window.end], count_include_pad=1)
        counts = w.op("Mul", [share, c.scalar_like(size, x)])
    scaled = w.op("Div", [c.dy(), counts])
    c.types.setdefault(scaled, c.type_of(y))
    return {0: fitted_transposed(c, scaled, ones, window, channels, x)}
