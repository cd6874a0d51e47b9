"""Reverse-mode differentiation of an ONNX graph into standard ONNX operators.

:func:`build_gradient_graph` takes a forward graph, the gradients of some of its tensors (the
*seeds*: a loss's 1, or the gradients the next stage sends for a stage's outputs) and the
tensors whose gradients are wanted (parameters, boundary inputs). It writes one graph holding
the forward (each node in its training form where it has one) and the backward: walking the
nodes in reverse, each node some seed depends on through it is differentiated by its rule
(``registry.RULES``), and the gradients of a tensor used several times are summed. The result
outputs, after the forward graph's own outputs, ``<name>_grad`` for every wanted tensor the
seeds depend on. Nothing outside the ai.onnx domain is written, and nothing is fused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import onnx
from onnx import helper

from edgert.exporter.errors import GradientError
from edgert.exporter.gradients import rules  # noqa: F401  (registers every rule)
from edgert.exporter.gradients.registry import (
    GradientContext,
    NodeContext,
    float_type,
    passes_no_gradient,
    rule_for,
    training_form_for,
)
from edgert.exporter.graph_walk import drop_unneeded, reads
from edgert.exporter.graph_writer import GraphWriter, TensorType
from edgert.exporter.standard_ops import ai_onnx_opset

GRADIENT_SUFFIX = "_grad"


def gradient_name(tensor: str) -> str:
    """The output that carries the gradient of ``tensor``."""
    return f"{tensor}{GRADIENT_SUFFIX}"


@dataclass
class GradientGraph:
    """The forward-and-backward graph, and which wanted tensors received no gradient (the seeds do not depend on
    them through differentiable operators)."""

    model: onnx.ModelProto
    without_gradient: list[str]


def build_gradient_graph(model: onnx.ModelProto, seeds: Mapping[str, str], wanted: Collection[str],
                         types: Mapping[str, TensorType], what: str, keep: Collection[str] = ()
                         ) -> GradientGraph:
    """``model``'s forward and the gradients of ``wanted`` from ``seeds`` (forward tensor -> its gradient, a graph
    input or initializer of ``model``), as one graph.

    ``types`` gives the forward tensors' element types and shapes (exporter.gradients.shapes);
    ``what`` names the graph in errors (``stage 2``). Nodes that neither an output nor ``keep``
    needs are dropped.
    """
    graph = model.graph
    opset = ai_onnx_opset(model)
    types = dict(types)
    active = _active_tensors(graph, seeds, set(wanted), types, what)
    constants = {init.name: init for init in graph.initializer}
    initializers: list[onnx.TensorProto] = []
    forward, saved = _training_forms(graph, active, types, constants, opset, initializers, _unique_prefixes(graph))
    gradients: dict[str, list[str]] = {tensor: [seed] for tensor, seed in seeds.items()}
    for seed_of, seed in seeds.items():
        if seed_of in types:
            types.setdefault(seed, types[seed_of])
    backward: list[onnx.NodeProto] = []
    prefixes = _unique_prefixes(graph)
    for index, node in reversed(list(enumerate(graph.node))):
        output_gradients = [_total(gradients, name, backward, opset) if name else None for name in node.output]
        if not any(output_gradients):
            continue
        rule = rule_for(node)
        if rule is None:
            continue  # _active_tensors proved that no gradient flows through it
        positions = frozenset(i for i in rule.differentiable(node) if node.input[i] in active)
        if not positions:
            continue
        writer = GraphWriter(f"{prefixes[index]}/grad", opset)
        context = GradientContext(node, writer, types, constants, output_gradients, positions,
                                  saved.get(node.name, {}))
        try:
            produced = rule.backward(context)
        except GradientError as error:
            raise GradientError(f"{what}: {error}") from None
        backward.extend(writer.nodes)
        initializers.extend(writer.initializers)
        for position, value in produced.items():
            if position in positions and value is not None:
                source = node.input[position]
                types.setdefault(value, types[source])
                gradients.setdefault(source, []).append(value)
    totals = {name: _total(gradients, name, backward, opset) for name in wanted if name in gradients}
    _name_outputs(backward, totals)
    outputs = [helper.make_tensor_value_info(gradient_name(name), types[name].elem_type, types[name].shape)
               for name in totals]
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend([*forward, *backward])
    result.graph.initializer.extend(initializers)
    result.graph.output.extend(outputs)
    drop_unneeded(result.graph, keep)
    return GradientGraph(result, [name for name in wanted if name not in gradients])


def _active_tensors(graph: onnx.GraphProto, seeds: Mapping[str, str], wanted: set[str],
                    types: Mapping[str, TensorType], what: str) -> set[str]:
    """Float tensors that depend on a wanted tensor and on which a seed depends: those gradients flow through.

    An operator on that path without a rule fails here, naming the operator and the node.
    """
    varied = set(wanted)
    for node in graph.node:
        if passes_no_gradient(node):
            continue
        rule = rule_for(node)
        positions = rule.differentiable(node) if rule is not None else range(len(node.input))
        if any(node.input[i] in varied for i in positions):
            varied.update(name for name in node.output if name and float_type(types.get(name)))
    reaching = set(seeds)
    for node in reversed(graph.node):
        if any(name in reaching for name in node.output):
            reaching.update(reads(node))
    active = varied & reaching
    for node in graph.node:
        if rule_for(node) is None and not passes_no_gradient(node) and \
                any(name in active for name in node.output) and any(name in active for name in node.input):
            shown = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
            raise GradientError(f"{what}: edgert has no gradient rule for operator {shown} (node {node.name!r}); "
                                "move it out of the trained part of the model or replace it with a differentiable "
                                "operator (docs/EXPORTER.md lists the operators with rules)")
    return active


def _training_forms(graph: onnx.GraphProto, active: set[str], types: dict[str, TensorType],
                    constants: Mapping[str, onnx.TensorProto], opset: int, initializers: list[onnx.TensorProto],
                    prefixes: list[str]) -> tuple[list[onnx.NodeProto], dict[str, dict[str, str]]]:
    """The forward nodes, each one whose outputs are differentiated in its training form (where it has one), and
    what each training form exposed for its backward."""
    nodes: list[onnx.NodeProto] = []
    saved: dict[str, dict[str, str]] = {}
    for index, node in enumerate(graph.node):
        form = training_form_for(node)
        if form is None or not any(name in active for name in node.output):
            nodes.append(node)
            continue
        writer = GraphWriter(f"{prefixes[index]}/training", opset)
        saved[node.name] = dict(form(NodeContext(node, writer, types, constants)))
        nodes.extend(writer.nodes)
        initializers.extend(writer.initializers)
    return nodes, saved


def _unique_prefixes(graph: onnx.GraphProto) -> list[str]:
    """A name per node (by position) to prefix what its rules write: its own where unique, else its operator and
    position."""
    counts: dict[str, int] = {}
    for node in graph.node:
        counts[node.name] = counts.get(node.name, 0) + 1
    return [node.name if node.name and counts[node.name] == 1 else f"/{node.op_type}_{index}"
            for index, node in enumerate(graph.node)]


def _name_outputs(backward: list[onnx.NodeProto], totals: Mapping[str, str]) -> None:
    """Give each wanted tensor's gradient its output name ``<name>_grad``: the backward node computing it writes it
    under that name (so that it is computed where the value is, not copied elsewhere: the B/W split keeps a
    BatchNorm's parameter gradients beside the sums its input gradient needs); a value no backward node computes
    (a seed), or one already named for another tensor, is copied."""
    produced = {name for node in backward for name in node.output}
    renames: dict[str, str] = {}
    for name, value in totals.items():
        final = gradient_name(name)
        if value in produced and value not in renames:
            renames[value] = final
        else:
            backward.append(helper.make_node("Identity", [renames.get(value, value)], [final], name=f"/grad/{final}"))
    for node in backward:
        for slots in (node.input, node.output):
            for index, name in enumerate(slots):
                if name in renames:
                    slots[index] = renames[name]


def _total(gradients: dict[str, list[str]], tensor: str, backward: list[onnx.NodeProto], opset: int) -> str | None:
    """The gradient of ``tensor``: its one contribution, or their sum (then recorded as the one contribution)."""
    parts = gradients.get(tensor)
    if not parts:
        return None
    if len(parts) > 1:
        total = f"{tensor}/grad_sum_{len(backward)}"
        backward.append(helper.make_node("Sum", list(parts), [total], name=total))
        gradients[tensor] = [total]
    return gradients[tensor][0]
