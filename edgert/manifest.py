"""The plan folder's manifest: the one definition of ``plan/manifest.json`` (docs/MANIFEST.md).

A manifest names every stage of a partitioned model: its blocks, its boundary tensors
(name, shape, dtype), its parameters and the artifact files with their sha256. The
runtime refuses a plan whose files do not match their hashes. This module needs no
``onnx``: boards read manifests too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgert.errors import ManifestError
from edgert.typed_data import load_dataclass, to_data

FORMAT = "edgert-plan"
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
BATCH = "N"

ARTIFACT_ROLES = ("backward", "forward_stash", "backward_stash", "eval", "infer", "parameters", "backward_input",
                  "backward_weight", "backward_stash_input", "backward_stash_weight")
# What a worker needs to train its stage, all runnable by stock onnxruntime (the rest serve the host).
RUNTIME_ROLES = ("backward", "eval", "infer", "parameters")
# ... and with activation stashing (a stage that is not the last).
STASH_ROLES = ("forward_stash", "backward_stash")
# ... and with the backward split (exporter/weight_split.py), by memory mode, where the stage has them.
SPLIT_ROLES = {"recompute": ("backward_input", "backward_weight"),
               "stash": ("backward_stash_input", "backward_stash_weight")}
MEMORY_MODES = ("recompute", "stash")
OPTIMIZERS = ("adamw", "sgd")  # TrainingConfig.optimizer (edgert.optimizer builds them)


def needed_roles(entry: StageEntry, memory_mode: str = "recompute", split_backward: bool = False) -> tuple[str, ...]:
    """The artifact roles a worker needs to train ``entry`` in ``memory_mode`` (``split_backward``: with its
    backward split in two, where the plan split it)."""
    stashing = memory_mode == "stash" and not entry.is_last
    split = split_roles(entry, "stash" if stashing else "recompute") if split_backward else ()
    return RUNTIME_ROLES + (STASH_ROLES if stashing else ()) + split


def split_roles(entry: StageEntry, memory_mode: str) -> tuple[str, ...]:
    """The roles of ``entry``'s split backward in ``memory_mode`` (docs/MANIFEST.md), or () where it has none."""
    roles = SPLIT_ROLES[memory_mode]
    return roles if all(entry.has_artifact(role) for role in roles) else ()


@dataclass(frozen=True)
class BoundaryTensor:
    """A tensor that crosses a cut; ``shape`` uses ``"N"`` for the batch dimension."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    @property
    def bytes_per_sample(self) -> int:
        elements = 1
        for dim in self.shape:
            if dim != BATCH:
                elements *= int(dim)
        return elements * np.dtype(self.dtype).itemsize

    @property
    def differentiable(self) -> bool:
        return np.issubdtype(np.dtype(self.dtype), np.floating)

    def shape_for(self, batch: int) -> tuple[int, ...]:
        """The concrete shape of this tensor for a batch of ``batch`` samples."""
        return tuple(batch if dim == BATCH else int(dim) for dim in self.shape)

    def mismatch(self, value: Any) -> str | None:
        """Why ``value`` is not this tensor ("has dtype ..., expected ..." or the shape's), or None if it is."""
        if not isinstance(value, np.ndarray) or value.dtype != np.dtype(self.dtype):
            return f"has dtype {getattr(value, 'dtype', type(value).__name__)}, expected {self.dtype}"
        if len(value.shape) != len(self.shape) or any(
                d != BATCH and int(d) != n for d, n in zip(self.shape, value.shape)):
            return f"has shape {list(value.shape)}, expected {list(self.shape)}"
        return None

    def batch_sizes(self, value: np.ndarray) -> set[int]:
        """The sizes ``value`` has along this tensor's batch dimensions."""
        return {n for d, n in zip(self.shape, value.shape) if d == BATCH}

    def sample(self, rng: np.random.Generator, batch: int, bound: int = 2) -> np.ndarray:
        """Random values of this tensor for ``batch`` samples: normal floats, or integers in ``[0, bound)``."""
        shape = self.shape_for(batch)
        if np.issubdtype(np.dtype(self.dtype), np.integer):
            return rng.integers(0, bound, size=shape).astype(self.dtype)
        return rng.standard_normal(shape).astype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return to_data(self)

    @classmethod
    def from_json(cls, data: Any) -> BoundaryTensor:
        return load_dataclass(cls, data, error=ManifestError)


@dataclass(frozen=True)
class ArtifactFile:
    """One file of a stage, relative to the plan folder, with its hash."""

    role: str
    path: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class ParameterInfo:
    """A trainable parameter or a running statistic (``trainable=False``) of a stage."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool = True

    @property
    def bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class StageEntry:
    """Everything a worker needs to know about its stage."""

    index: int
    blocks: tuple[str, ...]
    inputs: tuple[BoundaryTensor, ...]
    outputs: tuple[BoundaryTensor, ...]
    parameters: tuple[ParameterInfo, ...]
    artifacts: tuple[ArtifactFile, ...]
    flops_per_sample: int
    # output of the training model -> running statistic it replaces after each micro-batch
    buffer_updates: dict[str, str] = field(default_factory=dict)
    # boundary input -> training-model output carrying d(loss)/d(input), sent to the previous stage
    input_gradients: dict[str, str] = field(default_factory=dict)
    # boundary output -> training-model input that takes d(loss)/d(output) from the next stage
    output_gradients: dict[str, str] = field(default_factory=dict)
    labels: tuple[BoundaryTensor, ...] = ()
    # tensors the stashing forward returns for the backward (activation stashing)
    saved: tuple[str, ...] = ()

    @property
    def is_last(self) -> bool:
        return bool(self.labels)

    @property
    def param_bytes(self) -> int:
        return sum(p.bytes for p in self.parameters if p.trainable)

    def artifact(self, role: str) -> ArtifactFile:
        for artifact in self.artifacts:
            if artifact.role == role:
                return artifact
        raise ManifestError(f"stage {self.index} has no {role!r} artifact")

    def has_artifact(self, role: str) -> bool:
        return any(artifact.role == role for artifact in self.artifacts)


@dataclass(frozen=True)
class TrainingConfig:
    """How the stages were built: loss, optimizer and its hyper-parameters."""

    loss: str = "cross_entropy"
    optimizer: str = "adamw"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    momentum: float = 0.0


@dataclass(frozen=True)
class Manifest:
    """A partitioned model: source, training config, and its stages in pipeline order."""

    source_sha256: str
    source_name: str
    training: TrainingConfig
    stages: tuple[StageEntry, ...]
    model_input: tuple[BoundaryTensor, ...]
    model_output: BoundaryTensor
    labels: tuple[BoundaryTensor, ...]
    blocks: tuple[str, ...]
    metadata: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def cuts(self) -> tuple[str, ...]:
        """The first block of every stage after the first: where the model was cut."""
        return tuple(stage.blocks[0] for stage in self.stages[1:])

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "format_version": self.format_version, **to_data(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        _check_format(data)
        try:
            return load_dataclass(cls, data, error=ManifestError)
        except ManifestError as error:
            raise ManifestError(f"manifest is malformed: {error}") from None


def _check_format(data: Any) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(f"not an edgert plan manifest (expected format {FORMAT!r})")
    version = data.get("format_version")
    if version == 1:
        raise ManifestError("this plan was exported by an older edgert (format version 1: its gradient graphs "
                            "need the training build); export it again with edgert export")
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"manifest format version {version!r} is not supported (this edgert reads {FORMAT_VERSION})"
        )


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(manifest: Manifest, plan_dir: Path) -> Path:
    """Write ``manifest.json`` into ``plan_dir``."""
    path = Path(plan_dir) / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    return path


def load_manifest(plan_dir: str | Path, verify: bool = True) -> Manifest:
    """Read ``plan_dir/manifest.json``; with ``verify`` check every artifact against its sha256."""
    plan_dir = Path(plan_dir)
    path = plan_dir / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{plan_dir}: no {MANIFEST_NAME} (is this a plan folder written by `edgert export`?)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ManifestError(f"{path}: not valid JSON ({error})") from None
    manifest = Manifest.from_json(data)
    if verify:
        verify_artifacts(manifest, plan_dir)
    return manifest


def verify_artifacts(manifest: Manifest, plan_dir: Path, stages: list[int] | None = None) -> None:
    """Raise :class:`ManifestError` naming the first artifact that is missing or altered."""
    for stage in manifest.stages:
        if stages is not None and stage.index not in stages:
            continue
        for artifact in stage.artifacts:
            verify_file(Path(plan_dir) / artifact.path, artifact.sha256, f"stage {stage.index} {artifact.role}")


def verify_file(path: Path, expected_sha256: str, what: str) -> None:
    """Raise :class:`ManifestError` if ``path`` is missing or its sha256 is not ``expected_sha256``."""
    if not path.is_file():
        raise ManifestError(f"{what}: file {path} is missing")
    actual = sha256_of(path)
    if actual != expected_sha256:
        raise ManifestError(
            f"{what}: {path.name} does not match the manifest "
            f"(sha256 {actual[:12]}..., expected {expected_sha256[:12]}...)"
        )
