"""Gradient rules of reductions and normalising maps: ReduceSum/Mean/Max/Min/SumSquare/L2/LogSumExp,
Softmax, LogSoftmax, and the global pools (a mean or a max over the spatial axes)."""

from __future__ import annotations

import numpy as np

from edgert.exporter.gradients.registry import GradientContext, gradient


def reduced_axes(c: GradientContext) -> list[int] | None:
    """The axes a Reduce* node reduces (non-negative), or None for every axis."""
    x = c.input(0)
    rank = c.rank(x)
    axes = c.attr("axes")
    if axes is None and c.input(1):
        value = c.constant(c.input(1))
        if value is None:
            raise c.refuse("its axes are computed at run time")
        axes = [int(a) for a in value.reshape(-1)]
    if not axes:
        return [] if c.attr("noop_with_empty_axes", 0) else None
    return sorted(a + rank if a < 0 else a for a in axes)


def _spread(c: GradientContext, value: str, axes: list[int] | None) -> str:
    """``value`` (the reduced shape) expanded back over the input's shape."""
    w, x = c.writer, c.input(0)
    rank = c.rank(x)
    if not c.attr("keepdims", 1):
        value = w.unsqueeze(value, axes if axes is not None else list(range(rank)))
    return w.op("Expand", [value, c.shape_of(x)])


def _count(c: GradientContext, axes: list[int] | None) -> str:
    """How many values each output of the reduction summed, as a scalar of the input's type."""
    x = c.input(0)
    dims = c.type_of(x).shape
    chosen = range(len(dims)) if axes is None else axes
    if all(isinstance(dims[a], int) for a in chosen):
        return c.scalar_like(float(np.prod([dims[a] for a in chosen])), x)
    w = c.writer
    ratio = w.op("Div", [w.op("Size", [x]), w.op("Size", [c.output(0)])])
    return w.cast(ratio, c.type_of(x).elem_type)


@gradient("ReduceSum", "ReduceMean")
def reduce_sum(c: GradientContext) -> dict[int, str]:
    axes = reduced_axes(c)
    if axes == []:
        return {0: c.dy()}
    dy = c.dy()
    if c.node.op_type == "ReduceMean":
        dy = c.writer.op("Div", [dy, _count(c, axes)])
    return {0: _spread(c, dy, axes)}


@gradient("ReduceSumSquare")
def reduce_sum_square(c: GradientContext) -> dict[int, str]:
    w, x = c.writer, c.input(0)
    axes = reduced_axes(c)
    return {0: w.op("Mul", [_spread(c, c.dy(), axes), w.op("Mul", [x, c.scalar_like(2.0, x)])])}


@gradient("ReduceL2")
def reduce_l2(c: GradientContext) -> dict[int, str]:
    w, x = c.writer, c.input(0)
    axes = reduced_axes(c)
    ratio = w.op("Div", [c.dy(), c.output(0)])
    return {0: w.op("Mul", [_spread(c, ratio, axes), x])}


@gradient("ReduceLogSumExp")
def reduce_log_sum_exp(c: GradientContext) -> dict[int, str]:
    w, x = c.writer, c.input(0)
    axes = reduced_axes(c)
    weights = w.op("Exp", [w.op("Sub", [x, _spread(c, c.output(0), axes)])])
    return {0: w.op("Mul", [_spread(c, c.dy(), axes), weights])}


@gradient("ReduceMax", "ReduceMin")
def reduce_extremum(c: GradientContext) -> dict[int, str]:
    """The gradient shared evenly among the inputs equal to the result (torch's amax/amin)."""
    w, x = c.writer, c.input(0)
    axes = reduced_axes(c)
    hits = w.cast(w.op("Equal", [x, _spread(c, c.output(0), axes)]), c.type_of(x).elem_type)
    count = w.reduce("ReduceSum", hits, axes, keepdims=bool(c.attr("keepdims", 1)))
    return {0: w.op("Mul", [_spread(c, w.op("Div", [c.dy(), count]), axes), hits])}


@gradient("GlobalAveragePool")
def global_average_pool(c: GradientContext) -> dict[int, str]:
    w, x = c.writer, c.input(0)
    dims = c.type_of(x).shape
    spatial = dims[2:]
    if all(isinstance(d, int) for d in spatial):
        count = c.scalar_like(float(np.prod(spatial)), x)
    else:
        count = w.cast(w.op("Div", [w.op("Size", [x]), w.op("Size", [c.output(0)])]), c.type_of(x).elem_type)
    return {0: w.op("Expand", [w.op("Div", [c.dy(), count]), c.shape_of(x)])}


@gradient("GlobalMaxPool")
def global_max_pool(c: GradientContext) -> dict[int, str]:
    w, x = c.writer, c.input(0)
    axes = list(range(2, c.rank(x)))
    hits = w.cast(w.op("Equal", [x, c.output(0)]), c.type_of(x).elem_type)
    count = w.reduce("ReduceSum", hits, axes, keepdims=True)
    return {0: w.op("Mul", [w.op("Div", [c.dy(), count]), hits])}


def _softmax_axes(c: GradientContext) -> list[int]:
    """The axis (Log)Softmax normalises over (opset 13 on: edgert loads no older model, exporter/source.py)."""
    axis = c.attr("axis", -1)
    return [axis + c.rank(c.output(0)) if axis < 0 else axis]


@gradient("Softmax")
def softmax(c: GradientContext) -> dict[int, str]:
    """Y (dY - sum(dY Y))."""
    w, y = c.writer, c.output(0)
    weighted = w.op("Mul", [c.dy(), y])
    total = w.reduce("ReduceSum", weighted, _softmax_axes(c))
    return {0: w.op("Sub", [weighted, w.op("Mul", [y, total])])}


@gradient("LogSoftmax")
def log_softmax(c: GradientContext) -> dict[int, str]:
    """dY - exp(Y) sum(dY)."""
    w, dy, y = c.writer, c.dy(), c.output(0)
    total = w.reduce("ReduceSum", dy, _softmax_axes(c))
    return {0: w.op("Sub", [dy, w.op("Mul", [w.op("Exp", [y]), total])])}
