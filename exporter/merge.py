"""``edgert merge``: one ONNX inference model carrying a run's trained weights.

The run folder keeps the plan's source model and every stage's latest state. The merged
model is the source in inference form (BatchNorm on running statistics, Dropout as the
identity it is at inference) with every parameter and running statistic replaced by its
trained value. It runs in plain onnxruntime and matches the stages chained.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from edgert.checkpoint import CHECKPOINT_NAME, load_checkpoint_info
from edgert.exporter.errors import ExportError
from edgert.exporter.source import load_source_model
from edgert.manifest import load_manifest
from edgert.weights import load_state


def merge_run(run_dir: str | Path, out_path: str | Path, checkpoint: str = "latest") -> dict[str, int]:
    """Write ``out_path`` from ``run_dir``'s checkpoint; returns counts of what was replaced."""
    run_dir = Path(run_dir)
    plan = run_dir / "plan"
    manifest = load_manifest(plan, verify=False)
    source = load_source_model(plan / "source.onnx")
    if source.sha256 != manifest.source_sha256:
        raise ExportError(f"{plan / 'source.onnx'} is not the model the run's plan was cut from")
    folder = run_dir / "checkpoints" / checkpoint
    if not (folder / CHECKPOINT_NAME).is_file():
        raise ExportError(f"{run_dir}: no checkpoint {checkpoint!r} (the run saves one after each epoch)")
    info = load_checkpoint_info(folder)
    values: dict[str, np.ndarray] = {}
    for stage in manifest.stages:
        values.update(load_state(folder / f"stage{stage.index}.cbor").parameters)
    model = source.model
    replaced = _replace_initializers(model, values)
    _inference_form(model)
    model.metadata_props.add(key="edgert.trained_steps", value=str(info.step + 1))
    onnx.checker.check_model(model)
    onnx.save(model, str(out_path))
    return {"replaced": replaced, "step": info.step}


def _replace_initializers(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> int:
    by_name = {init.name: init for init in model.graph.initializer}
    missing = [name for name in values if name not in by_name]
    if missing:
        raise ExportError(f"the checkpoint has tensors the source model lacks: {', '.join(missing[:5])}")
    for name, value in values.items():
        original = by_name[name]
        if tuple(original.dims) != value.shape:
            raise ExportError(f"{name}: checkpoint shape {list(value.shape)} != model shape {list(original.dims)}")
        original.CopyFrom(numpy_helper.from_array(value.astype(numpy_helper.to_array(original).dtype), name))
    return len(values)


def _inference_form(model: onnx.ModelProto) -> None:
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            for attribute in node.attribute:
                if attribute.name == "training_mode":
                    attribute.i = 0
            del node.output[1:]
