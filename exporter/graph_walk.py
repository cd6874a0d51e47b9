"""Walking a graph back from the tensors wanted: what a node reads, and which nodes some names need."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import onnx


def reads(node: onnx.NodeProto) -> Iterator[str]:
    """Every name ``node`` reads, those its sub-graphs read from the enclosing graph included."""
    yield from (name for name in node.input if name)
    for attribute in node.attribute:
        for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
            for inner in sub.node:
                yield from reads(inner)


def needed_nodes(graph: onnx.GraphProto, names: Iterable[str]) -> set[int]:
    """Positions of the nodes that computing ``names`` needs."""
    producers = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
    needed: set[int] = set()
    pending = [name for name in names if name in producers]
    while pending:
        index = producers[pending.pop()]
        if index in needed:
            continue
        needed.add(index)
        pending.extend(name for name in reads(graph.node[index]) if name in producers)
    return needed
