"""The ONNX Runtime training build as an oracle: a plan's stages differentiated by its gradient builder.

edgert writes every gradient itself (exporter.gradients), so the training build
(``onnxruntime-training-cpu`` 1.19.2: x86-64, CPython 3.11/3.12, its last release) is on no
user's path. Where it is installed (``pip install -e ".[reference]"``, never beside stock
onnxruntime) it is a second opinion: :func:`reference_plan` writes a plan with the same cuts
whose backward graphs are the training build's own, with its training operators
(``ConvGrad``, ``BatchNormalizationGrad``...), and ``training.onnx``, ``checkpoint.ckpt`` and
``optimizer.onnx`` for ORT's own training API. ``edgert check --reference training-build``,
CI's oracle step and the benchmarks' baselines use it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import onnx

from edgert.exporter.artifacts import (
    BACKWARD,
    BACKWARD_STASH,
    EVAL,
    FORWARD_STASH,
    INFER,
    PARAMETERS,
    StageArtifacts,
    arrange_outputs,
    move_initializers_to_inputs,
    save_model,
    state_tensors,
    training_base,
    write_forward_files,
)
from edgert.exporter.errors import ExportError, GradientError
from edgert.exporter.export import ExportOptions, Progress, prepare_analysis, write_plan
from edgert.exporter.graph_walk import drop_unneeded
from edgert.exporter.loss import LOSS_OUTPUT, SCALED_LOSS_OUTPUT
from edgert.exporter.normalise import frozen_in
from edgert.exporter.ort_training import gradient_graph, onnxblock, training_graph_utils
from edgert.exporter.slice import StageGraph
from edgert.exporter.source import load_plan_source
from edgert.exporter.stash import split_for_stashing
from edgert.manifest import BoundaryTensor, Manifest, TrainingConfig, load_manifest

TRAINING, OPTIMIZER, CHECKPOINT = "training", "optimizer", "checkpoint"
REFERENCE_FILES = {
    BACKWARD: "backward.onnx", FORWARD_STASH: "forward_stash.onnx", BACKWARD_STASH: "backward_stash.onnx",
    EVAL: "eval.onnx", INFER: "infer.onnx", PARAMETERS: "parameters.cbor",
    TRAINING: "training.onnx", OPTIMIZER: "optimizer.onnx", CHECKPOINT: "checkpoint.ckpt",
}


def reference_plan(plan_dir: str | Path, out_dir: str | Path, progress: Progress = lambda _: None) -> Manifest:
    """The plan at ``plan_dir`` written again into ``out_dir`` (same cuts) with the training build's gradients."""
    plan_dir = Path(plan_dir)
    manifest = load_manifest(plan_dir)
    source = load_plan_source(plan_dir, manifest.source_sha256)
    analysis = prepare_analysis(source, ExportOptions(frozen=frozen_in(manifest.metadata)))
    names = tuple(block.name for block in analysis.blocks)
    if names != manifest.blocks:
        raise ExportError(f"{plan_dir}: its blocks ({len(manifest.blocks)}) are not the ones edgert finds in its "
                          f"source model ({len(names)}) with default options; export the plan again")
    starts = {name: index for index, name in enumerate(names)}
    cuts = [starts[stage.blocks[0]] for stage in manifest.stages[1:]]
    return write_plan(source, analysis, cuts, Path(out_dir), manifest.training, progress,
                      stage_builder=build_reference_stage)


def build_reference_stage(stage: StageGraph, config: TrainingConfig, out_dir: Path,
                          gradient_outputs: list[BoundaryTensor], wants_input_gradients: set[str]) -> StageArtifacts:
    """One stage's files, its backward graphs written by the training build's gradient builder (module docstring)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {role: out_dir / name for role, name in REFERENCE_FILES.items()}
    base, labels, output_gradients = training_base(stage, config, gradient_outputs, vjp_loss=True)
    move_initializers_to_inputs(base, set(stage.parameters) | set(stage.buffers))
    requires_grad = set(stage.parameters) | (wants_input_gradients & {t.name for t in stage.inputs})
    try:
        full = gradient_graph(base, SCALED_LOSS_OUTPUT, requires_grad)
    except RuntimeError as error:
        raise GradientError(f"stage {stage.index}: the training build cannot differentiate it: "
                            f"{_last_line(str(error))}") from None
    user_outputs = [SCALED_LOSS_OUTPUT] + ([LOSS_OUTPUT, stage.outputs[0].name] if stage.is_last else [])
    user_outputs += list(stage.buffer_updates)
    input_gradients = arrange_outputs(full, user_outputs, stage, requires_grad)
    training = copy.deepcopy(full)
    backward = _without_loss_output(full) if not stage.is_last else full
    saved: tuple[str, ...] = ()
    if stage.is_last:
        del files[FORWARD_STASH], files[BACKWARD_STASH]
    else:
        forward_outputs = [t.name for t in stage.outputs] + list(stage.buffer_updates)
        halves = split_for_stashing(_without_loss_output(full, keep=forward_outputs), set(output_gradients.values()),
                                    forward_outputs)
        save_model(halves.forward, files[FORWARD_STASH])
        save_model(halves.backward, files[BACKWARD_STASH])
        saved = tuple(halves.saved)
    save_model(backward, files[BACKWARD])
    training_graph_utils().build_gradient_accumulation_graph(training, set(stage.parameters))
    save_model(training, files[TRAINING])
    trainable, buffers = state_tensors(stage)
    notes = write_forward_files(stage, files)
    if not trainable or not _write_optimizer(config, trainable, files[OPTIMIZER], stage.model):
        del files[OPTIMIZER]
    onnxblock().save_checkpoint((trainable, buffers), str(files[CHECKPOINT]))
    return StageArtifacts(stage.index, files, input_gradients, output_gradients, labels, notes, saved)


def _without_loss_output(model: onnx.ModelProto, keep: list[str] = ()) -> onnx.ModelProto:
    """A non-last stage's graph without the VJP loss's value (the runtime never reads it) and what only it needed."""
    result = copy.deepcopy(model)
    kept = [o for o in result.graph.output if o.name != SCALED_LOSS_OUTPUT]
    del result.graph.output[:]
    result.graph.output.extend(kept)
    drop_unneeded(result.graph, keep)
    return result


def _write_optimizer(config: TrainingConfig, params: list[onnx.TensorProto], path: Path,
                     base: onnx.ModelProto) -> bool:
    """ORT's optimizer graph (AdamW, or plain SGD: ORT's has no momentum or weight decay, then none is written)."""
    blocks = onnxblock()
    opset = next(o.version for o in base.opset_import if o.domain in ("", "ai.onnx"))
    if config.optimizer == "adamw":
        optimizer = blocks.optim.AdamW(betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay)
    elif config.weight_decay or config.momentum:
        return False
    else:
        optimizer = blocks.optim.SGD()
    with blocks.empty_base(opset_version=opset) as accessor:
        optimizer((params, []))
        model = accessor.model
    model.ir_version = base.ir_version
    save_model(model, path)
    return True


def _last_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else message)[:300]

