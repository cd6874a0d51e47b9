"""Standard-operator forms of the operators ORT's gradient builder emits (docs/EXPORTER.md).

The training build differentiates a stage into operators that only it implements
(``ReluGrad``, ``ConvGrad``, ``BatchNormInternal``...). A board runs stock onnxruntime, so
each such node is replaced by standard ONNX operators computing the same tensors: one rule
per operator, keyed by ``(domain, op_type)`` in :data:`RULES`. A rule writes the node's
outputs under their original names, so the rest of the graph is untouched. Convolution and
pooling rules live in ``convolution_rules``, registered here the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgert.exporter.errors import PortabilityError
from edgert.exporter.graph_writer import GraphWriter, TensorType

MS = "com.microsoft"


@dataclass
class RuleContext:
    """One node to replace, the writer for its replacement, and what is known of the graph."""

    node: onnx.NodeProto
    writer: GraphWriter
    types: Mapping[str, TensorType]
    producers: Mapping[str, onnx.NodeProto]

    def input(self, index: int) -> str | None:
        node = self.node
        return node.input[index] if index < len(node.input) and node.input[index] else None

    def output(self, index: int) -> str | None:
        node = self.node
        return node.output[index] if index < len(node.output) and node.output[index] else None

    def attr(self, name: str, default=None):
        for attribute in self.node.attribute:
            if attribute.name == name:
                value = helper.get_attribute_value(attribute)
                return value.decode() if isinstance(value, bytes) else value
        return default

    def type_of(self, name: str) -> TensorType:
        """The type of ``name``; a gradient ``<x>_grad`` (or ``<x>_grad_<k>``) has the type of ``<x>``."""
        found = self.types.get(name)
        if (found is None or found.shape is None) and "_grad" in name:
            found = self.types.get(name[:name.rindex("_grad")])
        if found is None or found.shape is None:
            raise self.refuse(f"the type of {name!r} is unknown")
        return found

    def static(self, name: str, start: int = 0, what: str = "dims") -> tuple[int, ...]:
        """The dims of ``name`` from ``start`` on; they must be known integers."""
        dims = self.type_of(name).static_dims(start)
        if dims is None:
            raise self.refuse(f"{what} of {name!r} must be fixed (got {list(self.type_of(name).shape)})")
        return dims

    def refuse(self, reason: str) -> PortabilityError:
        node = self.node
        return PortabilityError(f"cannot rewrite {node.domain + '.' if node.domain else ''}{node.op_type} "
                                f"(node {node.name!r}) for stock onnxruntime: {reason}")

    def zero_like(self, name: str) -> str:
        return self.writer.const(0, self.type_of(name).numpy_dtype, hint="zero")

    def scalar_like(self, value: float, name: str) -> str:
        return self.writer.const(value, self.type_of(name).numpy_dtype, hint="scalar")


Rule = Callable[[RuleContext], None]
RULES: dict[tuple[str, str], Rule] = {}


def rule(*op_types: str, domain: str = MS) -> Callable[[Rule], Rule]:
    def register(function: Rule) -> Rule:
        for op_type in op_types:
            RULES[(domain, op_type)] = function
        return function
    return register


# -- activations -------------------------------------------------------------------------------


@rule("ReluGrad")
def relu_grad(c: RuleContext) -> None:
    w, dy, y = c.writer, c.input(0), c.input(1)
    w.op("Where", [w.op("Greater", [y, c.zero_like(y)]), dy, c.zero_like(dy)], outputs=[c.output(0)])


@rule("LeakyReluGrad")
def leaky_relu_grad(c: RuleContext) -> None:
    w, dy, y = c.writer, c.input(0), c.input(1)
    scaled = w.op("Mul", [dy, c.scalar_like(c.attr("alpha", 0.01), dy)])
    w.op("Where", [w.op("Greater", [y, c.zero_like(y)]), dy, scaled], outputs=[c.output(0)])


@rule("SigmoidGrad")
def sigmoid_grad(c: RuleContext) -> None:
    w, dy, y = c.writer, c.input(0), c.input(1)
    slope = w.op("Mul", [y, w.op("Sub", [c.scalar_like(1.0, y), y])])
    w.op("Mul", [dy, slope], outputs=[c.output(0)])


@rule("TanhGrad")
def tanh_grad(c: RuleContext) -> None:
    w, dy, y = c.writer, c.input(0), c.input(1)
    slope = w.op("Sub", [c.scalar_like(1.0, y), w.op("Mul", [y, y])])
    w.op("Mul", [dy, slope], outputs=[c.output(0)])


def _gelu_slope(c: RuleContext, x: str) -> str:
    """d gelu(x) / dx = Phi(x) + x phi(x), with the exact (erf) GELU."""
    w = c.writer
    cdf = w.op("Mul", [c.scalar_like(0.5, x), w.op("Add", [c.scalar_like(1.0, x), w.op(
        "Erf", [w.op("Mul", [x, c.scalar_like(1 / math.sqrt(2), x)])])])])
    pdf = w.op("Mul", [c.scalar_like(1 / math.sqrt(2 * math.pi), x), w.op(
        "Exp", [w.op("Mul", [w.op("Mul", [x, x]), c.scalar_like(-0.5, x)])])])
    return w.op("Add", [cdf, w.op("Mul", [x, pdf])])


def _fast_gelu_slope(c: RuleContext, x: str) -> str:
    """The slope of the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    w = c.writer
    k, a = math.sqrt(2 / math.pi), 0.044715
    square = w.op("Mul", [x, x])
    inner = w.op("Mul", [c.scalar_like(k, x), w.op("Mul", [x, w.op("Add", [c.scalar_like(1.0, x), w.op(
        "Mul", [c.scalar_like(a, x), square])])])])
    t = w.op("Tanh", [inner])
    left = w.op("Mul", [c.scalar_like(0.5, x), w.op("Add", [c.scalar_like(1.0, x), t])])
    sech2 = w.op("Sub", [c.scalar_like(1.0, x), w.op("Mul", [t, t])])
    d_inner = w.op("Mul", [c.scalar_like(k, x), w.op("Add", [c.scalar_like(1.0, x), w.op(
        "Mul", [c.scalar_like(3 * a, x), square])])])
    right = w.op("Mul", [w.op("Mul", [c.scalar_like(0.5, x), x]), w.op("Mul", [sech2, d_inner])])
    return w.op("Add", [left, right])


def _biased(c: RuleContext) -> str:
    x, bias = c.input(1), c.input(2)
    return c.writer.op("Add", [x, bias]) if bias else x


@rule("GeluGrad", "BiasGeluGrad_dX")
def gelu_grad(c: RuleContext) -> None:
    c.writer.op("Mul", [c.input(0), _gelu_slope(c, _biased(c))], outputs=[c.output(0)])


@rule("FastGeluGrad", "BiasFastGeluGrad_dX")
def fast_gelu_grad(c: RuleContext) -> None:
    c.writer.op("Mul", [c.input(0), _fast_gelu_slope(c, _biased(c))], outputs=[c.output(0)])


def _softmax_axes(c: RuleContext, y: str, flattening: bool) -> list[int]:
    rank = c.type_of(y).rank
    axis = c.attr("axis", 1 if flattening else -1)
    axis = axis + rank if axis < 0 else axis
    # Before opset 13, (Log)Softmax coerced the input to 2-D at `axis`: it normalises over every later axis.
    return list(range(axis, rank)) if flattening else [axis]


@rule("SoftmaxGrad_13", "SoftmaxGrad")
def softmax_grad(c: RuleContext) -> None:
    w, dy, y = c.writer, c.input(0), c.input(1)
    axes = _softmax_axes(c, y, c.node.op_type == "SoftmaxGrad")
    weighted = w.op("Mul", [dy, y])
    total = w.reduce("ReduceSum", weighted, axes)
    w.op("Sub", [weighted, w.op("Mul", [y, total])], outputs=[c.output(0)])


@rule("LogSoftmaxGrad_13", "LogSoftmaxGrad")
def log_softmax_grad(c: RuleContext) -> None:
    w, dy, y = c.writer, c.input(0), c.input(1)
    axes = _softmax_axes(c, y, c.node.op_type == "LogSoftmaxGrad")
    total = w.reduce("ReduceSum", dy, axes)
    w.op("Sub", [dy, w.op("Mul", [w.op("Exp", [y]), total])], outputs=[c.output(0)])


# -- losses and scaling ------------------------------------------------------------------------


@rule("SoftmaxCrossEntropyLossGrad")
def softmax_cross_entropy_grad(c: RuleContext) -> None:
    """(softmax - one_hot(label)) * weight[label] * dY, over the weights' sum for ``mean``."""
    w = c.writer
    dy, log_prob, label, weight, bias = (c.input(i) for i in range(5))
    reduction = c.attr("reduction", "mean")
    ignore = c.attr("ignore_index")
    label = w.cast(label, TensorProto.INT64)
    per_sample: str | None = None  # a weight per sample, shaped like the labels
    if ignore is not None:
        kept = w.op("Not", [w.op("Equal", [label, w.const(ignore)])])
        label = w.op("Where", [kept, label, w.const(0)])
        per_sample = w.cast(kept, c.type_of(log_prob).elem_type)
    if weight:
        gathered = w.op("Gather", [weight, label], axis=0)
        per_sample = w.op("Mul", [gathered, per_sample]) if per_sample else gathered
    depth = w.op("Gather", [w.op("Shape", [log_prob]), w.const(1)], axis=0)
    one_hot = w.op("OneHot", [label, depth, w.const([0.0, 1.0], c.type_of(log_prob).numpy_dtype)], axis=1)
    difference = w.op("Sub", [w.op("Exp", [log_prob]), one_hot])
    factor = dy
    if reduction == "mean":
        if per_sample:
            count = w.reduce("ReduceSum", per_sample, None, keepdims=False)
        else:
            count = w.cast(w.op("Size", [label]), c.type_of(log_prob).elem_type)
        factor = w.op("Div", [dy, count])
    elif reduction not in ("sum", "none"):
        raise c.refuse(f"unknown reduction {reduction!r}")
    if per_sample:
        factor = w.op("Mul", [per_sample, factor])
    if per_sample or reduction == "none":
        factor = w.unsqueeze(factor, [1])
    result = w.op("Mul", [difference, factor])
    if bias:
        result = w.op("Add", [result, bias])
    w.identity(result, c.output(0))


@rule("Scale")
def scale(c: RuleContext) -> None:
    w, x, factor = c.writer, c.input(0), c.input(1)
    if c.type_of(factor).elem_type != c.type_of(x).elem_type:
        factor = w.cast(factor, c.type_of(x).elem_type)
    w.op("Div" if c.attr("scale_down", 0) else "Mul", [x, factor], outputs=[c.output(0)])


def _broadcast_axes(w: GraphWriter, mine: str, other: str) -> str:
    """The axes along which a shape ``mine`` (padded to the result's rank) was broadcast against ``other``."""
    one = w.const([1])
    spread = w.op("And", [w.op("Equal", [mine, one]), w.op("Not", [w.op("Equal", [other, one])])])
    return w.reshape(w.op("NonZero", [spread]), [-1])


def _padded_shape(w: GraphWriter, shape: str, rank: int, target_rank: int) -> str:
    """A shape vector with leading ones up to ``target_rank`` (numpy broadcasting aligns the right ends)."""
    return shape if rank == target_rank else w.op("Concat", [w.ints([1] * (target_rank - rank)), shape], axis=0)


def _sum_to_shape(c: RuleContext, value: str, target: str, rank: int) -> str:
    """``value`` (broadcast to rank ``rank``) summed over the axes ``target`` was broadcast along, shaped like it."""
    w = c.writer
    shape = w.op("Shape", [target])
    axes = _broadcast_axes(w, _padded_shape(w, shape, c.type_of(target).rank, rank), w.op("Shape", [value]))
    summed = w.op("ReduceSum", [value, axes], keepdims=1, noop_with_empty_axes=1)
    return w.reshape(summed, shape)


@rule("DivGrad")
def div_grad(c: RuleContext) -> None:
    """A / B: dA = dY / B, dB = -(dY / B) (A / B), each summed back to its operand's shape."""
    w = c.writer
    dy, a, b = c.input(0), c.input(1), c.input(2)
    rank = max(c.type_of(a).rank, c.type_of(b).rank)
    scaled = w.op("Div", [dy, b])
    if c.output(0):
        w.identity(_sum_to_shape(c, scaled, a, rank), c.output(0))
    if c.output(1):
        d_b = w.op("Neg", [w.op("Mul", [scaled, w.op("Div", [a, b])])])
        w.identity(_sum_to_shape(c, d_b, b, rank), c.output(1))


# -- indexing ----------------------------------------------------------------------------------


def _scatter_add_rows(c: RuleContext, shape: str, indices: str, updates: str, elem_type: int) -> str:
    """zeros(shape) with ``updates`` added at rows ``indices`` of axis 0 (repeats add up)."""
    w = c.writer
    _needs_reduction_ops(c)
    zeros = w.zeros(shape, elem_type)
    rows = w.op("Gather", [shape, w.const(0)], axis=0)
    wrapped = w.op("Mod", [w.op("Add", [indices, rows]), rows])  # negative indices count from the end
    return w.op("ScatterND", [zeros, w.unsqueeze(wrapped, [-1]), updates], reduction="add")


def _needs_reduction_ops(c: RuleContext) -> None:
    if c.writer.opset < 16:
        raise c.refuse(f"its portable form adds repeated indices with ScatterND/ScatterElements(reduction='add'), "
                       f"which need ai.onnx opset >= 16 (the model has {c.writer.opset}); re-export it at opset 17")


@rule("GatherGrad")
def gather_grad(c: RuleContext) -> None:
    w = c.writer
    shape, indices, dy = c.input(0), c.input(1), c.input(2)
    q, elem_type = c.type_of(indices).rank, c.type_of(dy).elem_type
    indices = w.cast(indices, TensorProto.INT64)
    axis = c.attr("axis", 0)
    rank = c.static(shape, what="the length")[0]
    axis = axis + rank if axis < 0 else axis
    if q == 0:  # a scalar index dropped the axis: as Gather of [index], whose dY has the axis back with length 1
        indices, dy, q = w.unsqueeze(indices, [0]), w.unsqueeze(dy, [axis]), 1
    if axis == 0:
        w.identity(_scatter_add_rows(c, shape, indices, dy, elem_type), c.output(0))
        return
    # Move the gathered axis first, scatter rows, move it back.
    dy_perm = [*range(axis, axis + q), *range(axis), *range(axis + q, rank - 1 + q)]
    data_perm = [axis, *range(axis), *range(axis + 1, rank)]
    moved_shape = w.op("Gather", [shape, w.ints(data_perm)], axis=0)
    moved = _scatter_add_rows(c, moved_shape, indices, w.op("Transpose", [dy], perm=dy_perm), elem_type)
    w.op("Transpose", [moved], outputs=[c.output(0)], perm=list(np.argsort(data_perm)))


@rule("MaxPoolGrad", domain="")
def max_pool_grad(c: RuleContext) -> None:
    """Scatter-add dY into the input's (flattened) positions that MaxPool's Indices output names."""
    w = c.writer
    dy, indices = c.input(0), c.input(1)
    if c.attr("storage_order", 0) != 0:
        raise c.refuse("column-major Indices (storage_order=1) are not supported")
    producer = c.producers.get(indices)
    if producer is None or producer.op_type != "MaxPool":
        raise c.refuse(f"its Indices {indices!r} do not come from a MaxPool node")
    x = producer.input[0]
    _needs_reduction_ops(c)
    flat_size = w.reshape(w.op("Size", [x]), [1])
    zeros = w.zeros(flat_size, c.type_of(dy).elem_type)
    flat = w.op("ScatterElements", [zeros, w.reshape(indices, [-1]), w.reshape(dy, [-1])], axis=0, reduction="add")
    w.reshape(flat, w.op("Shape", [x]), output=c.output(0))


@rule("ConcatTraining")
def concat_training(c: RuleContext) -> None:
    w = c.writer
    inputs = [name for name in c.node.input if name]
    rank = c.type_of(inputs[0]).rank
    axis = c.attr("axis")
    axis = axis + rank if axis < 0 else axis
    w.op("Concat", inputs, outputs=[c.output(0)], axis=axis)
    if c.output(1):
        lengths = [w.op("Slice", [w.op("Shape", [x]), w.ints([axis]), w.ints([axis + 1])]) for x in inputs]
        w.op("Concat", lengths, outputs=[c.output(1)], axis=0)


@rule("SplitTraining")
def split_training(c: RuleContext) -> None:
    outputs = list(c.node.output)
    c.writer.op("Split", [c.input(0), c.input(1)], outputs=[o or c.writer.fresh("unused") for o in outputs],
                axis=c.attr("axis", 0))


@rule("SliceGrad")
def slice_grad(c: RuleContext) -> None:
    """Write dY back at the positions the Slice read: slice a tensor of flat positions the same way."""
    w = c.writer
    dy, shape, starts, ends = (c.input(i) for i in range(4))
    extra = [name for name in (c.input(4), c.input(5))]
    size = w.reduce("ReduceProd", shape, [0], keepdims=False)
    positions = w.reshape(w.op("Range", [w.const(0), size, w.const(1)]), shape)
    sliced = w.op("Slice", [positions, starts, ends] + [n or "" for n in extra])
    zeros = w.zeros(w.reshape(size, [1]), c.type_of(dy).elem_type)
    flat = w.op("ScatterElements", [zeros, w.reshape(sliced, [-1]), w.reshape(dy, [-1])], axis=0)
    w.reshape(flat, shape, output=c.output(0))


@rule("BroadcastGradientArgs")
def broadcast_gradient_args(c: RuleContext) -> None:
    """The axes each operand of a broadcasting op was expanded along (its gradient sums over them)."""
    w = c.writer
    a, b = c.input(0), c.input(1)
    ra, rb = c.static(a, what="the length")[0], c.static(b, what="the length")[0]
    rank = max(ra, rb)
    a_full, b_full = _padded_shape(w, a, ra, rank), _padded_shape(w, b, rb, rank)
    for mine, other, output in ((a_full, b_full, c.output(0)), (b_full, a_full, c.output(1))):
        if output:
            w.identity(_broadcast_axes(w, mine, other), output)


# -- normalisation -----------------------------------------------------------------------------


# ReduceSum over [0, 2, ...] walks runs as long as an image; up to this many values an image, the batch goes first.
_SMALL_IMAGE = 16


def channel_sum(c: RuleContext, value: str, like: str, output: str | None = None) -> str:
    """The sum over every axis but the channels (axis 1) of ``value``, shaped like ``like`` (N, C, spatial...)."""
    w = c.writer
    kind = c.type_of(like)
    spatial = kind.static_dims(2)
    if kind.rank > 2 and spatial is not None and math.prod(spatial) <= _SMALL_IMAGE:
        per_channel = w.reduce("ReduceSum", value, [0], keepdims=False)  # (C, spatial...)
        return w.reduce("ReduceSum", per_channel, list(range(1, kind.rank - 1)), keepdims=False, output=output)
    return w.reduce("ReduceSum", value, [0, *range(2, kind.rank)], keepdims=False, output=output)


def _affine(c: RuleContext, x: str, scale: str, bias: str | None, gamma: str) -> str:
    """``x * scale + bias`` (no bias: ``x * scale``) per channel in one pass: an inference-mode BatchNormalization
    with mean 0, variance 1. A Mul broadcasting over ``[1, C, 1, ...]`` is several times slower on small images.

    ``gamma`` is the BatchNorm's scale: it gives the channel count and the element type.
    """
    w = c.writer
    channels, dtype = c.static(gamma, what="the shape"), c.type_of(gamma).numpy_dtype
    zeros, ones = w.const(np.zeros(channels), dtype, hint="zeros"), w.const(np.ones(channels), dtype, hint="ones")
    return w.op("BatchNormalization", [x, scale, zeros if bias is None else bias, zeros, ones], epsilon=0.0)


@rule("BatchNormInternal")
def batch_norm_internal(c: RuleContext) -> None:
    """Training-mode BatchNorm: batch statistics, the running ones moved by momentum (biased variance).

    Stock BatchNormalization in training mode with momentum 0 returns the batch mean and
    (biased) variance as its "running" outputs, from one fused pass over the input.
    """
    w = c.writer
    x, gamma, beta, running_mean, running_var = (c.input(i) for i in range(5))
    eps, momentum = c.attr("epsilon", 1e-5), c.attr("momentum", 0.9)
    if w.opset < 14:
        raise c.refuse(f"needs ai.onnx opset >= 14 (training-mode BatchNormalization; the model has {w.opset})")
    # With momentum 0 the statistics fed in are only multiplied by 0. ORT's training-mode kernel writes its
    # statistics over these inputs, so they are computed from x (one value per channel): never constants,
    # which ORT would fold and share with other nodes.
    rank = c.type_of(x).rank
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
    if c.output(3):
        w.identity(mean, c.output(3))
    if c.output(4):
        w.op("Reciprocal", [w.op("Sqrt", [w.op("Add", [variance, c.scalar_like(eps, x)])])], outputs=[c.output(4)])


@rule("BatchNormalizationGrad")
def batch_norm_grad(c: RuleContext) -> None:
    """dX = gamma inv_std (dY - (dBeta + x_hat dGamma) / m), with m the elements per channel.

    Each per-channel affine map is one fused BatchNormalization pass.
    """
    w = c.writer
    dy, x, gamma, mean, inv_std = (c.input(i) for i in range(5))
    x_hat = _affine(c, x, inv_std, w.op("Neg", [w.op("Mul", [mean, inv_std])]), gamma)
    d_beta = channel_sum(c, dy, x, output=c.output(2) or None)  # written as the outputs: no Identity
    d_gamma = channel_sum(c, w.op("Mul", [dy, x_hat]), x, output=c.output(1) or None)
    if c.output(0):
        count = w.cast(w.op("Div", [w.op("Size", [x]), w.op("Size", [gamma])]), c.type_of(x).elem_type)
        gain = w.op("Mul", [gamma, inv_std])
        shrink = w.op("Neg", [w.op("Div", [gain, count])])
        correction = _affine(c, x_hat, w.op("Mul", [shrink, d_gamma]), w.op("Mul", [shrink, d_beta]), gamma)
        w.op("Add", [_affine(c, dy, gain, None, gamma), correction], outputs=[c.output(0)])


@rule("LayerNormalizationGrad")
def layer_norm_grad(c: RuleContext) -> None:
    """dX = inv_std (g - mean(g) - x_hat mean(g x_hat)) with g = dY gamma, means over the normalised axes."""
    w = c.writer
    dy, x, gamma, mean, inv_std = (c.input(i) for i in range(5))
    rank = c.type_of(x).rank
    axis = c.attr("axis", -1)
    axis = axis + rank if axis < 0 else axis
    normalised, leading = list(range(axis, rank)), list(range(axis))
    x_hat = w.op("Mul", [w.op("Sub", [x, mean]), inv_std])
    if c.output(0):
        g = w.op("Mul", [dy, gamma])
        centred = w.op("Sub", [g, w.reduce("ReduceMean", g, normalised)])
        projection = w.op("Mul", [x_hat, w.reduce("ReduceMean", w.op("Mul", [g, x_hat]), normalised)])
        w.op("Mul", [w.op("Sub", [centred, projection]), inv_std], outputs=[c.output(0)])
    for output, value in ((1, lambda: w.op("Mul", [dy, x_hat])), (2, lambda: dy)):
        if c.output(output):
            summed = w.reduce("ReduceSum", value(), leading, keepdims=False) if leading else value()
            w.identity(summed, c.output(output))
