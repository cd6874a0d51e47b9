"""A plan's stages chained in float64: the reference float32 results are judged against.

Each stage's own graphs (``eval.onnx`` forward, ``backward.onnx``) run in float64 by onnx's
reference evaluator with edgert's convolution kernels (exporter/float64.py), chained as
:class:`edgert.chain.StageChain` chains the float32 ones, the parameters stepped by the runtime's
optimizer in float64. ``edgert check`` trains the unsplit model so; the torch coverage tests run
a plan so to compare its graphs with torch autograd in float64. :meth:`Float64Chain.loss_at`
and :meth:`Float64Chain.gradients_at` evaluate at other parameters, nothing changed: for central
differences, the reference the gradient rules themselves are checked against.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from edgert.exporter.float64 import Float64Evaluator, as_float64
from edgert.exporter.graph_walk import drop_unneeded
from edgert.exporter.loss import LOSS_OUTPUT, LOSS_SCALE_INPUT
from edgert.manifest import Manifest, StageEntry
from edgert.optimizer import FlatParameters, make_optimizer
from edgert.weights import load_state

Tensors = Mapping[str, np.ndarray]


def _wide(values: Tensors) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v for k, v in values.items()}


def _evaluator(plan_dir: Path, entry: StageEntry, role: str, outputs: list[str] | None = None) -> Float64Evaluator:
    model = as_float64(onnx.load(str(plan_dir / entry.artifact(role).path)))
    if outputs is not None:
        model = copy.deepcopy(model)
        kept = [o for o in model.graph.output if o.name in outputs]
        del model.graph.output[:]
        model.graph.output.extend(kept)
        drop_unneeded(model.graph)
    return Float64Evaluator(model)


@dataclass
class _Stage:
    entry: StageEntry
    forward: Float64Evaluator | None  # the eval graph (not for the last stage)
    backward: Float64Evaluator
    loss: Float64Evaluator | None  # the last stage's loss alone
    buffers: dict[str, np.ndarray]


class Float64Chain:
    """Every stage of a plan, its parameters, gradients and optimizer, all in float64 (module docstring)."""

    def __init__(self, plan_dir: str | Path, manifest: Manifest):
        plan_dir = Path(plan_dir)
        self._stages = []
        initial: dict[str, np.ndarray] = {}
        for entry in manifest.stages:
            state = _wide(load_state(plan_dir / entry.artifact("parameters").path).parameters)
            initial.update({p.name: state[p.name] for p in entry.parameters if p.trainable})
            self._stages.append(_Stage(
                entry,
                None if entry.is_last else _evaluator(plan_dir, entry, "eval", [t.name for t in entry.outputs]),
                _evaluator(plan_dir, entry, "backward"),
                _evaluator(plan_dir, entry, "backward", [LOSS_OUTPUT]) if entry.is_last else None,
                {p.name: state[p.name] for p in entry.parameters if not p.trainable}))
        self.trainable = list(initial)
        self._flat = FlatParameters(initial, dtype=np.float64)
        self._gradient = self._flat.zeros()
        self._optimizer = make_optimizer(manifest.training)

    def train_batch(self, inputs: Tensors, labels: Tensors) -> float:
        """Forward and backward of one batch: the gradients are kept for :meth:`step`, the running statistics
        move; returns the loss."""
        loss, gradients, updates = self._run(inputs, labels, self._flat.views)
        for name, value in gradients.items():
            self._flat.piece(self._gradient, name)[...] = value
        for stage, moved in zip(self._stages, updates):
            stage.buffers.update(moved)
        return loss

    def gradients_at(self, inputs: Tensors, labels: Tensors, parameters: Tensors) -> dict[str, np.ndarray]:
        """The gradients at ``parameters`` (every trainable one), nothing changed."""
        return self._run(inputs, labels, parameters)[1]

    def loss_at(self, inputs: Tensors, labels: Tensors, parameters: Tensors) -> float:
        """The loss at ``parameters`` (every trainable one), nothing changed."""
        values = _wide(inputs)
        for stage in self._stages[:-1]:
            values = stage.forward.run({**values, **stage.buffers, **parameters})
        last = self._stages[-1]
        return float(last.loss.run(self._last_feeds(last, values, labels, parameters))[LOSS_OUTPUT])

    def gradients(self) -> dict[str, np.ndarray]:
        return {name: self._flat.piece(self._gradient, name).copy() for name in self.trainable}

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: view.copy() for name, view in self._flat.views.items()}

    def step(self) -> None:
        self._optimizer.step(self._flat, self._gradient)
        self._gradient[...] = 0.0

    def _last_feeds(self, stage: _Stage, values: Tensors, labels: Tensors, parameters: Tensors) -> dict:
        return {**values, **_wide(labels), LOSS_SCALE_INPUT: np.array(1.0), **stage.buffers, **parameters}

    def _run(self, inputs: Tensors, labels: Tensors, parameters: Tensors
             ) -> tuple[float, dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
        """The loss, every trainable parameter's gradient and each stage's moved running statistics."""
        stage_inputs = [_wide(inputs)]
        for stage in self._stages[:-1]:
            stage_inputs.append(stage.forward.run({**stage_inputs[-1], **stage.buffers, **parameters}))
        gradients: dict[str, np.ndarray] = {}
        updates: list[dict[str, np.ndarray]] = [{} for _ in self._stages]
        received: dict[str, np.ndarray] = {}
        loss = 0.0
        for index in reversed(range(len(self._stages))):
            stage = self._stages[index]
            entry = stage.entry
            if entry.is_last:
                feeds = self._last_feeds(stage, stage_inputs[index], labels, parameters)
            else:
                feeds = {**stage_inputs[index], **stage.buffers, **parameters,
                         **{entry.output_gradients[name]: value for name, value in received.items()
                            if name in entry.output_gradients}}
            outputs = stage.backward.run(feeds)
            if entry.is_last:
                loss = float(outputs[LOSS_OUTPUT])
            gradients.update({p.name: outputs[f"{p.name}_grad"] for p in entry.parameters
                              if p.trainable and f"{p.name}_grad" in outputs})
            updates[index] = {buffer: outputs[output] for output, buffer in entry.buffer_updates.items()}
            received = {name: outputs[exposed] for name, exposed in entry.input_gradients.items()}
        return loss, gradients, updates
