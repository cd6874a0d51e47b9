"""Forward floating-point operation counts per node, per sample.

Multiply-accumulate counts as two operations. Element-wise ops count one per output
element, normalisations and softmax a few. The planner only needs relative sizes, so
unknown ops count one per output element rather than failing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

Shape = tuple[int, ...]
ShapeOf = Callable[[str], "Shape | None"]

_PER_ELEMENT = {
    "Softmax": 5, "LogSoftmax": 5, "LayerNormalization": 8, "BatchNormalization": 4,
    "InstanceNormalization": 8, "Erf": 4, "Gelu": 8, "Sigmoid": 4, "Tanh": 4, "Exp": 2, "Sqrt": 2,
}


def node_flops(node: onnx.NodeProto, shape_of: ShapeOf) -> int:
    """Forward FLOPs of one node for one sample (batch dimension set to 1)."""
    out = shape_of(node.output[0]) if node.output else None
    out_elements = int(np.prod(out)) if out is not None else 0
    op = node.op_type
    if op == "Conv" or op == "ConvTranspose":
        weight = shape_of(node.input[1])
        if weight is None or out is None:
            return out_elements
        group = _int_attribute(node, "group", 1)
        per_output = int(np.prod(weight[1:])) if op == "Conv" else int(np.prod(weight[2:])) * weight[0] // group
        return 2 * out_elements * per_output
    if op in ("MatMul", "Gemm"):
        a = shape_of(node.input[0])
        if a is None or out is None:
            return out_elements
        transposed = op == "Gemm" and _int_attribute(node, "transA", 0)
        inner = a[0] if transposed else a[-1]
        return 2 * out_elements * inner
    if op in ("MaxPool", "AveragePool"):
        kernel = _ints_attribute(node, "kernel_shape")
        return out_elements * int(np.prod(kernel or [1]))
    if op in ("GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceSum", "ReduceMax"):
        source = shape_of(node.input[0])
        return int(np.prod(source)) if source is not None else out_elements
    return out_elements * _PER_ELEMENT.get(op, 1)


def _int_attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    for attribute in node.attribute:
        if attribute.name == name:
            return attribute.i
    return default


def _ints_attribute(node: onnx.NodeProto, name: str) -> list[int]:
    for attribute in node.attribute:
        if attribute.name == name:
            return list(attribute.ints)
    return []
