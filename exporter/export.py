"""``edgert export``: load, normalise, analyse, cut, slice, build artifacts, write the plan.

Stages are built from the last to the first, so each stage knows which of its outputs
the next stage sends gradients for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgert.exporter.analyse import ModelAnalysis, analyse
from edgert.exporter.artifacts import StageArtifacts, build_stage_artifacts
from edgert.exporter.cuts import balanced_cuts, resolve_cuts
from edgert.exporter.errors import ExportError
from edgert.exporter.normalise import FROZEN_METADATA, normalise
from edgert.exporter.slice import StageGraph, slice_stage, stage_ranges
from edgert.exporter.source import SOURCE_FILE, SourceModel, load_source_model
from edgert.manifest import (
    OPTIMIZERS,
    ArtifactFile,
    BoundaryTensor,
    Manifest,
    ParameterInfo,
    StageEntry,
    TrainingConfig,
    sha256_of,
    write_manifest,
)

Progress = Callable[[str], None]
StageBuilder = Callable[[StageGraph, TrainingConfig, Path, list, set], StageArtifacts]


@dataclass(frozen=True)
class ExportOptions:
    """What the user asked for: how to cut, and how to train."""

    stages: int | None = None
    cuts: tuple[str, ...] = ()
    output: str | None = None
    block_depth: int | None = None
    frozen: tuple[str, ...] = ()
    training: TrainingConfig = field(default_factory=TrainingConfig)
    split_backward: bool = False  # balance the cuts for edgert train --split-backward


def prepare_analysis(source: SourceModel, options: ExportOptions) -> ModelAnalysis:
    """Normalise and analyse a loaded model."""
    return analyse(normalise(source, options.frozen), options.output, options.block_depth)


def choose_cuts(analysis: ModelAnalysis, options: ExportOptions) -> list[int]:
    """Explicit cuts when given, else FLOP-balanced cuts for ``options.stages`` (default 1)."""
    if options.cuts:
        if options.stages is not None and options.stages != len(options.cuts) + 1:
            raise ExportError(f"--stages {options.stages} disagrees with {len(options.cuts)} explicit cut(s)")
        return resolve_cuts(analysis, list(options.cuts))
    return balanced_cuts(analysis, 1 if options.stages is None else options.stages, options.split_backward)


def export_plan(
    model_path: str | Path, out_dir: str | Path, options: ExportOptions, progress: Progress = lambda _: None
) -> Manifest:
    """Export ``model_path`` into the plan folder ``out_dir`` and return its manifest."""
    source = load_source_model(model_path)
    analysis = prepare_analysis(source, options)
    for note in analysis.trainable.notes:
        progress(note)
    cuts = choose_cuts(analysis, options)
    return write_plan(source, analysis, cuts, Path(out_dir), options.training, progress)


def write_plan(
    source: SourceModel,
    analysis: ModelAnalysis,
    cuts: list[int],
    out_dir: Path,
    training: TrainingConfig,
    progress: Progress = lambda _: None,
    cache: Path | None = None,
    stage_builder: StageBuilder = build_stage_artifacts,
) -> Manifest:
    """Slice at ``cuts``, build every stage's artifacts into ``out_dir``, write the manifest.

    With ``cache``, a stage already built there (same sub-graph, training config and
    gradient wiring) is copied instead of rebuilt: re-partitioning re-uses block ranges.
    ``stage_builder`` writes one stage's files (another builds a reference: exporter/training_build.py).
    """
    _check_training_config(training)
    _check_folder(out_dir)
    ranges = stage_ranges(cuts, len(analysis.blocks))
    graphs = [slice_stage(analysis, k, first, end) for k, (first, end) in enumerate(ranges)]
    built: list[StageArtifacts] = [None] * len(graphs)  # type: ignore[list-item]
    # Stages are built aside and moved in only when all of them built: a failure leaves the folder as it was.
    staging = _staging_folder(out_dir)
    try:
        for stage in reversed(graphs):
            progress(f"stage {stage.index}: blocks {stage.first_block}..{stage.end_block - 1}, building artifacts")
            downstream = built[stage.index + 1] if not stage.is_last else None
            gradient_outputs = [t for t in stage.outputs if downstream and t.name in downstream.input_gradients]
            wants = {t.name for t in stage.inputs if t.differentiable and t.name not in _model_inputs(analysis)}
            folder = staging / f"stage{stage.index}"
            built[stage.index] = stage_builder(stage, training, folder, gradient_outputs, wants) if cache is None \
                else _build_or_reuse(stage, training, folder, gradient_outputs, wants, cache)
            for note in built[stage.index].notes:
                progress(f"stage {stage.index}: {note}")
        _replace_stages(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    built = [dataclasses.replace(b, files={role: out_dir / path.relative_to(staging) for role, path in b.files.items()})
             for b in built]
    _copy_source(source, out_dir / SOURCE_FILE)
    manifest = _manifest(source, analysis, graphs, built, out_dir, training)
    write_manifest(manifest, out_dir)
    progress(f"wrote {out_dir / 'manifest.json'} ({len(graphs)} stage(s))")
    return manifest


def _build_or_reuse(stage: StageGraph, training: TrainingConfig, out_dir: Path, gradient_outputs: list,
                    wants: set[str], cache: Path) -> StageArtifacts:
    key = hashlib.sha256()
    key.update(stage.model.SerializeToString())
    key.update(json.dumps([dataclasses.asdict(training), sorted(t.name for t in gradient_outputs), sorted(wants),
                           stage.is_first, stage.is_last], default=str).encode())
    entry = cache / key.hexdigest()[:32]
    if not (entry / "artifacts.json").is_file():
        built = build_stage_artifacts(stage, training, entry, gradient_outputs, wants)
        record = {"files": {role: path.name for role, path in built.files.items()},
                  "input_gradients": built.input_gradients, "output_gradients": built.output_gradients,
                  "labels": [t.to_json() for t in built.labels], "notes": built.notes, "saved": list(built.saved)}
        (entry / "artifacts.json").write_text(json.dumps(record))
    record = json.loads((entry / "artifacts.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for role, name in record["files"].items():
        shutil.copyfile(entry / name, out_dir / name)
        files[role] = out_dir / name
    return StageArtifacts(stage.index, files, record["input_gradients"], record["output_gradients"],
                          tuple(BoundaryTensor.from_json(t) for t in record["labels"]), record["notes"],
                          tuple(record.get("saved", ())))


def _check_training_config(training: TrainingConfig) -> None:
    if training.loss not in ("cross_entropy", "mse"):
        raise ExportError(f"unknown loss {training.loss!r}; choose cross_entropy or mse")
    if training.optimizer not in OPTIMIZERS:
        raise ExportError(f"unknown optimizer {training.optimizer!r}; choose {' or '.join(OPTIMIZERS)}")
    if not training.learning_rate > 0:
        raise ExportError(f"learning rate must be positive (got {training.learning_rate})")
    if training.weight_decay < 0:
        raise ExportError(f"weight decay must be >= 0 (got {training.weight_decay})")


def _check_folder(out_dir: Path) -> None:
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ExportError(f"{out_dir}: exists and is not a folder")
        if any(out_dir.iterdir()) and not (out_dir / "manifest.json").exists():
            raise ExportError(f"{out_dir}: folder is not empty and is not an edgert plan; choose another -o")


def _staging_folder(out_dir: Path) -> Path:
    """A scratch folder beside ``out_dir`` (the same file system, so finished stages move in by renaming)."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    except OSError as error:
        raise ExportError(f"{out_dir}: cannot write a plan there ({error.strerror or error})") from None


def _replace_stages(staging: Path, out_dir: Path) -> None:
    """Move the freshly built stage folders into ``out_dir`` in place of its old ones."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for child in out_dir.glob("stage*"):
        shutil.rmtree(child)
    for child in staging.iterdir():
        child.rename(out_dir / child.name)


def _copy_source(source: SourceModel, path: Path) -> None:
    """Keep the source model beside the plan, for ``edgert check`` and ``edgert merge`` (in one file, the tensors
    of a model that kept them in an external file included: what ``source.sha256`` hashes)."""
    if Path(source.path).is_file() and sha256_of(Path(source.path)) == source.sha256:
        shutil.copyfile(source.path, path)
    else:
        path.write_bytes(source.model.SerializeToString())


def _model_inputs(analysis: ModelAnalysis) -> set[str]:
    return {t.name for t in analysis.inputs}


def _manifest(
    source: SourceModel,
    analysis: ModelAnalysis,
    graphs: list[StageGraph],
    built: list[StageArtifacts],
    out_dir: Path,
    training: TrainingConfig,
) -> Manifest:
    metadata = {p.key: p.value for p in source.model.metadata_props}
    if analysis.trainable.frozen:  # --frozen too, so that check and re-planning freeze what this export froze
        metadata[FROZEN_METADATA] = ",".join(analysis.trainable.frozen)
    stages = tuple(_stage_entry(analysis, graph, artifacts, out_dir) for graph, artifacts in zip(graphs, built))
    return Manifest(
        source_sha256=source.sha256,
        source_name=Path(source.path).name,
        training=training,
        stages=stages,
        model_input=analysis.inputs,
        model_output=analysis.output,
        labels=built[-1].labels,
        blocks=tuple(b.name for b in analysis.blocks),
        metadata=metadata,
    )


def _stage_entry(analysis: ModelAnalysis, graph: StageGraph, artifacts: StageArtifacts, out_dir: Path) -> StageEntry:
    shapes = {i.name: tuple(i.dims) for i in graph.model.graph.initializer}
    parameters = tuple(
        ParameterInfo(name, shapes[name], analysis.tensors[name].dtype, trainable=name in graph.parameters)
        for name in (*graph.parameters, *graph.buffers)
    )
    files = tuple(
        ArtifactFile(role, str(path.relative_to(out_dir)), sha256_of(path), path.stat().st_size)
        for role, path in artifacts.files.items()
    )
    return StageEntry(
        index=graph.index,
        blocks=tuple(b.name for b in analysis.blocks[graph.first_block:graph.end_block]),
        inputs=graph.inputs,
        outputs=graph.outputs,
        parameters=parameters,
        artifacts=files,
        flops_per_sample=sum(b.flops for b in analysis.blocks[graph.first_block:graph.end_block]),
        buffer_updates=graph.buffer_updates,
        input_gradients=artifacts.input_gradients,
        output_gradients=artifacts.output_gradients,
        labels=artifacts.labels,
        saved=artifacts.saved,
    )
