"""Portable stage graphs: what stock onnxruntime runs, on any board (docs/EXPORTER.md).

ORT's gradient builder exists only in the training build (x86-64, CPython 3.11/3.12, end
of line) and emits operators only that build implements. :func:`make_portable` replaces
each of them with standard ONNX operators (``gradient_rules``) and then proves the result
needs nothing else: every node is a standard operator of the model's opset, or one of the
few ``com.microsoft`` operators that stock builds carry. Anything else fails the export
with one line naming the operator and the node, so no plan ever fails on a board.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from edgert.exporter import convolution_rules  # noqa: F401  (registers its rules in RULES)
from edgert.exporter.errors import PortabilityError
from edgert.exporter.gradient_rules import RULES, RuleContext
from edgert.exporter.graph_writer import GraphWriter, TensorType

#: ``com.microsoft`` operators that stock onnxruntime's CPU provider implements and that ORT's
#: graph optimiser may write into a stage (fusions of standard patterns).
STOCK_CONTRIB_OPS = frozenset({
    "FusedMatMul", "FusedGemm", "FusedConv", "Gelu", "FastGelu", "BiasGelu", "QuickGelu",
    "SkipLayerNormalization", "SkipSimplifiedLayerNormalization",
})
#: Operators stock onnxruntime registers in the ONNX domain beyond the ONNX standard (before opset 17).
STOCK_ORT_ONNX_DOMAIN_OPS = frozenset({"LayerNormalization", "SimplifiedLayerNormalization"})
_ONNX_DOMAINS = ("", "ai.onnx")
CONTRIB = "com.microsoft"


def ai_onnx_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in _ONNX_DOMAINS), 1)


def runs_on_stock(node: onnx.NodeProto, opset: int) -> bool:
    """Whether stock onnxruntime's CPU provider has a kernel for ``node`` at ai.onnx ``opset``."""
    if node.domain in _ONNX_DOMAINS:
        return (onnx.defs.has(node.op_type, max_inclusive_version=opset, domain="")
                or node.op_type in STOCK_ORT_ONNX_DOMAIN_OPS)
    return node.domain == CONTRIB and node.op_type in STOCK_CONTRIB_OPS


def make_portable(model: onnx.ModelProto, what: str, known: Mapping[str, TensorType] | None = None
                  ) -> onnx.ModelProto:
    """A copy of ``model`` in which every operator only the training build runs is rewritten.

    ``what`` names the graph in errors (``stage 2 backward``); ``known`` gives the types of
    the forward graph's tensors (see :func:`tensor_types`).
    """
    opset = ai_onnx_opset(model)
    pending = [node for node in model.graph.node if not runs_on_stock(node, opset)]
    if not pending:
        return model
    _refuse_unknown(pending, what)
    types = tensor_types(model, known)
    producers = {output: node for node in model.graph.node for output in node.output if output}
    result = onnx.ModelProto()
    result.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if runs_on_stock(node, opset):
            nodes.append(node)
            continue
        writer = GraphWriter(f"{node.name or node.op_type}/portable", opset)
        try:
            RULES[(node.domain if node.domain not in _ONNX_DOMAINS else "", node.op_type)](
                RuleContext(node, writer, types, producers))
        except PortabilityError as error:
            raise PortabilityError(f"{what}: {error}") from None
        nodes.extend(writer.nodes)
        result.graph.initializer.extend(writer.initializers)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    _refuse_unknown([n for n in nodes if not runs_on_stock(n, opset)], what)
    return result


def _refuse_unknown(nodes: list[onnx.NodeProto], what: str) -> None:
    for node in nodes:
        domain = node.domain if node.domain not in _ONNX_DOMAINS else ""
        if (domain, node.op_type) not in RULES:
            shown = f"{domain}.{node.op_type}" if domain else node.op_type
            raise PortabilityError(f"{what}: operator {shown} (node {node.name!r}) has no portable form: stock "
                                   f"onnxruntime cannot run it and edgert cannot rewrite it (docs/EXPORTER.md "
                                   f"lists the supported operators)")


def tensor_types(model: onnx.ModelProto, known: Mapping[str, TensorType] | None = None) -> dict[str, TensorType]:
    """Element type and shape of the tensors of ``model`` that ``onnx`` can infer, plus ``known`` ones.

    ``onnx`` knows no training-build operator, so what lies behind one stays unknown unless
    ``known`` (the types of the stage's forward graph) names it; rules ask only for forward
    tensors' shapes, and take a gradient's element type from its forward tensor.
    """
    types = dict(known or {})
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    graph = inferred.graph
    for value in [*graph.input, *graph.value_info, *graph.output]:
        found = type_of_value(value)
        if found is not None:
            types.setdefault(value.name, found)
    for init in graph.initializer:
        types[init.name] = TensorType(init.data_type, tuple(init.dims))
    return types


def type_of_value(value: onnx.ValueInfoProto) -> TensorType | None:
    """The :class:`TensorType` a value info declares, or None when it declares no element type."""
    tensor = value.type.tensor_type
    if not tensor.elem_type:
        return None
    if not tensor.HasField("shape"):
        return TensorType(tensor.elem_type, None)
    dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
    return TensorType(tensor.elem_type, dims)
