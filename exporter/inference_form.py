"""A model's graph in the form it takes to serve: what trains differently from how it predicts, made inference.

Two standard operators behave differently while training: ``Dropout`` (random masks when its
``training_mode`` input is true, the identity otherwise) and ``BatchNormalization``
(``training_mode=1``: batch statistics, and it updates the running ones). A model exported in
training mode (docs/EXPORTER.md recommends it) keeps both in their training form; served so,
the same input gives another output each time. :func:`to_inference_form` removes every Dropout
and sets every BatchNormalization to its running statistics, so a merged model is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from edgert.exporter.errors import ExportError
from edgert.exporter.normalise import remove_dropout


@dataclass(frozen=True)
class InferenceChanges:
    """What :func:`to_inference_form` changed: Dropouts removed, BatchNormalizations put on running statistics."""

    dropouts: int
    batchnorms: int


def to_inference_form(graph: onnx.GraphProto) -> InferenceChanges:
    """Remove ``graph``'s Dropouts (with the ratio and mode constants only they read) and set its
    BatchNormalizations to ``training_mode=0`` with their one output."""
    dropout_inputs = {name for node in graph.node if node.op_type == "Dropout" for name in node.input[1:] if name}
    dropouts = sum(node.op_type == "Dropout" for node in graph.node)
    remove_dropout(graph)
    _drop_unused_constants(graph, dropout_inputs)
    batchnorms = [node for node in graph.node if node.op_type == "BatchNormalization"]
    used = _used_names(graph)
    for node in batchnorms:
        _batchnorm_inference_form(node, used)
    return InferenceChanges(dropouts, len(batchnorms))


def _batchnorm_inference_form(node: onnx.NodeProto, used: set[str]) -> None:
    read = [name for name in node.output[1:] if name and name in used]
    if read:
        raise ExportError(f"node {node.name!r}: BatchNormalization's running-statistic output {read[0]} is read by "
                          "the model, which its inference form does not have; merge with --training-form")
    for attribute in node.attribute:
        if attribute.name == "training_mode":
            attribute.i = 0
    del node.output[1:]


def _drop_unused_constants(graph: onnx.GraphProto, names: set[str]) -> None:
    """Of ``names``, the initializers and ``Constant`` nodes nothing reads any more go."""
    used = _used_names(graph)
    unused = names - used
    kept = [tensor for tensor in graph.initializer if tensor.name not in unused]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)
    constants = [node for node in graph.node if node.op_type == "Constant" and set(node.output) <= unused]
    for node in constants:
        graph.node.remove(node)


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a node of ``graph`` or of its sub-graphs reads, and ``graph``'s outputs."""
    used = {output.name for output in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attribute in node.attribute:
            for body in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                used |= _used_names(body)
    return used
