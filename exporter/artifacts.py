"""Turning a stage's forward graph into the graphs a worker trains it with (DESIGN.md, stage semantics).

Per stage, in ``stage<k>/``, every graph in standard ONNX operators that stock onnxruntime runs
on any board (edgert writes the gradients itself: exporter.gradients):
- ``backward.onnx``  forward + loss + backward: it returns the parameter gradients
  (``<param>_grad``), the gradients of the boundary inputs the previous stage needs as
  ``<input>__dinput``, the updated BatchNorm running statistics and, on the last stage, the loss
  and the prediction. A non-last stage's backward starts from the next stage's gradients
  themselves (its ``grad_<output>`` inputs). The worker runs it in a plain InferenceSession,
  which releases the GIL while it computes, so a worker keeps answering its peers during a long
  backward;
- ``forward_stash.onnx``, ``backward_stash.onnx`` (not on the last stage): the same graph
  split for activation stashing (exporter.stash): the forward also returns the tensors the
  backward needs, which then recomputes nothing;
- ``backward_input.onnx``, ``backward_weight.onnx`` and their ``backward_stash_`` twins (a stage
  after the first, where they hold): each backward split into what the pipeline waits for and
  the parameter gradients, computed once a step (exporter.weight_split);
- ``eval.onnx``      the forward in training form (batch statistics), run for the pipeline's
  forward pass, so that it matches the forward the backward recomputes;
- ``infer.onnx``     the forward in inference form (running statistics), parameters as
  inputs, for evaluation and merging;
- ``parameters.cbor`` the initial parameters and running statistics, in edgert's own state
  format (edgert.weights).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgert.exporter.errors import ExportError, GradientError
from edgert.exporter.gradients.builder import build_gradient_graph
from edgert.exporter.gradients.shapes import forward_types
from edgert.exporter.graph_walk import drop_unneeded
from edgert.exporter.loss import (
    LOSS_OUTPUT,
    LOSS_SEED,
    SCALED_LOSS_OUTPUT,
    add_gradient_inputs,
    add_real_loss,
)
from edgert.exporter.slice import StageGraph, value_info_of
from edgert.exporter.standard_ops import refuse_nonstandard
from edgert.exporter.stash import split_for_stashing
from edgert.exporter.weight_split import split_backward
from edgert.manifest import SPLIT_ROLES, BoundaryTensor, TrainingConfig
from edgert.weights import StageState, save_state

INPUT_GRADIENT_SUFFIX = "__dinput"
BACKWARD, EVAL, INFER, PARAMETERS = "backward", "eval", "infer", "parameters"
FORWARD_STASH, BACKWARD_STASH = "forward_stash", "backward_stash"
SPLITS = {BACKWARD: SPLIT_ROLES["recompute"], BACKWARD_STASH: SPLIT_ROLES["stash"]}  # backward -> (input, weight)
FILE_NAMES = {
    BACKWARD: "backward.onnx",
    FORWARD_STASH: "forward_stash.onnx",
    BACKWARD_STASH: "backward_stash.onnx",
    EVAL: "eval.onnx",
    INFER: "infer.onnx",
    PARAMETERS: "parameters.cbor",
    **{role: f"{role}.onnx" for halves in SPLITS.values() for role in halves},
}


@dataclass
class StageArtifacts:
    """The files written for one stage and the names its runtime needs."""

    index: int
    files: dict[str, Path]
    input_gradients: dict[str, str]
    output_gradients: dict[str, str]
    labels: tuple[BoundaryTensor, ...] = ()
    notes: list[str] = field(default_factory=list)
    saved: tuple[str, ...] = ()


def build_stage_artifacts(
    stage: StageGraph,
    config: TrainingConfig,
    out_dir: Path,
    gradient_outputs: list[BoundaryTensor],
    wants_input_gradients: set[str],
) -> StageArtifacts:
    """Write the stage's artifacts into ``out_dir``.

    ``gradient_outputs`` are the outputs the next stage sends gradients for (ignored on the
    last stage); ``wants_input_gradients`` are the inputs whose gradients the previous stage
    consumes.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {role: out_dir / name for role, name in FILE_NAMES.items()}
    base, labels, output_gradients = training_base(stage, config, gradient_outputs)
    types = forward_types(base)
    state_names = set(stage.parameters) | set(stage.buffers)
    move_initializers_to_inputs(base, state_names)
    requires_grad = set(stage.parameters) | (wants_input_gradients & {t.name for t in stage.inputs})
    forward_outputs = [t.name for t in stage.outputs] + list(stage.buffer_updates)
    if stage.is_last:
        base.graph.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), LOSS_SEED))
        seeds = {SCALED_LOSS_OUTPUT: LOSS_SEED}
    else:
        seeds = {output: gradient for output, gradient in output_gradients.items()}
    what = f"stage {stage.index}"
    built = build_gradient_graph(base, seeds, sorted(requires_grad), types, what, keep=forward_outputs)
    _refuse_unreached([name for name in built.without_gradient if name in stage.parameters], stage)
    full = built.model
    user_outputs = ([SCALED_LOSS_OUTPUT, LOSS_OUTPUT, stage.outputs[0].name] if stage.is_last else [])
    user_outputs += list(stage.buffer_updates)
    input_gradients = arrange_outputs(full, user_outputs, stage, requires_grad)
    refuse_nonstandard(full, f"{what} backward")
    backward = copy.deepcopy(full)
    drop_unneeded(backward.graph)
    backwards = {BACKWARD: backward}
    saved: tuple[str, ...] = ()
    if stage.is_last:
        del files[FORWARD_STASH], files[BACKWARD_STASH]
    else:
        halves = split_for_stashing(full, set(output_gradients.values()), forward_outputs)
        save_model(halves.forward, files[FORWARD_STASH])
        save_model(halves.backward, files[BACKWARD_STASH])
        saved = tuple(halves.saved)
        backwards[BACKWARD_STASH] = halves.backward
    save_model(backward, files[BACKWARD])
    for role, (input_role, weight_role) in SPLITS.items():
        split = split_backward(backwards[role], stage.parameters) if role in backwards else None
        if split is None or split.input is None:  # a first stage's pipeline waits for none of its backward
            del files[input_role], files[weight_role]
            continue
        save_model(split.input, files[input_role])
        save_model(split.weight, files[weight_role])
    notes = write_forward_files(stage, files)
    return StageArtifacts(stage.index, files, input_gradients, output_gradients, labels, notes, saved)


def write_forward_files(stage: StageGraph, files: dict[str, Path]) -> list[str]:
    """Write the stage's ``eval.onnx``, ``infer.onnx`` and ``parameters.cbor`` to ``files``; return notes."""
    state_names = set(stage.parameters) | set(stage.buffers)
    save_model(_eval_model(stage, state_names), files[EVAL])
    save_model(_infer_model(stage, state_names), files[INFER])
    trainable_inits, buffer_inits = state_tensors(stage)
    initial = {init.name: numpy_helper.to_array(init) for init in (*trainable_inits, *buffer_inits)}
    save_state(StageState(parameters=initial, stage=stage.index), files[PARAMETERS])
    return [] if trainable_inits else ["no trainable parameters"]


def training_base(
    stage: StageGraph, config: TrainingConfig, gradient_outputs: list[BoundaryTensor], vjp_loss: bool = False
) -> tuple[onnx.ModelProto, tuple[BoundaryTensor, ...], dict[str, str]]:
    """The stage's forward with what training adds: the real loss on the last stage; on the others an input
    ``grad_<output>`` per output the next stage sends gradients for (and with ``vjp_loss`` the VJP loss over them,
    for a gradient builder that needs a scalar loss: the training build's)."""
    model = copy.deepcopy(stage.model)
    del model.graph.output[:]
    if stage.is_last:
        labels = add_real_loss(model, config.loss, stage.outputs[0])
        outputs = [SCALED_LOSS_OUTPUT, LOSS_OUTPUT, stage.outputs[0].name]
        gradients: dict[str, str] = {}
        result_labels: tuple[BoundaryTensor, ...] = (labels,)
    else:
        gradients = add_gradient_inputs(model, gradient_outputs, with_loss=vjp_loss)
        outputs = [SCALED_LOSS_OUTPUT] if vjp_loss else []
        result_labels = ()
    outputs += list(stage.buffer_updates)
    model.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in outputs)
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except onnx.shape_inference.InferenceError as error:
        raise ExportError(f"stage {stage.index}: shape inference of the training graph failed: {error}") from None
    return model, result_labels, gradients


def _refuse_unreached(parameters: list[str], stage: StageGraph) -> None:
    if parameters:
        name = parameters[0]
        raise GradientError(f"stage {stage.index}: parameter {name!r} does not reach the loss through differentiable "
                            f"ops (unused, or used only as an index or shape); freeze it with --frozen {name}")


def move_initializers_to_inputs(model: onnx.ModelProto, names: set[str]) -> None:
    """Parameters and running statistics become graph inputs, fed by ORT from the checkpoint."""
    kept = []
    for init in model.graph.initializer:
        if init.name in names:
            model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, init.dims))
        else:
            kept.append(init)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def state_tensors(stage: StageGraph) -> tuple[list[onnx.TensorProto], list[onnx.TensorProto]]:
    by_name = {init.name: init for init in stage.model.graph.initializer}
    return [by_name[p] for p in stage.parameters], [by_name[b] for b in stage.buffers]


def arrange_outputs(
    model: onnx.ModelProto, user_outputs: list[str], stage: StageGraph, requires_grad: set[str]
) -> dict[str, str]:
    """Order outputs as [user outputs, parameter gradients] and expose input gradients."""
    produced = {o.name: o for o in model.graph.output}
    ordered = [produced[name] for name in user_outputs]
    ordered += [produced[f"{i.name}_grad"] for i in model.graph.input if i.name in stage.parameters]
    input_gradients = {}
    for tensor in stage.inputs:
        gradient = f"{tensor.name}_grad"
        if tensor.name not in requires_grad or gradient not in produced:
            continue
        exposed = f"{tensor.name}{INPUT_GRADIENT_SUFFIX}"
        model.graph.node.append(helper.make_node("Identity", [gradient], [exposed], name=f"/expose/{exposed}"))
        ordered.append(value_info_of(BoundaryTensor(exposed, tensor.dtype, tensor.shape)))
        input_gradients[tensor.name] = exposed
    del model.graph.output[:]
    model.graph.output.extend(ordered)
    return input_gradients


def _eval_model(stage: StageGraph, state_names: set[str]) -> onnx.ModelProto:
    """The forward with batch statistics, leaving the running statistics alone.

    ORT's training-mode BatchNormalization updates its running-statistic inputs in place.
    The running statistics must move once per micro-batch, in the backward; so here each
    BatchNorm reads a private copy of them, local to this graph.
    """
    model = copy.deepcopy(stage.model)
    initializers = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            for slot in (3, 4):
                private = copy.deepcopy(initializers[node.input[slot]])
                private.name = f"{node.input[slot]}.forward_copy"
                model.graph.initializer.append(private)
                node.input[slot] = private.name
    # The Module feeds every state tensor to the eval model, so the originals stay inputs (unused).
    move_initializers_to_inputs(model, state_names)
    return model


def _infer_model(stage: StageGraph, state_names: set[str]) -> onnx.ModelProto:
    """The forward with inference-mode normalisation: running statistics, no stat outputs."""
    model = copy.deepcopy(stage.model)
    move_initializers_to_inputs(model, state_names)
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            for attribute in node.attribute:
                if attribute.name == "training_mode":
                    attribute.i = 0
            del node.output[1:]
    return model


def save_model(model: onnx.ModelProto, path: Path) -> None:
    onnx.save(model, str(path))
