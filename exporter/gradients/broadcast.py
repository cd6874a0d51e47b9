"""A broadcast operand's gradient: the output's gradient summed back to the operand's shape.

Where both shapes are known the axes are found here and one ``ReduceSum`` (and a ``Reshape``
where leading axes go) is written; where they are not, the axes are computed at run time from
``Shape`` (numpy's rule: an operand's axis of length 1 facing a longer one was broadcast).
"""

from __future__ import annotations

from edgert.exporter.gradients.registry import GradientContext
from edgert.exporter.graph_writer import GraphWriter


def sum_to(c: GradientContext, gradient: str, operand: str, result: str) -> str:
    """``gradient`` (shaped like the broadcast ``result``) summed to the shape of ``operand``."""
    mine, theirs = c.type_of(operand).shape, c.type_of(result).shape
    lead = len(theirs) - len(mine)
    if lead < 0:
        raise c.refuse(f"{operand!r} has more axes than the result {result!r}")
    axes = list(range(lead))
    for axis, dim in enumerate(mine):
        other = theirs[lead + axis]
        if dim == 1:
            if other != 1:  # a longer axis, or one of unknown length: summing a 1-long one changes nothing
                axes.append(lead + axis)
        elif dim is None or dim != other:  # unknown here: decided at run time
            return _sum_to_runtime_shape(c, gradient, operand, len(theirs))
    if not axes:
        return gradient
    w = c.writer
    if axes == list(range(lead)):  # only leading axes (a bias beside a batch): summed away, nothing to reshape
        return w.reduce("ReduceSum", gradient, axes, keepdims=False)
    summed = w.reduce("ReduceSum", gradient, axes, keepdims=True)
    return w.reshape(summed, c.shape_of(operand)) if lead else summed


def _sum_to_runtime_shape(c: GradientContext, gradient: str, operand: str, rank: int) -> str:
    w = c.writer
    shape = w.op("Shape", [operand])
    padded = _padded_shape(w, shape, c.rank(operand), rank)
    axes = broadcast_axes(w, padded, w.op("Shape", [gradient]))
    summed = w.op("ReduceSum", [gradient, axes], keepdims=1, noop_with_empty_axes=1)
    return w.reshape(summed, shape)


def broadcast_axes(w: GraphWriter, mine: str, other: str) -> str:
    """The axes along which a shape ``mine`` (padded to the result's rank) was broadcast against ``other``."""
    one = w.const([1])
    spread = w.op("And", [w.op("Equal", [mine, one]), w.op("Not", [w.op("Equal", [other, one])])])
    return w.reshape(w.op("NonZero", [spread]), [-1])


def _padded_shape(w: GraphWriter, shape: str, rank: int, target_rank: int) -> str:
    """A shape vector with leading ones up to ``target_rank`` (broadcasting aligns the right ends)."""
    return shape if rank == target_rank else w.op("Concat", [w.ints([1] * (target_rank - rank)), shape], axis=0)
