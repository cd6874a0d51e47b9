"""Gradient rules of the loss operators a last stage ends with (exporter/loss.py writes them)."""

from __future__ import annotations

import onnx
from onnx import TensorProto

from edgert.exporter.gradients.registry import GradientContext, NodeContext, gradient, training_form

LOG_PROB = "log_prob"


@training_form("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_training(c: NodeContext) -> dict[str, str]:
    """The forward with its log-probabilities output, which the backward reads."""
    node = onnx.NodeProto()
    node.CopyFrom(c.node)
    if not c.output(1):
        del node.output[1:]
        node.output.append(c.writer.fresh("log_prob"))
    c.writer.nodes.append(node)
    return {LOG_PROB: node.output[1]}


@gradient("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy(c: GradientContext) -> dict[int, str]:
    """(softmax - one_hot(label)) * weight[label] * dLoss, over the weights' sum (or the count) for ``mean``."""
    w = c.writer
    log_prob, label, weight = c.saved[LOG_PROB], c.input(1), c.input(2)
    dy = c.dy()
    elem_type = c.type_of(c.input(0)).elem_type
    reduction = c.attr("reduction", "mean")
    ignore = c.attr("ignore_index")
    if c.rank(c.input(0)) != 2:
        raise c.refuse("scores of rank other than 2 (classes on axis 1 of an (N, C) tensor) are not supported")
    label = w.cast(label, TensorProto.INT64)
    per_sample: str | None = None  # a weight per sample, shaped like the labels
    if ignore is not None:
        kept = w.op("Not", [w.op("Equal", [label, w.const(ignore)])])
        label = w.op("Where", [kept, label, w.const(0)])
        per_sample = w.cast(kept, elem_type)
    if weight:
        gathered = w.op("Gather", [weight, label], axis=0)
        per_sample = w.op("Mul", [gathered, per_sample]) if per_sample else gathered
    depth = w.op("Gather", [w.op("Shape", [log_prob]), w.const(1)], axis=0)
    one_hot = w.op("OneHot", [label, depth, w.const([0.0, 1.0], c.type_of(c.input(0)).numpy_dtype)], axis=1)
    difference = w.op("Sub", [w.op("Exp", [log_prob]), one_hot])
    factor = dy
    if reduction == "mean":
        if per_sample:
            count = w.reduce("ReduceSum", per_sample, None, keepdims=False)
        else:
            count = w.cast(w.op("Size", [label]), elem_type)
        factor = w.op("Div", [dy, count])
    elif reduction not in ("sum", "none"):
        raise c.refuse(f"unknown reduction {reduction!r}")
    if per_sample:
        factor = w.op("Mul", [per_sample, factor])
    if per_sample or reduction == "none":
        factor = w.unsqueeze(factor, [1])
    return {0: w.op("Mul", [difference, factor])}
