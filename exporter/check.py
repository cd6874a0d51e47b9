"""``edgert check``: are a plan's gradients right, and do its stages, chained, train like the unsplit model?

Two references, neither of them the code under test:

1. **The formulas.** The unsplit model's gradient in float64 (edgert's own gradient graph, run in
   float64 by onnx's reference evaluator: exporter/float64_model.py) must equal central
   differences of its float64 loss along random directions (each parameter moved in proportion to
   its size), at a point near the model's own: every parameter moved by a little noise, so that no activation
   sits exactly on a kink (a ReLU of a zero-initialised bias over zeros), where central differences average the
   two sides and the gradient takes one. A wrong rule shows as a difference far above float64's rounding.
2. **float32 against float64.** On one seeded batch, the plan's stages chained in float32 as workers
   run them give the loss, every parameter's gradient and every parameter after ``steps``
   optimizer steps; the unsplit model in float64 gives the same. float32 is never exact, and on
   ill-conditioned models (BatchNorm over 1x1 maps of a few values) far from it, so the check
   measures the *noise floor*: how far the unsplit model run in float32 lies from its float64 self.
   A difference within :data:`FLOOR_FACTOR` times the floor (and at least ``tolerance``) is float32's
   own; beyond it, the split changed the arithmetic.

Differences are relative to the largest value of their group (a stage's gradients, a stage's
parameters): a tensor whose exact gradient is zero (a bias before BatchNorm) holds rounding noise
that Adam amplifies, and is meaningless relative to itself. With ``reference="training-build"``
each stage's graphs are also compared with the training build's (exporter/check_training_build.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from edgert.chain import StageChain
from edgert.exporter.float64_model import Float64Chain
from edgert.manifest import Manifest, load_manifest

DEFAULT_TOLERANCE = 1e-5  # the least relative difference allowed, whatever the floor
FLOOR_FACTOR = 4.0  # allowed: this many times float32's own error (the unsplit model's) against float64
FORMULA_TOLERANCE = 1e-5  # float64 gradients against central differences, relative to the probe's size
PROBES = 3  # random directions of the central differences
JITTER = 1e-3  # the probes' point: each parameter moved by this fraction of its root-mean-square value (or this much)
# each parameter moved by these fractions of its root-mean-square value; the closer estimate counts (a step can cross
# a kink of Relu, Clip or MaxPool, whose error shrinks with the step; a wrong formula's does not)
PROBE_STEPS = (1e-6, 1e-8, 1e-10)
REFERENCES = ("float64", "training-build")
Progress = Callable[[str], None]


@dataclass
class StageDiff:
    """One stage: its chained float32 results against float64, and float32's own error on them (the floor)."""

    stage: int
    max_grad_rel_diff: float
    grad_floor: float
    max_param_rel_diff: float
    param_floor: float
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def grad_allowed(self) -> float:
        return max(FLOOR_FACTOR * self.grad_floor, self.tolerance)

    @property
    def param_allowed(self) -> float:
        return max(FLOOR_FACTOR * self.param_floor, self.tolerance)

    @property
    def ok(self) -> bool:
        return self.max_grad_rel_diff <= self.grad_allowed and self.max_param_rel_diff <= self.param_allowed


@dataclass
class CheckReport:
    """The result of ``edgert check``; ``ok`` when every difference is within what it is allowed."""

    stages: list[StageDiff]
    loss: float
    reference_loss: float
    loss_diff: float
    loss_floor: float
    formula_error: float
    tolerance: float
    steps: int
    batch_size: int
    reference: str = "float64"
    notes: list[str] = field(default_factory=list)
    training_build: list = field(default_factory=list)  # check_training_build.StageComparison, per stage and mode
    formula_tolerance: float = FORMULA_TOLERANCE

    @property
    def loss_allowed(self) -> float:
        return max(FLOOR_FACTOR * self.loss_floor, self.tolerance) * max(abs(self.reference_loss), 1e-12)

    @property
    def max_grad_rel_diff(self) -> float:
        return max(d.max_grad_rel_diff for d in self.stages)

    @property
    def max_param_rel_diff(self) -> float:
        return max(d.max_param_rel_diff for d in self.stages)

    @property
    def ok(self) -> bool:
        return (all(d.ok for d in self.stages) and self.loss_diff <= self.loss_allowed
                and self.formula_error <= self.formula_tolerance and all(c.ok for c in self.training_build))

    def to_json(self) -> dict:
        data = asdict(self)
        data["stages"] = [{**asdict(d), "grad_allowed": d.grad_allowed, "param_allowed": d.param_allowed, "ok": d.ok}
                          for d in self.stages]
        data["training_build"] = [{**asdict(c), "largest": c.largest, "ok": c.ok} for c in self.training_build]
        return {**data, "loss_allowed": self.loss_allowed, "max_grad_rel_diff": self.max_grad_rel_diff,
                "max_param_rel_diff": self.max_param_rel_diff, "ok": self.ok}


def check_plan(plan_dir: str | Path, model_path: str | Path | None = None, steps: int = 3,
               batch_size: int = 8, seed: int = 0, tolerance: float = DEFAULT_TOLERANCE,
               reference: str = "float64", progress: Progress = lambda _: None) -> CheckReport:
    """Check ``plan_dir`` against the unsplit model it was cut from (module docstring)."""
    from edgert.exporter.errors import ExportError

    if reference not in REFERENCES:
        raise ExportError(f"unknown reference {reference!r}; choose {' or '.join(REFERENCES)}")
    plan_dir = Path(plan_dir)
    manifest = load_manifest(plan_dir)
    source = _source_model(plan_dir, manifest, model_path)
    inputs, labels = _seeded_batch(manifest, source, batch_size, seed)
    with tempfile.TemporaryDirectory(prefix="edgert-check-") as scratch:
        progress("exporting the unsplit model as one stage (the reference)")
        whole = _unsplit_plan(source, manifest, Path(scratch) / "whole")
        runs = {"chain": StageChain(plan_dir, manifest), "float32": StageChain(whole),
                "float64": Float64Chain(whole, load_manifest(whole))}
        losses: dict[str, float] = {}
        gradients: dict[str, dict[str, np.ndarray]] = {}
        formula = 0.0
        for step in range(steps):
            progress(f"step {step + 1} of {steps}: the plan in float32, the unsplit model in float32 and float64")
            for name, run in runs.items():
                loss = run.train_batch(inputs, labels)
                if step == 0:
                    losses[name] = loss.loss if hasattr(loss, "loss") else loss
                    gradients[name] = run.gradients()
            if step == 0:
                progress(f"central differences of the float64 loss along {PROBES} random directions")
                formula = _formula_error(runs["float64"], inputs, labels, seed)
            for run in runs.values():
                run.step()
        parameters = {"chain": runs["chain"].parameters(include_buffers=False),
                      "float32": runs["float32"].parameters(include_buffers=False),
                      "float64": runs["float64"].parameters()}
        comparisons, notes = [], []
        if reference == "training-build":
            from edgert.exporter.check_training_build import compare_with_training_build

            progress("building the plan's stages with the training build")
            comparisons, notes = compare_with_training_build(plan_dir, manifest, _stage_inputs(runs["chain"], inputs),
                                                             labels, seed, Path(scratch) / "training-build")
    stage_diffs = [_stage_diff(entry.index, [p.name for p in entry.parameters if p.trainable], gradients, parameters,
                               tolerance) for entry in manifest.stages]
    return CheckReport(
        stages=stage_diffs, loss=losses["chain"], reference_loss=losses["float64"],
        loss_diff=abs(losses["chain"] - losses["float64"]),
        loss_floor=abs(losses["float32"] - losses["float64"]) / max(abs(losses["float64"]), 1e-12),
        formula_error=formula, tolerance=tolerance, steps=steps, batch_size=batch_size, reference=reference,
        notes=notes, training_build=comparisons,
    )


def _unsplit_plan(source: onnx.ModelProto, manifest: Manifest, folder: Path) -> Path:
    from edgert.exporter.export import ExportOptions, prepare_analysis, write_plan
    from edgert.exporter.normalise import frozen_in
    from edgert.exporter.source import from_model_proto

    whole = from_model_proto(source, "reference")
    options = ExportOptions(stages=1, training=manifest.training, frozen=frozen_in(manifest.metadata))
    write_plan(whole, prepare_analysis(whole, options), [], folder, manifest.training)
    return folder


def _formula_error(model: Float64Chain, inputs: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray],
                   seed: int) -> float:
    """The largest difference, over :data:`PROBES` random directions v, between the float64 gradient's g.v and the
    central differences of the float64 loss along v (the closer of :data:`PROBE_STEPS`); relative to the sum of the
    parameters' shares |g_t.v_t|. At the model's parameters moved by :data:`JITTER`."""
    rng = np.random.default_rng(seed + 2)
    here = {name: value + rng.standard_normal(value.shape) * JITTER * _size(value)
            for name, value in model.parameters().items()}
    gradient = model.gradients_at(inputs, labels, here)
    worst = 0.0
    for _ in range(PROBES):
        direction = {name: rng.standard_normal(value.shape) * _size(value) for name, value in here.items()}
        shares = [float(np.sum(gradient[name] * direction[name])) for name in here]
        exact = sum(shares)
        errors = []
        for step in PROBE_STEPS:
            moved = [model.loss_at(inputs, labels, {name: here[name] + sign * step * direction[name] for name in here})
                     for sign in (1.0, -1.0)]
            errors.append(abs(exact - (moved[0] - moved[1]) / (2 * step)))
        worst = max(worst, min(errors) / max(sum(abs(s) for s in shares), 1e-300))
    return worst


def _size(value: np.ndarray) -> float:
    """A tensor's root-mean-square value, 1 for a tensor of zeros."""
    return float(np.sqrt(np.mean(value ** 2))) or 1.0


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


def _stage_diff(stage: int, names: list[str], gradients: dict[str, dict], parameters: dict[str, dict],
                tolerance: float) -> StageDiff:
    def against_float64(values: dict[str, dict], run: str) -> float:
        return relative_difference({n: values["float64"][n] for n in names}, values[run])[1]

    return StageDiff(stage=stage, max_grad_rel_diff=against_float64(gradients, "chain"),
                     grad_floor=against_float64(gradients, "float32"),
                     max_param_rel_diff=against_float64(parameters, "chain"),
                     param_floor=against_float64(parameters, "float32"), tolerance=tolerance)


def relative_difference(reference: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray]
                        ) -> tuple[float, float]:
    """Largest absolute difference over a group of tensors, and that relative to the group's largest reference value."""
    if not reference:
        return 0.0, 0.0
    difference = max(float(np.max(np.abs(np.asarray(values[k], np.float64) - reference[k]), initial=0.0))
                     for k in reference)
    scale = max(float(np.max(np.abs(reference[k]), initial=0.0)) for k in reference)
    return difference, (difference / scale if scale > 0 else difference)
