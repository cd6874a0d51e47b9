"""Gradient rules of operators that move values without computing: reshapes, transposes, joins, slices,
gathers and scatters, padding, tiling.

A rule uses a tensor's shape as a constant where it is known and ``Shape`` of the forward
tensor where it is not, so every rule works for shapes known only at run time (a channel
shuffle's computed Reshape, any batch size).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from edgert.exporter.gradients.broadcast import sum_to
from edgert.exporter.gradients.registry import ALL_INPUTS, GradientContext, gradient

_LARGE = 2 ** 62  # ends at or past this mean "to the end" (torch writes INT64_MAX)


@gradient("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(c: GradientContext) -> dict[int, str]:
    return {0: c.writer.reshape(c.dy(), c.shape_of(c.input(0)))}


@gradient("Transpose")
def transpose(c: GradientContext) -> dict[int, str]:
    perm = c.attr("perm") or list(reversed(range(c.rank(c.input(0)))))
    return {0: c.writer.op("Transpose", [c.dy()], perm=[int(i) for i in np.argsort(perm)])}


@gradient("Expand")
def expand(c: GradientContext) -> dict[int, str]:
    return {0: sum_to(c, c.dy(), c.input(0), c.output(0))}


def _axis(c: GradientContext, name: str, default: int = 0) -> int:
    axis = c.attr("axis", default)
    return axis + c.rank(name) if axis < 0 else axis


@gradient("Concat", inputs=ALL_INPUTS)
def concat(c: GradientContext) -> dict[int, str]:
    """dY split along the axis into the inputs' lengths."""
    w = c.writer
    inputs = list(c.node.input)
    axis = _axis(c, c.output(0))
    lengths = [c.type_of(name).shape[axis] for name in inputs]
    if all(isinstance(n, int) for n in lengths):
        sizes = w.ints(lengths)
    else:
        sizes = w.op("Concat", [w.op("Slice", [w.op("Shape", [x]), w.ints([axis]), w.ints([axis + 1])])
                                for x in inputs], axis=0)
    parts = w.multi("Split", [c.dy(), sizes], len(inputs), axis=axis)
    return {i: parts[i] for i in c.wanted}


@gradient("Split")
def split(c: GradientContext) -> dict[int, str]:
    axis = _axis(c, c.input(0))
    pieces = [c.dy(i) for i in range(len(c.node.output))]
    return {0: c.writer.op("Concat", pieces, axis=axis)}


def _constant(c: GradientContext, name: str | None) -> np.ndarray | None:
    """The value of an initializer input (a Slice's starts, a Pad's pads), or None when it is computed."""
    return None if name is None else c.constant(name)


@gradient("Slice")
def slice_(c: GradientContext) -> dict[int, str]:
    """dY padded back with zeros (unit steps), else scattered back to the positions the Slice read."""
    x = c.input(0)
    starts, ends = _constant(c, c.input(1)), _constant(c, c.input(2))
    axes = _constant(c, c.input(3)) if c.input(3) else None
    steps = _constant(c, c.input(4)) if c.input(4) else None
    known = starts is not None and ends is not None and (c.input(3) is None or axes is not None) and \
        (c.input(4) is None or steps is not None)
    if known and (steps is None or np.all(steps == 1)):
        rank = c.rank(x)
        axes = [int(a) + rank if a < 0 else int(a) for a in (axes if axes is not None else range(len(starts)))]
        return {0: _pad_back(c, x, axes, [int(s) for s in starts], [int(e) for e in ends])}
    return {0: _scatter_back(c)}


def _pad_back(c: GradientContext, x: str, axes: list[int], starts: list[int], ends: list[int]) -> str:
    """Pad dY with zeros to ``x``'s shape: before each sliced axis its clamped start, after it what lies past
    its clamped end."""
    w = c.writer
    rank = c.rank(x)
    dims = c.type_of(x).shape
    before, after = [0] * rank, [0] * rank
    runtime: dict[int, tuple[int, int]] = {}
    for axis, start, end in zip(axes, starts, ends):
        size = dims[axis]
        if isinstance(size, int):
            first = min(max(start + size if start < 0 else start, 0), size)
            last = min(max(end + size if end < 0 else end, 0), size)
            before[axis], after[axis] = first, size - max(last, first)
        elif start >= 0 and end >= _LARGE:
            before[axis] = start
        else:
            runtime[axis] = (start, end)
    pads = w.ints(before + after)
    if runtime:
        pads = _runtime_pads(c, x, before, after, runtime)
    if not any(before + after) and not runtime:
        return c.dy()
    return w.op("Pad", [c.dy(), pads])


def _runtime_pads(c: GradientContext, x: str, before: list[int], after: list[int],
                  runtime: dict[int, tuple[int, int]]) -> str:
    """Pads for axes whose length is known only at run time: the same clamping, computed from ``Shape``."""
    w = c.writer
    shape = w.op("Shape", [x])
    rank = len(before)
    begin_parts, end_parts = [], []
    for axis in range(rank):
        if axis not in runtime:
            begin_parts.append(w.ints([before[axis]]))
            end_parts.append(w.ints([after[axis]]))
            continue
        start, end = runtime[axis]
        size = w.op("Slice", [shape, w.ints([axis]), w.ints([axis + 1])])
        first = _clamped(c, start, size)
        last = w.op("Max", [_clamped(c, end, size), first])
        begin_parts.append(first)
        end_parts.append(w.op("Sub", [size, last]))
    return w.op("Concat", [*begin_parts, *end_parts], axis=0)


def _clamped(c: GradientContext, index: int, size: str) -> str:
    """``index`` (negative counts from the end) clamped to [0, size], as a 1-element int64 tensor."""
    w = c.writer
    value = w.op("Add", [size, w.ints([index])]) if index < 0 else w.ints([min(index, _LARGE)])
    return w.op("Min", [w.op("Max", [value, w.ints([0])]), size])


def _scatter_back(c: GradientContext) -> str:
    """dY written back at the positions the Slice took from a tensor of flat positions (any steps, computed
    starts and ends)."""
    w = c.writer
    x = c.input(0)
    shape = w.op("Shape", [x])
    size = w.reduce("ReduceProd", shape, [0], keepdims=False)
    positions = w.reshape(w.op("Range", [w.const(0), size, w.const(1)]), shape)
    sliced = w.op("Slice", [positions, *[name or "" for name in c.node.input[1:]]])
    zeros = w.zeros(w.reshape(size, [1]), c.type_of(x).elem_type)
    flat = w.op("ScatterElements", [zeros, w.reshape(sliced, [-1]), w.reshape(c.dy(), [-1])], axis=0)
    return w.reshape(flat, shape)


def _needs_reduction_ops(c: GradientContext) -> None:
    if c.writer.opset < 16:
        raise c.refuse(f"its gradient adds repeated indices with ScatterND/ScatterElements(reduction='add'), "
                       f"which need ai.onnx opset >= 16 (the model has {c.writer.opset}); re-export it at opset 17")


def scatter_add_rows(c: GradientContext, shape: str, indices: str, updates: str, elem_type: int) -> str:
    """zeros(shape) with ``updates`` added at rows ``indices`` of axis 0 (repeats add up, negative ones wrap)."""
    w = c.writer
    _needs_reduction_ops(c)
    zeros = w.zeros(shape, elem_type)
    rows = w.op("Gather", [shape, w.const(0)], axis=0)
    wrapped = w.op("Mod", [w.op("Add", [indices, rows]), rows])
    return w.op("ScatterND", [zeros, w.unsqueeze(wrapped, [-1]), updates], reduction="add")


@gradient("Gather")
def gather(c: GradientContext) -> dict[int, str]:
    """The gradient rows scattered (added) back to the gathered positions; a scalar index as a 1-element one."""
    w = c.writer
    data, indices, dy = c.input(0), c.input(1), c.dy()
    rank, q = c.rank(data), c.rank(indices)
    elem_type = c.type_of(data).elem_type
    axis = _axis(c, data)
    shape = c.shape_of(data)
    indices = w.cast(indices, TensorProto.INT64) if c.type_of(indices).elem_type != TensorProto.INT64 else indices
    if q == 0:
        indices, dy, q = w.unsqueeze(indices, [0]), w.unsqueeze(dy, [axis]), 1
    if axis == 0:
        return {0: scatter_add_rows(c, shape, indices, dy, elem_type)}
    dy_perm = [*range(axis, axis + q), *range(axis), *range(axis + q, rank - 1 + q)]
    data_perm = [axis, *range(axis), *range(axis + 1, rank)]
    moved_shape = w.op("Gather", [shape, w.ints(data_perm)], axis=0)
    moved = scatter_add_rows(c, moved_shape, indices, w.op("Transpose", [dy], perm=dy_perm), elem_type)
    return {0: w.op("Transpose", [moved], perm=[int(i) for i in np.argsort(data_perm)])}


@gradient("GatherElements")
def gather_elements(c: GradientContext) -> dict[int, str]:
    w, data = c.writer, c.input(0)
    _needs_reduction_ops(c)
    zeros = w.zeros(c.shape_of(data), c.type_of(data).elem_type)
    return {0: w.op("ScatterElements", [zeros, c.input(1), c.dy()], axis=_axis(c, data), reduction="add")}


@gradient("GatherND")
def gather_nd(c: GradientContext) -> dict[int, str]:
    w, data = c.writer, c.input(0)
    if c.attr("batch_dims", 0):
        raise c.refuse("batch_dims other than 0 is not supported")
    _needs_reduction_ops(c)
    zeros = w.zeros(c.shape_of(data), c.type_of(data).elem_type)
    return {0: w.op("ScatterND", [zeros, c.input(1), c.dy()], reduction="add")}


@gradient("ScatterND", inputs=(0, 2))
def scatter_nd(c: GradientContext) -> dict[int, str]:
    """Data: dY with the written positions zeroed; updates: dY at those positions."""
    w, dy, indices = c.writer, c.dy(), c.input(1)
    if c.attr("reduction", "none") != "none":
        raise c.refuse(f"reduction {c.attr('reduction')!r} is not supported")
    result = {}
    if c.wants(0):
        updates = c.input(2)
        zeros = w.zeros(c.shape_of(updates), c.type_of(updates).elem_type)
        result[0] = w.op("ScatterND", [dy, indices, zeros])
    if c.wants(2):
        result[2] = w.op("GatherND", [dy, indices])
    return result


@gradient("ScatterElements", inputs=(0, 2))
def scatter_elements(c: GradientContext) -> dict[int, str]:
    w, dy, indices = c.writer, c.dy(), c.input(1)
    if c.attr("reduction", "none") != "none":
        raise c.refuse(f"reduction {c.attr('reduction')!r} is not supported")
    axis = _axis(c, c.input(0))
    result = {}
    if c.wants(0):
        updates = c.input(2)
        zeros = w.zeros(c.shape_of(updates), c.type_of(updates).elem_type)
        result[0] = w.op("ScatterElements", [dy, indices, zeros], axis=axis)
    if c.wants(2):
        result[2] = w.op("GatherElements", [dy, indices], axis=axis)
    return result


@gradient("Pad")
def pad(c: GradientContext) -> dict[int, str]:
    """Constant padding: dY with the padding sliced off (and padded with zeros where the Pad cropped)."""
    x = c.input(0)
    if c.attr("mode", "constant") != "constant":
        raise c.refuse(f"mode {c.attr('mode')!r} is not supported (only constant padding)")
    rank = c.rank(x)
    axes = list(range(rank))
    if c.input(3):
        axes_value = _constant(c, c.input(3))
        if axes_value is None:
            raise c.refuse("its axes are computed at run time")
        axes = [int(a) + rank if a < 0 else int(a) for a in axes_value]
    pads = _constant(c, c.input(1)) if c.input(1) else np.asarray(c.attr("pads"), dtype=np.int64)
    if pads is None:
        return {0: _unpad_at_run_time(c, axes)}
    count = len(axes)
    begin, end = [int(p) for p in pads[:count]], [int(p) for p in pads[count:]]
    w = c.writer
    starts = [max(b, 0) for b in begin]
    ends = [-e if e > 0 else _LARGE for e in end]
    cropped = w.op("Slice", [c.dy(), w.ints(starts), w.ints(ends), w.ints(axes)]) if any(starts) or any(
        e != _LARGE for e in ends) else c.dy()
    if any(b < 0 for b in begin) or any(e < 0 for e in end):
        full = [0] * (2 * rank)
        for axis, b, e in zip(axes, begin, end):
            full[axis], full[axis + rank] = max(-b, 0), max(-e, 0)
        cropped = w.op("Pad", [cropped, w.ints(full)])
    return {0: cropped}


def _unpad_at_run_time(c: GradientContext, axes: list[int]) -> str:
    """The same for pads computed at run time (a window attention's padding to a multiple of the window)."""
    w = c.writer
    count = len(axes)
    pads = w.cast(c.input(1), TensorProto.INT64)
    zero = w.ints([0])
    begin = w.op("Slice", [pads, zero, w.ints([count])])
    end = w.op("Slice", [pads, w.ints([count]), w.ints([2 * count])])
    sizes = w.op("Gather", [w.op("Shape", [c.dy()]), w.ints(axes)], axis=0)
    kept = w.op("Slice", [c.dy(), w.op("Max", [begin, zero]), w.op("Sub", [sizes, w.op("Max", [end, zero])]),
                          w.ints(axes)])
    cropped_begin = w.op("Max", [w.op("Neg", [begin]), zero])
    cropped_end = w.op("Max", [w.op("Neg", [end]), zero])
    rank = c.rank(c.input(0))
    full_begin = w.op("ScatterElements", [w.ints([0] * rank), w.ints(axes), cropped_begin], axis=0)
    full_end = w.op("ScatterElements", [w.ints([0] * rank), w.ints(axes), cropped_end], axis=0)
    return w.op("Pad", [kept, w.op("Concat", [full_begin, full_end], axis=0)])


@gradient("Tile")
def tile(c: GradientContext) -> dict[int, str]:
    """dY seen as (repeats_0, d_0, repeats_1, d_1, ...) and summed over the repeats."""
    w, x = c.writer, c.input(0)
    repeats = _constant(c, c.input(1))
    if repeats is None:
        raise c.refuse("its repeats are computed at run time")
    rank = c.rank(x)
    shape = w.op("Shape", [x])
    interleaved = w.op("Concat", [w.reshape(w.op("Concat", [w.ints([int(r)]), w.op(
        "Slice", [shape, w.ints([axis]), w.ints([axis + 1])])], axis=0), [2]) for axis, r in enumerate(repeats)],
        axis=0)
    split = w.op("Reshape", [c.dy(), interleaved])
    summed = w.reduce("ReduceSum", split, [2 * axis for axis in range(rank)], keepdims=False)
    return {0: summed}


@gradient("Trilu")
def trilu(c: GradientContext) -> dict[int, str]:
    """The same triangle of dY (the rest of the input never reached the output)."""
    inputs = [c.dy(), *c.node.input[1:2]]
    return {0: c.writer.op("Trilu", inputs, upper=c.attr("upper", 1))}


@gradient("CumSum")
def cumsum(c: GradientContext) -> dict[int, str]:
    return {0: c.writer.op("CumSum", [c.dy(), c.input(1)], exclusive=c.attr("exclusive", 0),
                           reverse=1 - c.attr("reverse", 0))}
