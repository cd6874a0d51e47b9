"""``edgert check``: a plan's stages, chained, must train exactly like the unsplit model.

The reference is built independently of the stage builder, with ORT's own
``generate_artifacts`` on the normalised whole model, and stepped with ORT's own optimizer
model (or the runtime optimizer where ORT's SGD cannot express the config). On one seeded
batch the check compares the loss, every parameter gradient, and every parameter after a
few optimizer steps, per stage. Then, stage by stage and in both memory modes, the portable
graphs a board runs are compared with the training build's own (``check_portable``).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from edgert.chain import StageChain
from edgert.exporter.check_portable import (
    PORTABLE_TOLERANCE,
    PortableDiff,
    compare_portable,
    relative_difference,
    training_build_gaps,
)
from edgert.exporter.normalise import TrainableGraph, frozen_in, normalise
from edgert.exporter.ort_training import artifacts as ort_artifacts
from edgert.exporter.ort_training import native_stderr_silenced, onnxblock, training_api
from edgert.exporter.source import from_model_proto
from edgert.manifest import Manifest, load_manifest
from edgert.optimizer import FlatParameters, make_optimizer

DEFAULT_TOLERANCE = 1e-4


@dataclass
class StageDiff:
    """Largest differences of one stage's gradients and parameters from the reference."""

    stage: int
    max_grad_abs_diff: float
    max_grad_rel_diff: float
    max_param_abs_diff: float
    max_param_rel_diff: float


@dataclass
class CheckReport:
    """The result of ``edgert check``; ``ok`` when every relative difference is within tolerance."""

    stages: list[StageDiff]
    loss: float
    reference_loss: float
    loss_diff: float
    max_grad_rel_diff: float
    max_param_rel_diff: float
    tolerance: float
    steps: int
    batch_size: int
    notes: list[str] = field(default_factory=list)
    portable: list[PortableDiff] = field(default_factory=list)
    portable_tolerance: float = PORTABLE_TOLERANCE

    @property
    def max_portable_rel_diff(self) -> float:
        return max((d.largest for d in self.portable), default=0.0)

    @property
    def ok(self) -> bool:
        return max(self.max_grad_rel_diff, self.max_param_rel_diff,
                   self.loss_diff / max(abs(self.reference_loss), 1e-12)) <= self.tolerance and \
            self.max_portable_rel_diff <= self.portable_tolerance

    def to_json(self) -> dict:
        return {**asdict(self), "max_portable_rel_diff": self.max_portable_rel_diff, "ok": self.ok}


def check_plan(plan_dir: str | Path, model_path: str | Path | None = None, steps: int = 3,
               batch_size: int = 8, seed: int = 0, tolerance: float = DEFAULT_TOLERANCE) -> CheckReport:
    """Compare the chained stages of ``plan_dir`` with the unsplit model it was cut from."""
    plan_dir = Path(plan_dir)
    manifest = load_manifest(plan_dir)
    source = _source_model(plan_dir, manifest, model_path)
    inputs, labels = _seeded_batch(manifest, source, batch_size, seed)
    with tempfile.TemporaryDirectory(prefix="edgert-check-") as scratch:
        trainable = normalise(from_model_proto(source, "reference"), frozen_in(manifest.metadata))
        gaps = training_build_gaps(trainable.graph.node)
        if gaps:
            reference = _PortableReference(source, manifest, Path(scratch), gaps)
        else:
            reference = _Reference(trainable, manifest, Path(scratch))
        chain = StageChain(plan_dir, manifest)
        portable, portable_notes = compare_portable(plan_dir, manifest, _stage_inputs(chain, inputs), labels, seed)
        losses, ref_losses = [], []
        grads = ref_grads = None
        for step in range(steps):
            losses.append(chain.train_batch(inputs, labels).loss)
            ref_losses.append(reference.train_batch(inputs, labels))
            if step == 0:
                grads, ref_grads = chain.gradients(), reference.gradients()
            chain.step()
            reference.step()
        params, ref_params = chain.parameters(include_buffers=False), reference.parameters()
    stage_diffs = [_stage_diff(entry.index, [p.name for p in entry.parameters if p.trainable],
                               grads, ref_grads, params, ref_params) for entry in manifest.stages]
    return CheckReport(
        stages=stage_diffs,
        loss=losses[0],
        reference_loss=ref_losses[0],
        loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        max_grad_rel_diff=max(d.max_grad_rel_diff for d in stage_diffs),
        max_param_rel_diff=max(d.max_param_rel_diff for d in stage_diffs),
        tolerance=tolerance,
        steps=steps,
        batch_size=batch_size,
        notes=reference.notes + portable_notes,
        portable=portable,
    )


def _stage_inputs(chain: StageChain, inputs: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Each stage's boundary inputs for ``inputs``, from the chain's forward (which moves no statistics)."""
    values = [inputs]
    for stage in chain.stages[:-1]:
        values.append(stage.forward(values[-1], {}))
    return values


def _source_model(plan_dir: Path, manifest: Manifest, model_path: str | Path | None) -> onnx.ModelProto:
    from edgert.exporter.errors import ExportError
    from edgert.exporter.source import load_plan_source, load_source_model

    if model_path is None:
        return load_plan_source(plan_dir, manifest.source_sha256).model
    source = load_source_model(model_path)
    if source.sha256 != manifest.source_sha256:
        raise ExportError(f"{model_path} is not the model this plan was cut from (sha256 differs)")
    return source.model


def _seeded_batch(manifest: Manifest, model: onnx.ModelProto, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    inputs = {t.name: t.sample(rng, batch, _index_bound(model, t.name)) for t in manifest.model_input}
    prediction = manifest.model_output
    classes = int(prediction.shape[-1])
    labels = {t.name: t.sample(rng, batch, classes) for t in manifest.labels}
    return inputs, labels


def _index_bound(model: onnx.ModelProto, name: str) -> int:
    """For an integer input used as Gather indices, the size of the gathered table."""
    initializers = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name and node.input[0] in initializers:
            return int(initializers[node.input[0]].dims[0])
    return 2


def _stage_diff(stage: int, names: list[str], grads, ref_grads, params, ref_params) -> StageDiff:
    grad_abs, grad_rel = _relative(names, grads, ref_grads)
    param_abs, param_rel = _relative(names, params, ref_params)
    return StageDiff(stage=stage, max_grad_abs_diff=grad_abs, max_grad_rel_diff=grad_rel,
                     max_param_abs_diff=param_abs, max_param_rel_diff=param_rel)


def _relative(names: list[str], values: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> tuple[float, float]:
    """:func:`relative_difference` over a stage's tensors ``names``."""
    return relative_difference({n: reference[n] for n in names}, values)


class _Reference:
    """The unsplit model, built and trained with ORT's own artifact generator and optimizer."""

    def __init__(self, trainable: TrainableGraph, manifest: Manifest, scratch: Path):
        artifacts = ort_artifacts()
        self.notes: list[str] = []
        whole = trainable.model
        keep = manifest.model_output.name
        outputs = [o for o in whole.graph.output if o.name == keep]
        del whole.graph.output[:]
        whole.graph.output.extend(outputs)
        config = manifest.training
        loss = {"cross_entropy": artifacts.LossType.CrossEntropyLoss, "mse": artifacts.LossType.MSELoss}[config.loss]
        ort_optimizer = config.optimizer == "adamw" or not (config.weight_decay or config.momentum)
        with native_stderr_silenced():
            artifacts.generate_artifacts(
                whole, requires_grad=trainable.parameters, frozen_params=trainable.buffers, loss=loss,
                optimizer=None, artifact_directory=str(scratch),
            )
        api = training_api()
        self._parameters = trainable.parameters
        self._flat: FlatParameters | None = None
        self._state = api.CheckpointState.load_checkpoint(str(scratch / "checkpoint"))
        self._module = api.Module(str(scratch / "training_model.onnx"), self._state)
        self._module.train()
        self._inputs = self._module.input_names()
        if ort_optimizer:
            path = scratch / "optimizer_model.onnx"
            self._write_ort_optimizer(config, trainable, path, whole)
            self._optimizer = api.Optimizer(str(path), self._module)
            self._optimizer.set_learning_rate(config.learning_rate)
            self._runtime_optimizer = None
        else:
            self.notes.append("reference stepped with the runtime SGD (ORT's SGD has no momentum/weight decay)")
            self._optimizer = None
            self._runtime_optimizer = make_optimizer(config)

    @staticmethod
    def _write_ort_optimizer(config, trainable, path: Path, whole: onnx.ModelProto) -> None:
        blocks = onnxblock()
        initializers = {i.name: i for i in trainable.model.graph.initializer}
        params = [initializers[p] for p in trainable.parameters]
        if config.optimizer == "adamw":
            optimizer = blocks.optim.AdamW(betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay)
        else:
            optimizer = blocks.optim.SGD()
        opset = next(o.version for o in whole.opset_import if o.domain in ("", "ai.onnx"))
        with blocks.empty_base(opset_version=opset) as accessor:
            optimizer((params, []))
            model = accessor.model
        model.ir_version = whole.ir_version
        onnx.save(model, str(path))

    def train_batch(self, inputs: dict[str, np.ndarray], labels: dict[str, np.ndarray]) -> float:
        values = {**inputs, **labels}
        # generate_artifacts names the label input "labels" (cross entropy) or "target" (MSE)
        if "target" in self._inputs and "labels" in values:
            values["target"] = values["labels"]
        outputs = self._module(*[values[name] for name in self._inputs])
        loss = outputs[0] if isinstance(outputs, tuple) else outputs
        return float(loss)

    def gradients(self) -> dict[str, np.ndarray]:
        return {p: self._state.parameters[p].grad.copy() for p in self._parameters}

    def parameters(self) -> dict[str, np.ndarray]:
        return {p: self._state.parameters[p].data.copy() for p in self._parameters}

    def step(self) -> None:
        if self._optimizer is not None:
            self._optimizer.step()
        else:
            views = {p: self._state.parameters[p].data for p in self._parameters}
            if self._flat is None:
                self._flat = FlatParameters(views)
            for name, view in views.items():
                self._flat.views[name][...] = view
            gradient = np.concatenate([self._state.parameters[p].grad.reshape(-1) for p in self._flat.names])
            self._runtime_optimizer.step(self._flat, gradient)
            for name, view in views.items():
                view[...] = self._flat.views[name]
        self._module.lazy_reset_grad()


class _PortableReference:
    """The unsplit model as one portable stage, trained by the runtime: the reference where the training
    build cannot differentiate the model (``training_build_gaps``)."""

    def __init__(self, model: onnx.ModelProto, manifest: Manifest, scratch: Path, gaps: list[str]):
        from edgert.exporter.export import ExportOptions, prepare_analysis, write_plan

        self.notes = [f"reference: the unsplit model as one portable stage, since the training build's "
                      f"{', '.join(gaps)} cannot serve"]
        source = from_model_proto(model, "reference")
        options = ExportOptions(stages=1, training=manifest.training)
        write_plan(source, prepare_analysis(source, options), [], scratch / "whole", manifest.training)
        self._chain = StageChain(scratch / "whole")

    def train_batch(self, inputs: dict[str, np.ndarray], labels: dict[str, np.ndarray]) -> float:
        return self._chain.train_batch(inputs, labels).loss

    def gradients(self) -> dict[str, np.ndarray]:
        return self._chain.gradients()

    def parameters(self) -> dict[str, np.ndarray]:
        return self._chain.parameters(include_buffers=False)

    def step(self) -> None:
        self._chain.step()
