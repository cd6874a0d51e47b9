"""Walking a graph back from the tensors wanted: what a node reads, which nodes some names need, and the graph
without the rest."""

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


def drop_unneeded(graph: onnx.GraphProto, keep: Iterable[str] = ()) -> None:
    """Remove the nodes, initializers and value infos that neither a graph output nor a name in ``keep`` needs
    (graph inputs stay: a runtime feeds them)."""
    wanted = {o.name for o in graph.output} | set(keep)
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
