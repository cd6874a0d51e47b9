"""``edgert merge``: one ONNX model carrying a run's trained weights, ready to serve.

The run folder keeps the plan's source model and every stage's latest state. The merged
model is the source with every parameter and running statistic replaced by its trained
value, in inference form (inference_form.py: no Dropout, BatchNorm on the run's running
statistics), so the same input always gives the same output, that of the stages chained;
``training_form=True`` keeps the source's training-mode operators, for fine-tuning elsewhere.
Its metadata says how to use it (:data:`METADATA`): the loss, the run's data settings and
class names, which ``edgert evaluate`` and ``edgert predict`` read. Every stage file must hold
exactly its stage's tensors, as the manifest lists them: a file from another stage or another
plan is refused, never merged in part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from edgert.checkpoint import CHECKPOINT_NAME, load_checkpoint_info
from edgert.errors import EdgertError
from edgert.exporter.errors import ExportError
from edgert.exporter.inference_form import InferenceChanges, to_inference_form
from edgert.exporter.normalise import separate_deduplicated
from edgert.exporter.source import load_plan_source
from edgert.manifest import MANIFEST_NAME, Manifest, StageEntry, load_manifest
from edgert.models.data_settings import DATA_FILE, read_data_record
from edgert.weights import load_state

PLAN_FOLDER = "plan"  # a run folder's copy of its plan (edgert train writes it)
# the merged model's metadata_props (docs/EXPORTER.md, "edgert merge"), beside the source model's own
METADATA = {
    "trained_steps": "edgert.trained_steps",  # optimizer steps in the checkpoint merged
    "form": "edgert.form",  # inference or training
    "loss": "edgert.loss",  # the plan's loss: what edgert evaluate scores
    "data": "edgert.data",  # JSON: the run's data settings (source, seed, label_column, test_fraction)
    "classes": "edgert.classes",  # JSON: the class names, where the run's data gave them
}


@dataclass(frozen=True)
class MergeResult:
    """What ``merge_run`` wrote: the trained tensors put in, the step they are of, the operators made inference."""

    replaced: int
    step: int
    inference: InferenceChanges | None  # None: the training form was kept


def merge_run(run_dir: str | Path, out_path: str | Path, checkpoint: str = "latest",
              training_form: bool = False) -> MergeResult:
    """Write ``out_path`` from ``run_dir``'s checkpoint, in inference form unless ``training_form``."""
    run_dir, out_path = Path(run_dir), Path(out_path)
    if not out_path.parent.is_dir():
        raise ExportError(f"{out_path}: no folder {out_path.parent} to write the merged model in")
    plan = _plan_folder(run_dir)
    manifest = load_manifest(plan, verify=False)
    source = load_plan_source(plan, manifest.source_sha256)
    folder = run_dir / "checkpoints" / checkpoint
    if not (folder / CHECKPOINT_NAME).is_file():
        raise ExportError(f"{run_dir}: no checkpoint {checkpoint!r} (the run saves one after each epoch)")
    step = load_checkpoint_info(folder).step
    values: dict[str, np.ndarray] = {}
    for stage in manifest.stages:
        values.update(_stage_values(folder / f"stage{stage.index}.cbor", stage, manifest))
    model = source.model
    separate_deduplicated(model.graph)  # the normaliser's parameter names, which the stages train
    replaced = _replace_initializers(model, values)
    inference = None if training_form else to_inference_form(model.graph)
    _set_metadata(model, run_dir, manifest, step, training_form)
    onnx.checker.check_model(model)
    try:
        onnx.save(model, str(out_path))
    except OSError as error:
        raise ExportError(f"{out_path}: cannot write the merged model ({error.strerror or error})") from None
    return MergeResult(replaced, step, inference)


def _set_metadata(model: onnx.ModelProto, run_dir: Path, manifest: Manifest, step: int, training_form: bool) -> None:
    values = {"trained_steps": str(step + 1), "form": "training" if training_form else "inference",
              "loss": manifest.training.loss}
    if (run_dir / DATA_FILE).is_file():
        record = read_data_record(run_dir)
        values["data"] = json.dumps(record.settings.to_json())
        if record.classes is not None:
            values["classes"] = json.dumps(list(record.classes))
    keys = {METADATA[name] for name in values}
    kept = [prop for prop in model.metadata_props if prop.key not in keys]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for name, value in values.items():
        model.metadata_props.add(key=METADATA[name], value=value)


def _plan_folder(run_dir: Path) -> Path:
    plan = run_dir / PLAN_FOLDER
    if (plan / MANIFEST_NAME).is_file():
        return plan
    if (run_dir / MANIFEST_NAME).is_file():
        raise ExportError(f"{run_dir} is a plan folder; merge takes a run folder (the --out of `edgert train`), "
                          f"which holds {PLAN_FOLDER}/ and checkpoints/")
    raise ExportError(f"{run_dir}: not a run folder (no {PLAN_FOLDER}/{MANIFEST_NAME}); "
                      "give the --out folder of `edgert train`")


def _stage_values(path: Path, entry: StageEntry, manifest: Manifest) -> dict[str, np.ndarray]:
    """``path``'s tensors, refused unless they are exactly stage ``entry``'s, with the manifest's shapes."""
    try:
        parameters = load_state(path).parameters
    except EdgertError as error:
        raise ExportError(f"{path}: not a stage checkpoint of edgert ({error})") from None
    expected = {p.name: tuple(int(d) for d in p.shape) for p in entry.parameters}
    if parameters.keys() != expected.keys():
        raise ExportError(f"{path}: {_who_owns(parameters.keys(), entry, manifest)}")
    for name, value in parameters.items():
        if tuple(value.shape) != expected[name]:
            raise ExportError(f"{path}: {name} has shape {list(value.shape)}, but stage {entry.index} of the plan "
                              f"has {list(expected[name])} (a checkpoint of another model?)")
    return parameters


def _who_owns(names, entry: StageEntry, manifest: Manifest) -> str:
    """Why a stage file's tensor names are not stage ``entry``'s: another stage's, or unknown ones."""
    names = set(names)
    owners = [s.index for s in manifest.stages if names and names <= {p.name for p in s.parameters}]
    if owners and owners[0] != entry.index:
        return (f"holds stage {owners[0]}'s tensors, not stage {entry.index}'s (stage files swapped or "
                "copied from another run?)")
    expected = {p.name for p in entry.parameters}
    missing, unknown = sorted(expected - names), sorted(names - expected)
    parts = [f"lacks {len(missing)} of stage {entry.index}'s tensors ({', '.join(missing[:3])})"] if missing else []
    if unknown:
        parts.append(f"holds {len(unknown)} tensor(s) stage {entry.index} does not have ({', '.join(unknown[:3])})")
    return "; ".join(parts) + " (a checkpoint of another plan?)"


def _replace_initializers(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> int:
    by_name = {init.name: init for init in model.graph.initializer}
    missing = [name for name in values if name not in by_name]
    if missing:
        raise ExportError(f"the checkpoint has tensors the source model lacks: {', '.join(missing[:5])}")
    for name, value in values.items():
        original = by_name[name]
        original.CopyFrom(numpy_helper.from_array(value.astype(numpy_helper.to_array(original).dtype), name))
    return len(values)
