"""A non-last stage's backward started from the next stage's gradients themselves.

ORT's gradient builder derives a boundary output's gradient from the VJP loss (exporter/loss.py)
as ``Expand(seed, Shape(output * g)) * g``, the seed a constant 1: five nodes every call for
what is ``g``. Here that product becomes ``g``, and the loss's value, which the runtime never
reads from a non-last stage, leaves the graph with every node only it needed.
"""

from __future__ import annotations

from collections.abc import Collection

import onnx
from onnx import helper, numpy_helper

from edgert.exporter.graph_walk import needed_nodes, reads
from edgert.exporter.loss import SCALED_LOSS_OUTPUT
from edgert.exporter.stash import SEED


def seed_from_gradients(model: onnx.ModelProto, gradient_inputs: Collection[str],
                        keep: Collection[str] = ()) -> onnx.ModelProto:
    """A copy of ``model`` (a non-last stage's gradient graph) without the loss and with each unit product
    replaced by its gradient input; the nodes that compute ``keep`` stay (the forward's outputs, which
    the stashing split takes from this graph).

    A graph whose seed is not the constant 1, or whose product is not the VJP loss's, keeps its
    product (only the loss output and what it alone needed go).
    """
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    producers = {name: node for node in graph.node for name in node.output if name}
    ones = _ones(graph, producers)
    for index, node in enumerate(graph.node):
        gradient = _unit_product(node, ones, producers, set(gradient_inputs))
        if gradient is not None:
            graph.node[index].CopyFrom(helper.make_node("Identity", [gradient], [node.output[0]],
                                                        name=f"{node.name}/seeded"))
    kept = [o for o in graph.output if o.name != SCALED_LOSS_OUTPUT]
    del graph.output[:]
    graph.output.extend(kept)
    _drop_unused(graph, set(keep))
    return result


def _ones(graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto]) -> dict[str, str]:
    """Tensors that are the seed's 1 (itself, copied or expanded), each with the tensor whose shape it has
    ('' for the scalar seed)."""
    seed = next((init for init in graph.initializer if init.name == SEED), None)
    if seed is None or seed.dims or numpy_helper.to_array(seed) != 1:
        return {}
    ones = {SEED: ""}
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in ones:
            ones[node.output[0]] = ones[node.input[0]]
        elif node.op_type == "Expand" and node.input[0] in ones and ones[node.input[0]] == "":
            shape = producers.get(node.input[1])
            if shape is not None and shape.op_type == "Shape" and all(
                    a.name == "start" and a.i == 0 for a in shape.attribute):  # the whole shape
                ones[node.output[0]] = shape.input[0]
    return ones


def _unit_product(node: onnx.NodeProto, ones: dict[str, str], producers: dict[str, onnx.NodeProto],
                  gradients: set[str]) -> str | None:
    """The gradient input ``node`` multiplies by ones that leave it as it is (``Mul(ones, g)``), else None.

    The ones are the scalar seed, or have the shape of ``output * g`` (the VJP loss's product),
    which is ``g``'s: the loss declares ``g`` with its output's shape.
    """
    if node.op_type != "Mul" or len(node.input) != 2:
        return None
    for one, gradient in (node.input, reversed(node.input)):
        if one not in ones or gradient not in gradients:
            continue
        shaped_like = producers.get(ones[one])
        if ones[one] == "" or (shaped_like is not None and shaped_like.op_type == "Mul"
                               and gradient in shaped_like.input):
            return gradient
    return None


def _drop_unused(graph: onnx.GraphProto, keep: set[str]) -> None:
    """Remove the nodes and initializers that neither a graph output nor ``keep`` needs (graph inputs stay: the
    runtime feeds them)."""
    wanted = {o.name for o in graph.output} | keep
    positions = needed_nodes(graph, wanted)
    kept = [node for index, node in enumerate(graph.node) if index in positions]
    needed = wanted | {name for node in kept for name in reads(node)}
    del graph.node[:]
    graph.node.extend(kept)
    initializers = [init for init in graph.initializer if init.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    infos = [info for info in graph.value_info if info.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(infos)
