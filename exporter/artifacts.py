"""Turning a stage's forward graph into ORT Training artifacts (DESIGN.md, stage semantics).

Per stage, in ``stage<k>/``:
- ``training.onnx``  forward + loss + backward in ORT's Module format, as the training build
  writes it: parameter gradients accumulate in ORT's buffers; ``d(loss)/d(input)`` is exposed
  as ``<input>__dinput`` (the Module API hides outputs ending in ``_grad``); BatchNorm running
  statistics come out as extra outputs. For ORT's own on-device training API (training
  build only) and as ``edgert check``'s reference for the portable graphs;
- ``backward.onnx``  the same graph without the accumulation buffers, made portable
  (exporter.portable: standard operators only, so stock onnxruntime runs it on any board):
  it returns the parameter gradients (``<param>_grad``); a non-last stage's starts from the
  next stage's gradients themselves, without the VJP loss (exporter.vjp_seed). The worker
  runs it in a plain InferenceSession, which releases the GIL while it computes, so a worker
  keeps answering its peers during a long backward;
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
- ``optimizer.onnx`` ORT's optimizer graph (AdamW, or plain SGD);
- ``parameters.cbor`` the initial parameters and running statistics, in edgert's own state
  format (edgert.weights), which the worker reads without the training build;
- ``checkpoint.ckpt`` the same, as an ORT checkpoint, for ``training.onnx`` and ORT's own API.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import helper, numpy_helper

from edgert.exporter.errors import ExportError, GradientError
from edgert.exporter.loss import (
    LOSS_OUTPUT,
    SCALED_LOSS_OUTPUT,
    add_real_loss,
    add_vjp_loss,
)
from edgert.exporter.ort_training import gradient_graph, onnxblock, training_graph_utils
from edgert.exporter.portable import make_portable, tensor_types
from edgert.exporter.slice import StageGraph, value_info_of
from edgert.exporter.stash import split_for_stashing
from edgert.exporter.vjp_seed import seed_from_gradients
from edgert.exporter.weight_split import split_backward
from edgert.manifest import SPLIT_ROLES, BoundaryTensor, TrainingConfig
from edgert.weights import StageState, save_state

INPUT_GRADIENT_SUFFIX = "__dinput"
TRAINING, BACKWARD, EVAL, INFER = "training", "backward", "eval", "infer"
OPTIMIZER, CHECKPOINT, PARAMETERS = "optimizer", "checkpoint", "parameters"
FORWARD_STASH, BACKWARD_STASH = "forward_stash", "backward_stash"
SPLITS = {BACKWARD: SPLIT_ROLES["recompute"], BACKWARD_STASH: SPLIT_ROLES["stash"]}  # backward -> (input, weight)
FILE_NAMES = {
    TRAINING: "training.onnx",
    BACKWARD: "backward.onnx",
    FORWARD_STASH: "forward_stash.onnx",
    BACKWARD_STASH: "backward_stash.onnx",
    EVAL: "eval.onnx",
    INFER: "infer.onnx",
    OPTIMIZER: "optimizer.onnx",
    CHECKPOINT: "checkpoint.ckpt",
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
    portable: bool = True,
) -> StageArtifacts:
    """Write the stage's artifacts into ``out_dir``.

    ``gradient_outputs`` are the outputs the next stage sends gradients for (ignored on the
    last stage); ``wants_input_gradients`` are the inputs whose gradients the previous stage
    consumes. ``portable=False`` leaves the training build's operators in the backward graphs:
    the baseline of ``edgert bench portable``, runnable only where the training build is.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {role: out_dir / name for role, name in FILE_NAMES.items()}
    training, labels, output_gradients = _training_base(stage, config, gradient_outputs)
    state_names = set(stage.parameters) | set(stage.buffers)
    _move_initializers_to_inputs(training, state_names)
    trainable_inits, buffer_inits = _state_tensors(stage)
    requires_grad = set(stage.parameters) | (wants_input_gradients & {t.name for t in stage.inputs})
    gradient_model = _build_gradients(training, requires_grad, stage)
    user_outputs = [SCALED_LOSS_OUTPUT] + ([LOSS_OUTPUT, stage.outputs[0].name] if stage.is_last else [])
    user_outputs += list(stage.buffer_updates)
    input_gradients = _arrange_outputs(gradient_model, user_outputs, stage, requires_grad)
    if portable:
        forward_types = tensor_types(training)  # what onnx knows of the forward, before the training ops
        portable_model = make_portable(gradient_model, f"stage {stage.index} backward", forward_types)
    else:
        portable_model = gradient_model
    saved: tuple[str, ...] = ()
    backwards = {BACKWARD: portable_model}
    if stage.is_last:
        del files[FORWARD_STASH], files[BACKWARD_STASH]
    else:
        gradients = set(output_gradients.values())
        forward_outputs = [t.name for t in stage.outputs] + list(stage.buffer_updates)
        halves = split_for_stashing(seed_from_gradients(portable_model, gradients, keep=forward_outputs), gradients,
                                    forward_outputs)
        _save(halves.forward, files[FORWARD_STASH])
        _save(halves.backward, files[BACKWARD_STASH])
        saved = tuple(halves.saved)
        portable_model = backwards[BACKWARD] = seed_from_gradients(portable_model, gradients)
        backwards[BACKWARD_STASH] = halves.backward
    _save(portable_model, files[BACKWARD])
    for role, (input_role, weight_role) in SPLITS.items():
        split = split_backward(backwards[role], stage.parameters) if portable and role in backwards else None
        if split is None or split.input is None:  # a first stage's pipeline waits for none of its backward
            del files[input_role], files[weight_role]
            continue
        _save(split.input, files[input_role])
        _save(split.weight, files[weight_role])
    training_graph_utils().build_gradient_accumulation_graph(gradient_model, set(stage.parameters))
    _save(gradient_model, files[TRAINING])
    _save(_eval_model(stage, state_names), files[EVAL])
    _save(_infer_model(stage, state_names), files[INFER])
    notes = []
    if not trainable_inits:
        del files[OPTIMIZER]
        notes.append("no trainable parameters: no optimizer.onnx written")
    elif not _write_optimizer(config, trainable_inits, files[OPTIMIZER], stage.model):
        del files[OPTIMIZER]
        notes.append("ORT's SGD has no momentum or weight decay: no optimizer.onnx written (the runtime's is used)")
    onnxblock().save_checkpoint((trainable_inits, buffer_inits), str(files[CHECKPOINT]))
    initial = {init.name: numpy_helper.to_array(init) for init in (*trainable_inits, *buffer_inits)}
    save_state(StageState(parameters=initial, stage=stage.index), files[PARAMETERS])
    return StageArtifacts(stage.index, files, input_gradients, output_gradients, labels, notes, saved)


def _training_base(
    stage: StageGraph, config: TrainingConfig, gradient_outputs: list[BoundaryTensor]
) -> tuple[onnx.ModelProto, tuple[BoundaryTensor, ...], dict[str, str]]:
    model = copy.deepcopy(stage.model)
    del model.graph.output[:]
    if stage.is_last:
        labels = add_real_loss(model, config.loss, stage.outputs[0])
        outputs = [SCALED_LOSS_OUTPUT, LOSS_OUTPUT, stage.outputs[0].name]
        gradients: dict[str, str] = {}
        result_labels: tuple[BoundaryTensor, ...] = (labels,)
    else:
        gradients = add_vjp_loss(model, gradient_outputs)
        outputs = [SCALED_LOSS_OUTPUT]
        result_labels = ()
    outputs += list(stage.buffer_updates)
    model.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in outputs)
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except onnx.shape_inference.InferenceError as error:
        raise ExportError(f"stage {stage.index}: shape inference of the training graph failed: {error}") from None
    return model, result_labels, gradients


def _move_initializers_to_inputs(model: onnx.ModelProto, names: set[str]) -> None:
    """Parameters and running statistics become graph inputs, fed by ORT from the checkpoint."""
    kept = []
    for init in model.graph.initializer:
        if init.name in names:
            model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, init.dims))
        else:
            kept.append(init)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def _state_tensors(stage: StageGraph) -> tuple[list[onnx.TensorProto], list[onnx.TensorProto]]:
    by_name = {init.name: init for init in stage.model.graph.initializer}
    return [by_name[p] for p in stage.parameters], [by_name[b] for b in stage.buffers]


def _build_gradients(model: onnx.ModelProto, requires_grad: set[str], stage: StageGraph) -> onnx.ModelProto:
    try:
        return gradient_graph(model, SCALED_LOSS_OUTPUT, requires_grad)
    except RuntimeError as error:
        raise GradientError(_explain_gradient_failure(str(error), stage)) from None


def _explain_gradient_failure(message: str, stage: StageGraph) -> str:
    match = re.search(r"has not been registered: (\S+) for node (.+)", message)
    if match:
        op, node = match.group(1), match.group(2).strip()
        return (f"stage {stage.index}: ORT has no gradient for op {op} (node {node!r}); "
                f"move it out of the trained part of the model or replace it with a differentiable op")
    match = re.search(r"Cannot compute the partial derivative for '([^']+)'", message)
    if match:
        return (f"stage {stage.index}: parameter {match.group(1)!r} does not reach the loss through differentiable "
                f"ops (unused, or used only as an index or shape); freeze it with --frozen {match.group(1)}")
    return f"stage {stage.index}: ORT could not build the gradient graph: {_first_line(message)}"


def _first_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    text = lines[-1] if lines else message
    return text[:300]


def _arrange_outputs(
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
    _move_initializers_to_inputs(model, state_names)
    return model


def _infer_model(stage: StageGraph, state_names: set[str]) -> onnx.ModelProto:
    """The forward with inference-mode normalisation: running statistics, no stat outputs."""
    model = copy.deepcopy(stage.model)
    _move_initializers_to_inputs(model, state_names)
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            for attribute in node.attribute:
                if attribute.name == "training_mode":
                    attribute.i = 0
            del node.output[1:]
    return model


def _write_optimizer(
    config: TrainingConfig, params: list[onnx.TensorProto], path: Path, base: onnx.ModelProto
) -> bool:
    blocks = onnxblock()
    opset = next(o.version for o in base.opset_import if o.domain in ("", "ai.onnx"))
    if config.optimizer == "adamw":
        optimizer = blocks.optim.AdamW(betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay)
    elif config.optimizer == "sgd":
        if config.weight_decay or config.momentum:
            return False
        optimizer = blocks.optim.SGD()
    else:
        raise ExportError(f"unknown optimizer {config.optimizer!r}; choose adamw or sgd")
    with blocks.empty_base(opset_version=opset) as accessor:
        optimizer((params, []))
        model = accessor.model
    model.ir_version = base.ir_version
    _save(model, path)
    return True


def _save(model: onnx.ModelProto, path: Path) -> None:
    onnx.save(model, str(path))
