"""Writing standard ONNX nodes into a graph under construction, with unique names.

The gradient rewrites (``gradient_rules``) and the recurrent unrolling (``recurrent``) emit
many small nodes; this keeps their names unique, their constants typed, and hides the
operators whose form changed between ai.onnx opsets (reductions and ``Unsqueeze`` take
their axes as an input from opset 13 or 18).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

Dim = int | str | None


@dataclass(frozen=True)
class TensorType:
    """Element type (``onnx.TensorProto`` enum) and shape of a tensor; a dim is an int, a name or None."""

    elem_type: int
    shape: tuple[Dim, ...] | None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def numpy_dtype(self) -> np.dtype:
        return helper.tensor_dtype_to_np_dtype(self.elem_type)

    def static_dims(self, start: int = 0) -> tuple[int, ...] | None:
        """The dims from ``start`` on, when each is a known integer."""
        if self.shape is None or not all(isinstance(d, int) for d in self.shape[start:]):
            return None
        return tuple(self.shape[start:])  # type: ignore[arg-type]


# Squeeze, Unsqueeze and Split take their axes (split sizes) as an input from opset 13.
_AXES_INPUT = 13
# Reductions whose axes became an input in opset 18 (ReduceSum: 13).
_REDUCE_AXES_INPUT = {"ReduceSum": 13}
_REDUCE_AXES_INPUT_DEFAULT = 18


class GraphWriter:
    """Collects nodes and constants that replace one node; every name starts with ``prefix``."""

    def __init__(self, prefix: str, opset: int):
        self.prefix = prefix
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}/{hint}_{self._count}"

    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, outputs: Sequence[str] | None = None,
           domain: str = "", **attributes) -> str:
        """Append one node; returns its (first) output name."""
        outs = list(outputs) if outputs is not None else [self.fresh(hint or op_type)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(op_type),
                                           domain=domain or None, **attributes))
        return outs[0]

    def multi(self, op_type: str, inputs: Sequence[str], count: int, **attributes) -> list[str]:
        """Append one node with ``count`` outputs; returns their names."""
        outs = [self.fresh(op_type) for _ in range(count)]
        self.op(op_type, inputs, outputs=outs, **attributes)
        return outs

    def const(self, value, dtype: np.dtype | type = np.int64, hint: str = "const") -> str:
        """A constant initializer holding ``value`` as ``dtype``."""
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def zeros(self, shape: str, elem_type: int) -> str:
        """A tensor of zeros of element type ``elem_type`` and the runtime shape ``shape`` (a 1-D int64 tensor)."""
        return self.op("ConstantOfShape", [shape], value=helper.make_tensor("zero", elem_type, [1], [0]))

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.asarray(list(values), dtype=np.int64), hint="ints")

    def reduce(self, op_type: str, x: str, axes: Sequence[int] | None, keepdims: bool = True,
               output: str | None = None) -> str:
        """``op_type`` (ReduceSum, ReduceMean, ReduceMax) over ``axes`` (None: all), in the opset's form."""
        outputs = [output] if output else None
        if axes is None:
            return self.op(op_type, [x], outputs=outputs, keepdims=int(keepdims))
        if self.opset >= _REDUCE_AXES_INPUT.get(op_type, _REDUCE_AXES_INPUT_DEFAULT):
            return self.op(op_type, [x, self.ints(axes)], outputs=outputs, keepdims=int(keepdims))
        return self.op(op_type, [x], outputs=outputs, axes=list(axes), keepdims=int(keepdims))

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset < _AXES_INPUT:
            return self.op("Unsqueeze", [x], axes=list(axes))
        return self.op("Unsqueeze", [x, self.ints(axes)])

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset < _AXES_INPUT:
            return self.op("Squeeze", [x], axes=list(axes))
        return self.op("Squeeze", [x, self.ints(axes)])

    def reshape(self, x: str, shape: Sequence[int] | str, output: str | None = None) -> str:
        target = shape if isinstance(shape, str) else self.ints(shape)
        return self.op("Reshape", [x, target], outputs=[output] if output else None)

    def identity(self, x: str, output: str) -> str:
        return self.op("Identity", [x], outputs=[output])

    def cast(self, x: str, elem_type: int) -> str:
        """``x`` as ``elem_type`` (an ``onnx.TensorProto`` enum)."""
        return self.op("Cast", [x], to=elem_type)
