"""What stock onnxruntime runs: the proof that a stage's graphs need nothing a board lacks.

edgert's gradient builder writes standard ai.onnx operators only; a forward may also hold
the few ``com.microsoft`` operators that stock builds carry (an ORT-optimised model's
``FusedMatMul``, say). Anything else fails the export with one line naming the operator and
the node, so no plan ever fails on a board.
"""

from __future__ import annotations

import onnx

from edgert.exporter.errors import PortabilityError

#: ``com.microsoft`` operators that stock onnxruntime's CPU provider implements (fusions of standard patterns).
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


def refuse_nonstandard(model: onnx.ModelProto, what: str) -> None:
    """Fail, naming the operator and the node, where ``model`` holds a node stock onnxruntime cannot run."""
    opset = ai_onnx_opset(model)
    for node in model.graph.node:
        if not runs_on_stock(node, opset):
            shown = f"{node.domain}.{node.op_type}" if node.domain not in _ONNX_DOMAINS else node.op_type
            raise PortabilityError(f"{what}: operator {shown} (node {node.name!r}) is not one stock onnxruntime "
                                   f"runs at ai.onnx opset {opset}; a board could not load this stage")
