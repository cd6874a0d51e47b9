"""Evaluation on the central node: the stages' latest state, chained, on the test set.

The coordinator fetches every stage's state (which it also keeps as the checkpoint) and
runs the plan's inference graphs here, so evaluation never stalls the workers' pipeline
beyond the drain it needs anyway.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgert.chain import StageChain
from edgert.manifest import Manifest
from edgert.weights import StageState


def loss_and_accuracy(loss: str, prediction: np.ndarray, labels: np.ndarray) -> tuple[float, float | None]:
    """Mean loss and (for classification) accuracy of a prediction."""
    if loss == "cross_entropy":
        logits = prediction.reshape(-1, prediction.shape[-1]).astype(np.float64)
        target = labels.reshape(-1)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        mean_loss = float(-log_probs[np.arange(len(target)), target].mean())
        return mean_loss, float(np.mean(logits.argmax(axis=1) == target))
    return float(np.mean((prediction.astype(np.float64) - labels) ** 2)), None


class Evaluator:
    """A local copy of the plan's stages, loaded with fetched states, run on test data."""

    def __init__(self, plan_dir: Path, manifest: Manifest):
        self._chain = StageChain(plan_dir, manifest)
        self._manifest = manifest

    def evaluate(self, states: list[StageState], x: np.ndarray, y: np.ndarray,
                 batch_size: int = 256) -> tuple[float, float | None]:
        for stage, state in zip(self._chain.stages, states):
            stage.load_parameters(state.parameters)
        input_name = self._manifest.model_input[0].name
        predictions = [self._chain.infer({input_name: x[i:i + batch_size]}) for i in range(0, len(x), batch_size)]
        return loss_and_accuracy(self._manifest.training.loss, np.concatenate(predictions), y)
