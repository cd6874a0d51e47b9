"""The gradient rules' registry and the context a rule writes its part of the backward in.

One rule per forward operator (``@gradient("Relu", inputs=(0,))``): given the gradients of the
node's outputs it writes, in standard ONNX operators, the gradients of the inputs the builder
asks for, and returns them by input position. An operator whose forward must expose more for its
backward (BatchNormalization's batch statistics) also has a *training form*
(``@training_form("BatchNormalization")``), written in place of the forward node.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, MutableMapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgert.exporter.errors import GradientError
from edgert.exporter.graph_writer import GraphWriter, TensorType

ALL_INPUTS = None  # a rule's ``inputs``: every input position (variadic operators)


@dataclass
class NodeContext:
    """One forward node, the writer for what replaces or differentiates it, and the graph's tensor types."""

    node: onnx.NodeProto
    writer: GraphWriter
    types: MutableMapping[str, TensorType]
    initializers: Mapping[str, onnx.TensorProto]

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
        """The element type and shape of ``name`` (its rank at least must be known)."""
        found = self.types.get(name)
        if found is None or found.shape is None:
            raise self.refuse(f"the rank of {name!r} is unknown")
        return found

    def rank(self, name: str) -> int:
        return len(self.type_of(name).shape)

    def static(self, name: str, start: int = 0, what: str = "dims") -> tuple[int, ...]:
        """The dims of ``name`` from ``start`` on; they must be known integers."""
        dims = self.type_of(name).static_dims(start)
        if dims is None:
            raise self.refuse(f"{what} of {name!r} must be fixed (got {list(self.type_of(name).shape)})")
        return dims

    def refuse(self, reason: str) -> GradientError:
        node = self.node
        return GradientError(f"no gradient for {node.domain + '.' if node.domain else ''}{node.op_type} "
                             f"(node {node.name!r}): {reason}")

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` where it is a constant initializer (a Slice's starts, say), else None."""
        tensor = self.initializers.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)

    def zero_like(self, name: str) -> str:
        return self.writer.const(0, self.type_of(name).numpy_dtype, hint="zero")

    def scalar_like(self, value: float, name: str) -> str:
        return self.writer.const(value, self.type_of(name).numpy_dtype, hint="scalar")

    def shape_of(self, name: str) -> str:
        """``name``'s shape as a 1-D int64 tensor: a constant where every dim is known, else ``Shape``."""
        dims = self.types.get(name)
        static = dims.static_dims() if dims is not None else None
        if static is not None:
            return self.writer.ints(static)
        return self.writer.op("Shape", [name])


@dataclass
class GradientContext(NodeContext):
    """A node to differentiate: the gradients of its outputs and the input positions whose gradients are wanted."""

    output_gradients: list[str | None] = field(default_factory=list)
    wanted: frozenset[int] = frozenset()
    saved: Mapping[str, str] = field(default_factory=dict)
    """What the node's training form exposed for its backward (BatchNorm's batch mean, say)."""

    def wants(self, index: int) -> bool:
        return index in self.wanted

    def has_gradient(self, index: int) -> bool:
        return index < len(self.output_gradients) and self.output_gradients[index] is not None

    def dy(self, index: int = 0) -> str:
        """The gradient of output ``index``; zeros shaped like the output where none flows into it."""
        gradient = self.output_gradients[index] if index < len(self.output_gradients) else None
        if gradient is not None:
            return gradient
        output = self.output(index)
        kind = self.type_of(output)
        zeros = self.writer.zeros(self.shape_of(output), kind.elem_type)
        self.types[zeros] = kind
        return zeros


Rule = Callable[[GradientContext], Mapping[int, str]]
TrainingForm = Callable[[NodeContext], Mapping[str, str]]


@dataclass(frozen=True)
class GradientRule:
    """How one operator is differentiated: the input positions gradients flow to, and the rule itself."""

    backward: Rule
    inputs: tuple[int, ...] | None  # None: every input (variadic operators)

    def differentiable(self, node: onnx.NodeProto) -> list[int]:
        positions = range(len(node.input)) if self.inputs is None else self.inputs
        return [i for i in positions if i < len(node.input) and node.input[i]]


RULES: dict[tuple[str, str], GradientRule] = {}
TRAINING_FORMS: dict[tuple[str, str], TrainingForm] = {}
#: Operators whose outputs are piecewise constant in their inputs (or are indices): no gradient flows through.
NO_GRADIENT = frozenset({
    "Floor", "Ceil", "Round", "Sign", "ArgMax", "ArgMin", "Shape", "Size", "NonZero", "Equal", "Less",
    "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf", "OneHot",
    "RandomNormalLike", "RandomUniformLike", "Bernoulli", "ConstantOfShape", "Range", "EyeLike", "Multinomial",
    "BitShift", "Mod",
})


def gradient(*op_types: str, inputs: Collection[int] | None = (0,), domain: str = "") -> Callable[[Rule], Rule]:
    """Register ``function`` as the gradient rule of ``op_types``; ``inputs`` are the differentiable positions."""
    def register(function: Rule) -> Rule:
        for op_type in op_types:
            RULES[(domain, op_type)] = GradientRule(function, None if inputs is None else tuple(inputs))
        return function
    return register


def training_form(*op_types: str, domain: str = "") -> Callable[[TrainingForm], TrainingForm]:
    """Register ``function`` as what replaces a forward node of ``op_types`` in a graph that is differentiated."""
    def register(function: TrainingForm) -> TrainingForm:
        for op_type in op_types:
            TRAINING_FORMS[(domain, op_type)] = function
        return function
    return register


def rule_for(node: onnx.NodeProto) -> GradientRule | None:
    return RULES.get((_domain(node), node.op_type))


def training_form_for(node: onnx.NodeProto) -> TrainingForm | None:
    return TRAINING_FORMS.get((_domain(node), node.op_type))


def passes_no_gradient(node: onnx.NodeProto) -> bool:
    return _domain(node) == "" and node.op_type in NO_GRADIENT


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def float_type(kind: TensorType | None) -> bool:
    return kind is not None and np.issubdtype(kind.numpy_dtype, np.floating)
