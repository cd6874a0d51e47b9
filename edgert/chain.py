"""All stages of a plan chained in one process: the reference a distributed run must match.

Forward runs stage by stage; backward runs in reverse, each stage handing the gradients
of its inputs to the stage before it. ``edgert check`` uses this to compare a plan with
the unsplit model; tests use it as the single-process baseline of a distributed run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgert.manifest import Manifest, load_manifest
from edgert.stage import StageSession, Threads


@dataclass
class ChainStep:
    """Loss and prediction of one batch pushed through the chain."""

    loss: float
    prediction: np.ndarray


class StageChain:
    """Every stage of a plan, run in pipeline order in this process."""

    def __init__(self, plan_dir: str | Path, manifest: Manifest | None = None, threads: Threads = Threads(),
                 memory_mode: str = "recompute", split_backward: bool = False):
        self.plan_dir = Path(plan_dir)
        self.manifest = manifest or load_manifest(self.plan_dir)
        self.stages = [StageSession(entry, self.plan_dir, self.manifest.training, threads, memory_mode,
                                    split_backward=split_backward)
                       for entry in self.manifest.stages]

    def train_batch(self, inputs: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray],
                    micro_batches: int = 1) -> ChainStep:
        """Forward and backward of one batch split into ``micro_batches``; gradients accumulate."""
        batch = len(next(iter(inputs.values())))
        bounds = np.linspace(0, batch, micro_batches + 1).astype(int)
        losses, predictions = [], []
        for start, end in zip(bounds[:-1], bounds[1:]):
            part = {k: v[start:end] for k, v in inputs.items()}
            part_labels = {k: v[start:end] for k, v in labels.items()}
            loss, prediction = self._micro_batch(part, part_labels, (end - start) / batch)
            losses.append(loss * (end - start) / batch)
            predictions.append(prediction)
        return ChainStep(loss=float(sum(losses)), prediction=np.concatenate(predictions))

    def _micro_batch(self, inputs: dict[str, np.ndarray], labels: dict[str, np.ndarray],
                     scale: float) -> tuple[float, np.ndarray]:
        stage_inputs, kept = [inputs], []
        for stage in self.stages[:-1]:
            kept.append({})
            stage_inputs.append(stage.forward(stage_inputs[-1], kept[-1]))
        last = self.stages[-1].backward(stage_inputs[-1], labels=labels, loss_scale=scale)
        gradients = last.input_gradients
        for k in reversed(range(len(self.stages) - 1)):
            gradients = self.stages[k].backward(stage_inputs[k], output_gradients=gradients,
                                                saved=kept[k]).input_gradients
        return last.loss, last.prediction

    def step(self) -> None:
        for stage in self.stages:
            stage.step()

    def gradients(self) -> dict[str, np.ndarray]:
        return {k: v for stage in self.stages for k, v in stage.gradients().items()}

    def parameters(self, include_buffers: bool = True) -> dict[str, np.ndarray]:
        return {k: v for stage in self.stages for k, v in stage.parameters(include_buffers).items()}

    def infer(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The prediction with inference-form normalisation, through every stage."""
        values = dict(inputs)
        for stage in self.stages:
            values = stage.infer(values)
        return values[self.manifest.model_output.name]
