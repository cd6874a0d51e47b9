"""Splitting a stage's training graph for activation stashing (no recomputation).

By default a stage keeps only each in-flight micro-batch's inputs, and its backward call
recomputes the forward: little memory, but a non-last stage computes its forward twice.
With stashing, the forward returns, besides its outputs, every intermediate tensor the
backward needs (the *saved* tensors), and the backward graph takes them instead of
recomputing: about a quarter less compute per stage, for the memory of the saved tensors.

The split is exact: the forward nodes are those the forward's outputs (boundary outputs,
running statistics) need, none of which depends on the gradient seed or on the gradients
sent by the next stage; every other node is backward, including the helpers of the
gradient (a portable ConvGrad's window slices, say) that read only forward tensors, so
that the saved tensors are the forward's own activations. The two graphs together contain
every node of the training graph once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import onnx
from onnx import helper

from edgert.exporter.errors import ExportError
from edgert.exporter.loss import LOSS_SEED


@dataclass
class StashGraphs:
    """The forward that saves, the backward that reads, and the names of the saved tensors."""

    forward: onnx.ModelProto
    backward: onnx.ModelProto
    saved: list[str]


def split_for_stashing(training: onnx.ModelProto, gradient_inputs: set[str], forward_outputs: list[str]) -> StashGraphs:
    """Split a (non-accumulating) training graph into forward and backward halves.

    ``gradient_inputs`` are the graph inputs carrying the next stage's gradients;
    ``forward_outputs`` the outputs the forward must return (boundary outputs, running
    statistics). The backward keeps the training graph's other outputs.
    """
    graph = training.graph
    needed = _needed_for(graph, forward_outputs, {LOSS_SEED} | set(gradient_inputs))
    forward_nodes = [node for index, node in enumerate(graph.node) if index in needed]
    backward_nodes = [node for index, node in enumerate(graph.node) if index not in needed]
    tainted = {name for node in backward_nodes for name in node.output if name}
    produced_forward = [name for node in forward_nodes for name in node.output if name]
    needed_backward = {name for node in backward_nodes for name in node.input if name}
    graph_outputs = {o.name for o in graph.output}
    saved = [name for name in produced_forward if name in needed_backward or
             (name in graph_outputs and name not in forward_outputs and name not in tainted)]
    missing = [name for name in forward_outputs if name not in produced_forward
               and name not in {i.name for i in graph.input}]
    if missing:
        raise ExportError(f"{graph.name}: the forward half cannot produce {', '.join(missing[:3])}; cut elsewhere "
                          "(--cuts; `edgert inspect MODEL` lists the cuts)")
    forward = _half(training, forward_nodes, f"{graph.name}_forward",
                    outputs=list(dict.fromkeys([*forward_outputs, *saved])))
    backward = _half(training, backward_nodes, f"{graph.name}_backward",
                     outputs=[o.name for o in graph.output if o.name not in forward_outputs],
                     extra_inputs=_typed(forward, saved))
    return StashGraphs(forward=forward, backward=backward, saved=saved)


def _needed_for(graph: onnx.GraphProto, outputs: list[str], seeds: set[str]) -> set[int]:
    """The positions of the nodes the forward outputs need, among those that depend on no gradient seed."""
    tainted = set(seeds)
    for node in graph.node:
        if any(name in tainted for name in node.input if name):
            tainted.update(name for name in node.output if name)
    producers = {name: index for index, node in enumerate(graph.node) for name in node.output
                 if name and name not in tainted}
    needed: set[int] = set()
    pending = [name for name in outputs if name in producers]
    while pending:
        index = producers[pending.pop()]
        if index not in needed:
            needed.add(index)
            pending.extend(name for name in graph.node[index].input if name in producers)
    return needed


def _typed(forward: onnx.ModelProto, names: list[str]) -> list[onnx.ValueInfoProto]:
    """Value infos of the forward's outputs ``names``, typed as ORT infers them (com.microsoft ops included)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    try:
        session = onnxruntime.InferenceSession(forward.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - ORT raises many types; report them as one
        raise ExportError(f"{forward.graph.name}: ORT cannot load the stashing forward: {error}") from None
    types = {o.name: o for o in session.get_outputs()}
    infos = []
    for name in names:
        output = types[name]
        elem = _ELEM_TYPES.get(output.type)
        if elem is None:
            raise ExportError(f"{forward.graph.name}: saved tensor {name!r} has type {output.type}, not a tensor")
        dims = [d if isinstance(d, int) else (d if isinstance(d, str) else None) for d in output.shape]
        infos.append(helper.make_tensor_value_info(name, elem, dims))
    return infos


_ELEM_TYPES = {
    "tensor(float)": onnx.TensorProto.FLOAT, "tensor(float16)": onnx.TensorProto.FLOAT16,
    "tensor(double)": onnx.TensorProto.DOUBLE, "tensor(int64)": onnx.TensorProto.INT64,
    "tensor(int32)": onnx.TensorProto.INT32, "tensor(bool)": onnx.TensorProto.BOOL,
    "tensor(uint8)": onnx.TensorProto.UINT8, "tensor(int8)": onnx.TensorProto.INT8,
}


def _half(training: onnx.ModelProto, nodes: list[onnx.NodeProto], name: str, outputs: list[str],
          extra_inputs: list[onnx.ValueInfoProto] = ()) -> onnx.ModelProto:
    """A model of ``nodes`` taking what they use from the training graph's inputs (plus ``extra_inputs``)."""
    graph = training.graph
    used = {n for node in nodes for n in node.input if n} | set(outputs)
    inputs = [copy.deepcopy(i) for i in graph.input if i.name in used]
    inputs += list(extra_inputs)
    initializers = [i for i in graph.initializer if i.name in used]
    value_info = [v for v in graph.value_info if v.name in used]
    new_graph = helper.make_graph(list(nodes), name, inputs,
                                  [helper.make_empty_tensor_value_info(n) for n in outputs],
                                  initializer=initializers, value_info=value_info)
    model = helper.make_model(new_graph, opset_imports=list(training.opset_import), ir_version=training.ir_version)
    model.producer_name = "edgert"
    return model
