"""A one-stage plan trained in float64: the reference ``edgert check`` judges float32 results against.

The plan's own gradient graph (``backward.onnx``) is run in float64 by onnx's reference
evaluator with edgert's convolution kernels (exporter/float64.py), its parameters stepped by
the runtime's optimizer in float64. :meth:`Float64Model.loss_at` evaluates the loss alone at
other parameters, for central differences: the reference the gradient rules themselves are
checked against.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx

from edgert.exporter.float64 import Float64Evaluator, as_float64
from edgert.exporter.graph_walk import drop_unneeded
from edgert.exporter.loss import LOSS_OUTPUT, LOSS_SCALE_INPUT
from edgert.manifest import Manifest
from edgert.optimizer import FlatParameters, make_optimizer
from edgert.weights import load_state


def _wide(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v for k, v in values.items()}


class Float64Model:
    """The only stage of ``plan_dir`` (an unsplit plan), its parameters, gradients and optimizer, all float64."""

    def __init__(self, plan_dir: str | Path, manifest: Manifest):
        if len(manifest.stages) != 1:
            raise ValueError("the float64 reference trains an unsplit (one-stage) plan")
        plan_dir = Path(plan_dir)
        self.entry = entry = manifest.stages[0]
        backward = as_float64(onnx.load(str(plan_dir / entry.artifact("backward").path)))
        self._backward = Float64Evaluator(backward)
        loss_only = copy.deepcopy(backward)
        kept = [o for o in loss_only.graph.output if o.name == LOSS_OUTPUT]
        del loss_only.graph.output[:]
        loss_only.graph.output.extend(kept)
        drop_unneeded(loss_only.graph)
        self._loss = Float64Evaluator(loss_only)
        initial = _wide(load_state(plan_dir / entry.artifact("parameters").path).parameters)
        self.trainable = [p.name for p in entry.parameters if p.trainable]
        self._buffers = {p.name: initial[p.name] for p in entry.parameters if not p.trainable}
        self._flat = FlatParameters({name: initial[name] for name in self.trainable}, dtype=np.float64)
        self._gradient = self._flat.zeros()
        self._optimizer = make_optimizer(manifest.training)

    def _feeds(self, inputs: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray],
               parameters: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return {**_wide(inputs), **labels, LOSS_SCALE_INPUT: np.array(1.0), **self._buffers,
                **(parameters if parameters is not None else self._flat.views)}

    def train_batch(self, inputs: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> float:
        """Forward and backward of one batch: the gradients are kept for :meth:`step`, the running statistics
        move; returns the loss."""
        outputs = self._backward.run(self._feeds(inputs, labels))
        for name in self.trainable:
            self._flat.piece(self._gradient, name)[...] = outputs[f"{name}_grad"]
        for output, buffer in self.entry.buffer_updates.items():
            self._buffers[buffer] = outputs[output]
        return float(outputs[LOSS_OUTPUT])

    def gradients_at(self, inputs: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray],
                     parameters: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The gradients at ``parameters`` (every trainable one), nothing changed."""
        outputs = self._backward.run(self._feeds(inputs, labels, parameters))
        return {name: outputs[f"{name}_grad"] for name in self.trainable}

    def loss_at(self, inputs: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray],
                parameters: Mapping[str, np.ndarray]) -> float:
        """The loss at ``parameters`` (every trainable one), nothing else changed."""
        return float(self._loss.run(self._feeds(inputs, labels, parameters))[LOSS_OUTPUT])

    def gradients(self) -> dict[str, np.ndarray]:
        return {name: self._flat.piece(self._gradient, name).copy() for name in self.trainable}

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: view.copy() for name, view in self._flat.views.items()}

    def step(self) -> None:
        self._optimizer.step(self._flat, self._gradient)
        self._gradient[...] = 0.0
