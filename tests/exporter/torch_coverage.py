"""One case of the torch coverage matrix: a torch model, exported by one of torch's exporters in one mode, cut by
``edgert export`` into N stages, trained one batch by the stages chained in one process (``edgert.chain``, the
runtime's ``StageSession`` per stage), and judged against torch autograd in float64.

The judgement (``CaseResult``), in one place so that the tests and tools/coverage_table.py say the same:

- a group is the torch module that owns a parameter (a bias is judged beside its weight, as ``edgert check``
  judges a stage's tensors together); the loss is a group of its own;
- a group's error = max over its tensors t of max|g_edgert(t) - g_float64(t)|, divided by the group's
  largest |g_float64|; the loss's error is |L_edgert - L_float64| / |L_float64|;
- a group's noise floor is the same measure for torch's own float32 autograd against float64;
- the case passes when every trained initializer was matched to a torch parameter and every group's error is
  at most max(4 x its noise floor, 1e-5). It reports its worst group: the one whose error is the largest
  fraction of its tolerance, with that error and that noise floor;
- and the plan's own graphs, chained in float64 (exporter/float64_model.py), must give torch's float64 gradients
  to within 1e-6 in every group: the same arithmetic in the same precision, so this holds where float32 cannot
  be judged group by group. A model where torch's own float32 error exceeds 1e-3 in some group is *chaotic* in
  float32: a deep BatchNorm net at random initialisation (resnet50 at 64 to 128 pixels: torch float32 is 15-40%
  off float64 in some layers, seeds 0-2), where float32 and float64 runs take different ReLU branches here and
  there, and which groups land far off is chance. There each group is allowed 4 x torch float32's largest error
  over all groups (edgert's float32 no worse than torch's), and the float64 run judges the graphs.

Per group, not over the whole model: torch's float32 error is far larger in some layers (a convolution before a
BatchNorm over 2x2 maps: 8e-2 in resnet18's layer4 at 64x64) than in others (1e-7), and one model-wide floor
would excuse any error anywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from edgert.chain import StageChain
from edgert.errors import EdgertError
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.float64_model import Float64Chain
from edgert.manifest import TrainingConfig
from tests.exporter.torch_reference import (
    ParameterPool,
    ReferenceError,
    group_errors,
    loss_and_gradients,
    reference_module,
    sgd_run,
)
from tests.exporter.torch_zoo import CLASSES, MODELS, ZooModel, export_onnx

NOISE_FACTOR = 4.0
ERROR_FLOOR = 1e-5
EXACT_TOLERANCE = 1e-6  # the plan's graphs in float64 against torch in float64, per group
CHAOTIC = 1e-3  # torch's float32 error above this in a group: the model is chaotic in float32 (module docstring)
BATCH = 8
LEARNING_RATE = 0.01  # the SGD the plans are built with (one batch's gradients do not depend on it); at 0.05 a
# random-init resnet18's loss jumps 2.3 -> 5.8 in one step and float32 rounding grows to 3e-3 of the loss by step 3


@dataclass
class CaseResult:
    """What one (model, exporter, mode, stages) case came to; ``reason`` is the one line that says why it failed."""

    model: str
    exporter: str
    mode: str
    stages: int
    largest_error: float | None = None  # of the worst group
    noise_floor: float | None = None  # of the worst group
    worst_group: str = ""
    exact_error: float | None = None  # the plan's graphs in float64 against torch in float64, the worst group
    chaotic: int = 0  # groups where torch's float32 error exceeds CHAOTIC
    compared: int = 0  # trained initializers matched to torch parameters
    trained: int = 0  # trained initializers in the plan
    reason: str = ""
    seconds: float = 0.0

    @property
    def tolerance(self) -> float | None:
        return None if self.noise_floor is None else max(NOISE_FACTOR * self.noise_floor, ERROR_FLOOR)

    @property
    def passed(self) -> bool:
        return (not self.reason and self.largest_error is not None and self.largest_error <= self.tolerance
                and self.exact_error is not None and self.exact_error <= EXACT_TOLERANCE)

    def verdict(self) -> str:
        """One line: the figures and, on failure, why."""
        if self.largest_error is None:
            return f"failed: {self.reason}"
        figures = (f"worst group {self.worst_group}: error {self.largest_error:.2e}, noise floor "
                   f"{self.noise_floor:.2e}, tolerance {self.tolerance:.2e}; in float64 {self.exact_error:.2e} "
                   f"(tolerance {EXACT_TOLERANCE:.0e}); {self.chaotic} chaotic group(s); {self.compared}/"
                   f"{self.trained} parameters compared")
        if self.passed:
            return figures
        return f"failed: {self.reason or 'error above tolerance'} ({figures})"


def export_once(model: ZooModel, exporter: str, mode: str, folder: Path) -> Path:
    """The model exported by ``exporter`` in ``mode`` into ``folder`` (built with seed 0)."""
    return export_onnx(model.module(), model, exporter, mode, folder / f"{model.name}-{exporter}-{mode}.onnx")


def one_line(error: BaseException) -> str:
    """The line edgert prints for its own errors (``error: ...``); any other exception as type and first line."""
    if isinstance(error, EdgertError):
        return " ".join(str(error).split())
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def build_plan(onnx_path: Path, stages: int, plan_dir: Path, learning_rate: float = LEARNING_RATE) -> None:
    """``edgert export --stages N`` with plain SGD."""
    training = TrainingConfig(optimizer="sgd", learning_rate=learning_rate)
    export_plan(onnx_path, plan_dir, ExportOptions(stages=stages, training=training))


def batch(model: ZooModel, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch of inputs and labels."""
    labels = torch.randint(0, CLASSES, (BATCH,), generator=torch.Generator().manual_seed(seed + 1000))
    return model.batch(BATCH, seed), labels


@dataclass
class Matched:
    """The plan's chain beside the torch reference it stands for, parameters matched."""

    chain: StageChain
    reference: torch.nn.Module
    pool: ParameterPool
    sources: dict
    unmatched: list[str]
    values: dict[str, np.ndarray]

    def feeds(self, model: ZooModel, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[dict, dict]:
        manifest = self.chain.manifest
        dtype = np.int64 if manifest.model_input[0].dtype == "int64" else np.float32
        return ({manifest.model_input[0].name: inputs.numpy().astype(dtype)},
                {manifest.labels[0].name: labels.numpy().astype(np.int64)})

    def groups(self) -> dict[str, str]:
        return {name: source.group for name, source in self.sources.items()}


def match(model: ZooModel, onnx_path: Path, plan_dir: Path) -> Matched:
    """Load the plan's stages and the torch reference the export stands for, with its parameters matched."""
    chain = StageChain(plan_dir)
    values = chain.parameters(include_buffers=False)
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    norms = sum(node.op_type == "BatchNormalization" for node in graph.node)
    reference = reference_module(model.module(), norms)
    pool = ParameterPool(reference)
    sources, unmatched = pool.match_all(values)
    pool.load_into(reference, sources, values)
    return Matched(chain, reference, pool, sources, unmatched, values)


def run_case(model_name: str, exporter: str, mode: str, stages: int, onnx_path: Path, workdir: Path) -> CaseResult:
    """Cut ``onnx_path`` into ``stages``, compare one batch's loss and gradients with torch's; never raises for
    what edgert or the reference cannot do (that is the result's ``reason``)."""
    started = time.monotonic()
    result = CaseResult(model_name, exporter, mode, stages)
    model = MODELS[model_name]
    try:
        plan_dir = workdir / f"plan-{stages}"
        build_plan(onnx_path, stages, plan_dir)
        matched = match(model, onnx_path, plan_dir)
        inputs, labels = batch(model, seed=1)
        feeds, label_feeds = matched.feeds(model, inputs, labels)
        loss = matched.chain.train_batch(feeds, label_feeds).loss
        gradients = matched.chain.gradients()
        wide = Float64Chain(plan_dir, matched.chain.manifest)
        wide.train_batch(feeds, label_feeds)
        exact = wide.gradients()
    except ReferenceError as error:
        result.reason = f"reference: {error}"
    except Exception as error:  # noqa: BLE001 - what edgert says is the result
        result.reason = one_line(error)
    else:
        _judge(result, matched, inputs, labels, loss, gradients, exact)
    result.seconds = time.monotonic() - started
    return result


def _judge(result: CaseResult, matched: Matched, inputs, labels, loss: float, gradients: dict, exact: dict) -> None:
    shapes = {name: value.shape for name, value in matched.values.items()}
    loss64, grads64 = loss_and_gradients(matched.reference, inputs, labels, torch.float64)
    loss32, grads32 = loss_and_gradients(matched.reference, inputs, labels, torch.float32)
    reference = matched.pool.gather(grads64, matched.sources, shapes)
    float32 = matched.pool.gather(grads32, matched.sources, shapes)
    groups = matched.groups()
    result.trained, result.compared = len(matched.values), len(matched.sources)
    errors = {"loss": abs(loss - loss64) / abs(loss64), **group_errors(reference, gradients, groups)}
    floors = {"loss": abs(loss32 - loss64) / abs(loss64), **group_errors(reference, float32, groups)}
    exact_errors = group_errors(reference, {name: exact[name] for name in reference}, groups)
    result.exact_error = max(exact_errors.values(), default=0.0)
    result.chaotic = sum(floor > CHAOTIC for floor in floors.values())
    if result.chaotic:
        floors = dict.fromkeys(floors, max(floors.values()))
    worst = max(errors, key=lambda g: errors[g] / max(NOISE_FACTOR * floors[g], ERROR_FLOOR))
    result.worst_group, result.largest_error, result.noise_floor = worst, errors[worst], floors[worst]
    if matched.unmatched:
        shown = ", ".join(matched.unmatched[:3]) + (" ..." if len(matched.unmatched) > 3 else "")
        result.reason = f"{len(matched.unmatched)} trained initializer(s) matched no torch parameter: {shown}"


@dataclass
class RunResult:
    """A short SGD run: the largest relative difference from torch's float64 run of the step losses and of the final
    parameters (per group, as for gradients), for edgert's chain and, as the noise floor, for torch in float32."""

    loss_error: float
    parameter_error: float
    float32_loss_error: float
    float32_parameter_error: float
    steps: int


def sgd_comparison(model_name: str, onnx_path: Path, stages: int, workdir: Path, steps: int = 3,
                   learning_rate: float = LEARNING_RATE) -> RunResult:
    """``steps`` SGD steps on the same batches in the same order, edgert's chain against torch in float64."""
    model = MODELS[model_name]
    plan_dir = workdir / f"sgd-{stages}"
    build_plan(onnx_path, stages, plan_dir, learning_rate)
    matched = match(model, onnx_path, plan_dir)
    if matched.unmatched:
        raise AssertionError(f"trained initializers matched no torch parameter: {matched.unmatched}")
    batches = [batch(model, seed=10 + k) for k in range(steps)]
    losses = []
    for inputs, labels in batches:
        losses.append(matched.chain.train_batch(*matched.feeds(model, inputs, labels)).loss)
        matched.chain.step()
    parameters = matched.chain.parameters(include_buffers=False)
    shapes = {name: value.shape for name, value in matched.values.items()}

    def departure(run_losses: list[float], run_parameters: dict[str, np.ndarray]) -> tuple[float, float]:
        loss_error = max(abs(a - b) / abs(b) for a, b in zip(run_losses, torch_losses))
        errors = group_errors(final, {n: run_parameters[n] for n in final}, matched.groups())
        return loss_error, max(errors.values())

    torch_losses, torch_parameters = sgd_run(matched.reference, batches, learning_rate)
    final = matched.pool.gather(torch_parameters, matched.sources, shapes)
    losses32, parameters32 = sgd_run(matched.reference, batches, learning_rate, torch.float32)
    float32 = departure(losses32, matched.pool.gather(parameters32, matched.sources, shapes))
    return RunResult(*departure(losses, parameters), *float32, steps=steps)
