"""Put a model into the form ORT's gradient builder and the stage runtime need.

Models exported by others rarely come in training form. This module:
- names every node uniquely (cuts and errors refer to node names);
- turns ``Constant`` nodes into initializers (constants may be copied into any stage);
- gives every initializer that an exporter merged into another because their values were
  equal (an ``Identity`` of an initializer) its own copy again: they are separate parameters;
- unrolls ``RNN``/``GRU``/``LSTM`` into standard operators (exporter.recurrent), whose
  gradients every onnxruntime build runs;
- removes ``Dropout`` (a stage's backward recomputes its forward, so the forward must be
  deterministic), and refuses any other operator that draws random numbers;
- sets ``BatchNormalization`` to ``training_mode=1`` with its running-stat outputs, which
  the runtime copies back into the running statistics after each micro-batch;
- gives ``LayerNormalization`` its ``Mean`` and ``InvStdDev`` outputs;
- decides which initializers are trainable parameters, which are running statistics
  (buffers), and which are constants;
- computes what depends on constants alone (a causal mask, a frozen scale) into
  initializers, which any stage may copy, instead of a tensor one stage sends another;
- infers shapes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgert.exporter.errors import ModelLoadError
from edgert.exporter.recurrent import unroll_recurrent
from edgert.exporter.source import SourceModel

FROZEN_METADATA = "edgert.frozen"  # model (and manifest) metadata: initializers not to train, comma-separated
FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
_RANDOM_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial"}
# Inputs (by position) that carry no gradient even when they hold float values.
_NON_DIFFERENTIABLE_INPUTS = {
    "Clip": {1, 2},
    "Pad": {1, 2},
    "Resize": {1, 2, 3},
    "BatchNormalization": {3, 4},
    "Dropout": {1, 2},
}


@dataclass
class TrainableGraph:
    """A normalised model plus what each initializer is for."""

    model: onnx.ModelProto
    parameters: list[str]
    buffers: list[str]
    # output tensor of a BatchNormalization -> the running statistic it updates
    buffer_updates: dict[str, str]
    notes: list[str] = field(default_factory=list)
    frozen: tuple[str, ...] = ()  # initializers not trained: --frozen, then the model's edgert.frozen metadata

    @property
    def graph(self) -> onnx.GraphProto:
        return self.model.graph


def normalise(source: SourceModel, frozen: tuple[str, ...] = ()) -> TrainableGraph:
    """Return a normalised copy of ``source.model``; ``frozen`` initializers are not trained.

    Initializers listed in the model's ``edgert.frozen`` metadata are frozen too.
    """
    model = onnx.ModelProto()
    model.CopyFrom(source.model)
    notes = list(source.notes)
    by_metadata = _frozen_by_metadata(model)
    _name_nodes(model.graph)
    constants = _constants_to_initializers(model.graph)
    notes += separate_deduplicated(model.graph, constants)
    notes += unroll_recurrent(model)
    notes += remove_dropout(model.graph)
    _refuse_random(model.graph)
    notes += _folded_batchnorm_note(model.graph)
    buffer_updates = _batchnorm_training_form(model.graph)
    _layernorm_training_form(model.graph)
    _check_frozen(model.graph, tuple(frozen), "--frozen")
    _check_frozen(model.graph, by_metadata, f"{source.path}: the model's {FROZEN_METADATA} metadata")
    frozen = tuple(dict.fromkeys(tuple(frozen) + by_metadata))
    parameters, buffers = _classify_initializers(model.graph, constants, set(frozen), buffer_updates)
    if not parameters:
        raise ModelLoadError("the model has no trainable parameters (no float initializers)")
    _fold_constants(model, set(parameters) | set(buffers))
    model = _infer_shapes(model)
    return TrainableGraph(model, parameters, buffers, buffer_updates, notes, frozen)


def frozen_in(metadata: Mapping[str, str]) -> tuple[str, ...]:
    """The initializers a model's (or a plan manifest's) metadata lists as not trained."""
    return tuple(name for name in metadata.get(FROZEN_METADATA, "").split(",") if name)


def _frozen_by_metadata(model: onnx.ModelProto) -> tuple[str, ...]:
    return frozen_in({prop.key: prop.value for prop in model.metadata_props})


def _name_nodes(graph: onnx.GraphProto) -> None:
    seen: set[str] = set()
    for index, node in enumerate(graph.node):
        base = node.name or f"/{node.op_type}_{index}"
        name, suffix = base, 1
        while name in seen:
            name, suffix = f"{base}_{suffix}", suffix + 1
        seen.add(name)
        node.name = name


def _constants_to_initializers(graph: onnx.GraphProto) -> set[str]:
    constants: set[str] = set()
    kept = []
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            kept.append(node)
            continue
        tensor = _constant_value(node)
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        constants.add(tensor.name)
    del graph.node[:]
    graph.node.extend(kept)
    return constants


def separate_deduplicated(graph: onnx.GraphProto, constants: set[str] | None = None) -> list[str]:
    """Replace each ``Identity`` of an initializer by an initializer of its own holding the same value.

    ``torch.onnx.export`` with constant folding keeps one of several equal-valued parameters
    (zero biases, copied layers) and reads the others through ``Identity``; trained tied, they
    would stay equal. ``constants`` (names not to train) gains the copies of constants.
    """
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    graph_outputs = {output.name for output in graph.output}
    kept, separated = [], []
    for node in graph.node:  # nodes are in topological order: a chain of Identity nodes resolves link by link
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx") or node.input[0] not in initializers \
                or node.output[0] in graph_outputs or node.output[0] in initializers:
            kept.append(node)
            continue
        copy = onnx.TensorProto()
        copy.CopyFrom(initializers[node.input[0]])
        copy.name = node.output[0]
        graph.initializer.append(copy)
        initializers[copy.name] = copy
        if constants is not None and node.input[0] in constants:
            constants.add(copy.name)
        separated.append(copy.name)
    if not separated:
        return []
    del graph.node[:]
    graph.node.extend(kept)
    shown = ", ".join(separated[:3]) + (", ..." if len(separated) > 3 else "")
    return [f"{len(separated)} initializer(s) the exporter had merged with an equal one ({shown}) "
            "became separate initializers again: they train as separate parameters"]


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto:
    attribute = node.attribute[0]
    value = helper.get_attribute_value(attribute)
    if attribute.name == "value":
        return value
    dtypes = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    if attribute.name in dtypes:
        return numpy_helper.from_array(np.asarray(value, dtype=dtypes[attribute.name]))
    raise ModelLoadError(f"node {node.name!r}: Constant with attribute {attribute.name!r} is not supported")


def remove_dropout(graph: onnx.GraphProto) -> list[str]:
    """Remove every ``Dropout`` (the identity at inference; its mask must be unused), rewiring its readers."""
    dropouts = [n for n in graph.node if n.op_type == "Dropout"]
    if not dropouts:
        return []
    rename = {}
    for node in dropouts:
        if len(node.output) > 1 and node.output[1] and _is_used(graph, node.output[1]):
            raise ModelLoadError(f"node {node.name!r}: the Dropout mask output is used; edgert cannot remove it")
        rename[node.output[0]] = rename.get(node.input[0], node.input[0])  # Dropout after Dropout: to the first's
        graph.node.remove(node)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    for output in graph.output:
        if output.name in rename:
            graph.node.append(helper.make_node("Identity", [rename[output.name]], [output.name],
                                               name=f"/{output.name}/Identity"))
    return [f"removed {len(dropouts)} Dropout node(s): stage recomputation needs a deterministic forward"]


def _refuse_random(graph: onnx.GraphProto) -> None:
    """A node drawing random numbers (stochastic depth, a dropout written by hand) makes the forward differ between
    a stage's forward call and the backward call that recomputes it."""
    for node in graph.node:
        if node.op_type in _RANDOM_OPS:
            raise ModelLoadError(
                f"node {node.name!r} ({node.op_type}) draws random numbers on every run (stochastic depth, or a "
                "dropout written by hand): a stage's backward recomputes its forward and must see the same numbers; "
                "export with that layer's drop probability at 0 (torchvision: stochastic_depth_prob=0.0, timm: "
                "drop_path_rate=0.0) or with the layer in eval mode")


def _is_used(graph: onnx.GraphProto, name: str) -> bool:
    return any(name in n.input for n in graph.node) or any(o.name == name for o in graph.output)


def _folded_batchnorm_note(graph: onnx.GraphProto) -> list[str]:
    """Say so when BatchNorm looks folded into convolutions (torch names the folded weights ``onnx::Conv_*``)."""
    if any(node.op_type == "BatchNormalization" for node in graph.node):
        return []
    folded = [node.input[1] for node in graph.node
              if node.op_type == "Conv" and len(node.input) > 1 and node.input[1].startswith("onnx::Conv_")]
    if not folded:
        return []
    return [f"{len(folded)} convolution(s) read weights named onnx::Conv_*, as an eval-mode export writes when it "
            "folds BatchNorm into them: they train as plain convolutions, without batch statistics; to train "
            "BatchNorm, export with training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False "
            "(docs/EXPORTER.md)"]


def _batchnorm_training_form(graph: onnx.GraphProto) -> dict[str, str]:
    updates = {}
    for node in graph.node:
        if node.op_type != "BatchNormalization":
            continue
        _set_int_attribute(node, "training_mode", 1)
        outputs = list(node.output) + [""] * (3 - len(node.output))
        for slot, stat in ((1, node.input[3]), (2, node.input[4])):
            if not outputs[slot]:
                outputs[slot] = f"{stat}.updated"
            updates[outputs[slot]] = stat
        del node.output[:]
        node.output.extend(outputs)
    return updates


def _layernorm_training_form(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        if node.op_type != "LayerNormalization":
            continue
        outputs = list(node.output) + [""] * (3 - len(node.output))
        outputs[1] = outputs[1] or f"{node.name}/Mean"
        outputs[2] = outputs[2] or f"{node.name}/InvStdDev"
        del node.output[:]
        node.output.extend(outputs)


def _set_int_attribute(node: onnx.NodeProto, name: str, value: int) -> None:
    for attribute in node.attribute:
        if attribute.name == name:
            attribute.i = value
            return
    node.attribute.append(helper.make_attribute(name, value))


def _check_frozen(graph: onnx.GraphProto, frozen: tuple[str, ...], origin: str) -> None:
    names = {i.name for i in graph.initializer}
    unknown = [f for f in frozen if f not in names]
    if unknown:
        raise ModelLoadError(f"{origin} names no initializer: {', '.join(unknown)}")


def _classify_initializers(
    graph: onnx.GraphProto, constants: set[str], frozen: set[str], buffer_updates: dict[str, str]
) -> tuple[list[str], list[str]]:
    buffers = set(buffer_updates.values())
    differentiable_uses: Counter[str] = Counter()
    for node in graph.node:
        skip = _NON_DIFFERENTIABLE_INPUTS.get(node.op_type, set())
        for position, name in enumerate(node.input):
            if position not in skip:
                differentiable_uses[name] += 1
    parameters = []
    for tensor in graph.initializer:
        name = tensor.name
        if name in constants or name in frozen or name in buffers:
            continue
        if tensor.data_type in FLOAT_TYPES and int(np.prod(tensor.dims)) > 1 and differentiable_uses[name]:
            parameters.append(name)
    return parameters, [b for b in (i.name for i in graph.initializer) if b in buffers]


def _fold_constants(model: onnx.ModelProto, state: set[str]) -> None:
    """Replace nodes that read only constant initializers by initializers holding their outputs.

    ``state`` (parameters and running statistics) and the graph inputs vary; a node with no
    inputs, a random one, or one with a sub-graph (If, Loop) varies too. Left as it is when the
    reference evaluator cannot run it.
    """
    graph = model.graph
    folded, kept = split_constant_nodes(graph, state, _foldable)
    if not folded:
        return
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    produced = {name for node in folded for name in node.output if name}
    needed = [name for name in dict.fromkeys(n for node in kept for n in node.input)
              if name in produced] + [o.name for o in graph.output if o.name in produced]
    try:
        values = _evaluate(model, folded, initializers, needed)
    except Exception:  # any failure keeps the nodes: still correct, only the cuts they would cross are illegal
        return
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(numpy_helper.from_array(np.asarray(value), name) for name, value in zip(needed, values))


def split_constant_nodes(
    graph: onnx.GraphProto, state: set[str], counts: Callable[[onnx.NodeProto], bool] = lambda node: True
) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """``graph``'s nodes in two lists: those computed from constant initializers alone, and the others.

    ``state`` (parameters, running statistics) and the data inputs vary, and so does whatever a
    node without inputs, or one ``counts`` rejects, computes from anything.
    """
    initializers = {tensor.name for tensor in graph.initializer}
    varying = {i.name for i in graph.input if i.name not in initializers} | state
    constant, others = [], []
    for node in graph.node:
        if node.input and not any(name in varying for name in node.input if name) and counts(node):
            constant.append(node)
        else:
            others.append(node)
            varying |= set(node.output)
    return constant, others


def _foldable(node: onnx.NodeProto) -> bool:
    """A standard, deterministic operator whose inputs are all it reads (no sub-graph sees outer tensors)."""
    return node.domain in ("", "ai.onnx") and node.op_type not in _RANDOM_OPS and not any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def _evaluate(model: onnx.ModelProto, nodes: list[onnx.NodeProto], initializers: dict[str, onnx.TensorProto],
              outputs: list[str]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    used = {name for node in nodes for name in node.input}
    sub = helper.make_graph(nodes, "constants", [], [helper.make_empty_tensor_value_info(n) for n in outputs],
                            [tensor for name, tensor in initializers.items() if name in used])
    return ReferenceEvaluator(helper.make_model(sub, opset_imports=list(model.opset_import))).run(outputs, {})


def _infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as error:
        first = str(error).strip().splitlines()[0]
        raise ModelLoadError(f"shape inference failed: {first}") from None
