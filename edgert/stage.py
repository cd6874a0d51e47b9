"""One pipeline stage over ORT Training: forward, forward+backward, optimizer step, state.

The forward runs the eval model (training-form normalisation, so it matches the forward
the backward recomputes); the backward runs the training model, which recomputes the
forward (activation checkpointing at stage granularity), accumulates parameter
gradients in ORT's buffers and returns the gradients of the stage's inputs. Parameters
are numpy views on ORT's own buffers, so the optimizer updates them without copies.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgert.errors import StageError
from edgert.manifest import BoundaryTensor, StageEntry, TrainingConfig
from edgert.optimizer import Optimizer, StateDict, make_optimizer
from edgert.ort_training import training_api

LOSS_SCALE_INPUT = "loss_scale"
SCALED_LOSS_OUTPUT = "scaled_loss"
LOSS_OUTPUT = "loss"


@dataclass(frozen=True)
class Threads:
    """ORT intra-op threads for the forward (eval) and backward (training) sessions."""

    forward: int = 1
    backward: int = 1


@dataclass
class BackwardResult:
    """What one micro-batch's backward produced."""

    loss: float | None
    prediction: np.ndarray | None
    input_gradients: dict[str, np.ndarray]


class StageSession:
    """A stage's ORT Training sessions, its parameters and its optimizer."""

    def __init__(self, entry: StageEntry, plan_dir: str | Path, training: TrainingConfig,
                 threads: Threads = Threads()):
        self.entry = entry
        self.training = training
        plan_dir = Path(plan_dir)
        api = training_api()
        self._state = api.CheckpointState.load_checkpoint(str(plan_dir / entry.artifact("checkpoint").path))
        self._forward_module = self._module(api, plan_dir, threads.forward)
        self._backward_module = (self._forward_module if threads.forward == threads.backward
                                 else self._module(api, plan_dir, threads.backward))
        self._eval_inputs = list(self._forward_module.eval().input_names())
        self._train_inputs = list(self._backward_module.train().input_names())
        self._train_outputs = list(self._backward_module.output_names())
        self._trainable = [p.name for p in entry.parameters if p.trainable]
        self._buffers = [p.name for p in entry.parameters if not p.trainable]
        self._gradient_to_input = {v: k for k, v in entry.input_gradients.items()}
        self.optimizer: Optimizer = make_optimizer(training)
        self._infer_session = None
        self._plan_dir = plan_dir
        # Guards parameters and optimizer state: the optimizer writes them, /weights reads them.
        self.lock = threading.RLock()

    def _module(self, api, plan_dir: Path, threads: int):
        from onnxruntime import SessionOptions

        options = SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        return api.Module(str(plan_dir / self.entry.artifact("training").path), self._state,
                          str(plan_dir / self.entry.artifact("eval").path), session_options=options)

    # -- running ---------------------------------------------------------------------------

    def forward(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the stage's forward on one micro-batch; returns its boundary outputs by name."""
        feeds = self._feeds(self._eval_inputs, inputs, self.entry.inputs)
        outputs = self._forward_module.eval()(*feeds)
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        return {t.name: value for t, value in zip(self.entry.outputs, outputs)}

    def backward(self, inputs: Mapping[str, np.ndarray], output_gradients: Mapping[str, np.ndarray] | None = None,
                 labels: Mapping[str, np.ndarray] | None = None, loss_scale: float = 1.0) -> BackwardResult:
        """Recompute the forward and run the backward of one micro-batch.

        Middle and first stages take the gradients of their outputs; the last stage takes
        the labels and ``loss_scale`` (micro-batch size / batch size). Parameter gradients
        accumulate until :meth:`step`.
        """
        values = dict(inputs)
        expected = list(self.entry.inputs)
        if self.entry.is_last:
            if labels is None:
                raise StageError(f"stage {self.entry.index} is the last stage: backward needs labels")
            values.update(labels)
            values[LOSS_SCALE_INPUT] = np.array(loss_scale, dtype=np.float32)
            expected += list(self.entry.labels)
        else:
            gradients = output_gradients or {}
            for output, grad_input in self.entry.output_gradients.items():
                if output not in gradients:
                    raise StageError(f"stage {self.entry.index}: backward needs the gradient of {output!r}")
                values[grad_input] = gradients[output]
            expected += [BoundaryTensor(g, t.dtype, t.shape) for t in self.entry.outputs
                         for o, g in self.entry.output_gradients.items() if o == t.name]
        feeds = self._feeds(self._train_inputs, values, expected)
        outputs = self._backward_module.train()(*feeds)
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        return self._collect(dict(zip(self._train_outputs, outputs)))

    def _collect(self, named: dict[str, np.ndarray]) -> BackwardResult:
        for output, buffer in self.entry.buffer_updates.items():
            self._state.parameters[buffer].data = named[output]
        loss = float(named[LOSS_OUTPUT]) if LOSS_OUTPUT in named else None
        prediction = named.get(self.entry.outputs[0].name) if self.entry.is_last else None
        gradients = {self._gradient_to_input[k]: v for k, v in named.items() if k in self._gradient_to_input}
        return BackwardResult(loss=loss, prediction=prediction, input_gradients=gradients)

    def step(self) -> None:
        """Apply the optimizer to the accumulated gradients, then clear them."""
        with self.lock:
            self.optimizer.step(self._parameter_views(), self._gradient_views())
            self._backward_module.lazy_reset_grad()

    def zero_grad(self) -> None:
        """Discard the accumulated gradients."""
        self._backward_module.lazy_reset_grad()

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Forward with inference-form normalisation (running statistics), for evaluation."""
        session = self._inference_session()
        feeds = {t.name: self._checked(t, inputs) for t in self.entry.inputs}
        feeds.update(self._parameter_views(include_buffers=True))
        outputs = session.run([t.name for t in self.entry.outputs], feeds)
        return {t.name: value for t, value in zip(self.entry.outputs, outputs)}

    def _inference_session(self):
        if self._infer_session is None:
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1
            options.log_severity_level = 3
            path = self._plan_dir / self.entry.artifact("infer").path
            self._infer_session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return self._infer_session

    # -- state -----------------------------------------------------------------------------

    def _parameter_views(self, include_buffers: bool = False) -> dict[str, np.ndarray]:
        names = self._trainable + (self._buffers if include_buffers else [])
        return {name: self._state.parameters[name].data for name in names}

    def _gradient_views(self) -> dict[str, np.ndarray]:
        gradients = {}
        for name in self._trainable:
            gradient = self._state.parameters[name].grad
            gradients[name] = gradient if gradient is not None else np.zeros_like(self._state.parameters[name].data)
        return gradients

    def parameters(self, include_buffers: bool = True) -> dict[str, np.ndarray]:
        """Copies of the stage's parameters (and running statistics), by name."""
        with self.lock:
            return {k: v.copy() for k, v in self._parameter_views(include_buffers).items()}

    def gradients(self) -> dict[str, np.ndarray]:
        """Copies of the accumulated parameter gradients, by name."""
        return {k: v.copy() for k, v in self._gradient_views().items()}

    def load_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters or running statistics by name; unknown names are an error."""
        known = set(self._trainable) | set(self._buffers)
        unknown = [n for n in values if n not in known]
        if unknown:
            raise StageError(f"stage {self.entry.index} has no parameter(s) {', '.join(unknown[:5])}")
        with self.lock:
            views = {name: self._state.parameters[name].data for name in values}
            for name, value in values.items():
                if views[name].shape != tuple(np.shape(value)):
                    raise StageError(f"parameter {name!r}: shape {list(np.shape(value))} "
                                     f"does not match {list(views[name].shape)}")
            for name, value in values.items():
                views[name][...] = value

    def optimizer_state(self) -> StateDict:
        with self.lock:
            return self.optimizer.state_dict()

    def load_optimizer_state(self, state: StateDict) -> None:
        unknown = [n for n in state if n not in self._trainable]
        if unknown:
            raise StageError(f"stage {self.entry.index} has no trainable parameter(s) {', '.join(unknown[:5])}")
        with self.lock:
            self.optimizer.load_state_dict(state)

    # -- checking inputs ---------------------------------------------------------------------

    def _feeds(self, order: list[str], values: Mapping[str, np.ndarray], expected: list[BoundaryTensor]) -> list:
        specs = {t.name: t for t in expected}
        feeds = []
        for name in order:
            if name not in values:
                raise StageError(f"stage {self.entry.index}: missing input {name!r}")
            spec = specs.get(name)
            feeds.append(self._checked(spec, values) if spec is not None else np.asarray(values[name]))
        return feeds

    def _checked(self, spec: BoundaryTensor, values: Mapping[str, np.ndarray]) -> np.ndarray:
        if spec.name not in values:
            raise StageError(f"stage {self.entry.index}: missing input {spec.name!r}")
        value = values[spec.name]
        if not isinstance(value, np.ndarray) or value.dtype != np.dtype(spec.dtype):
            got = getattr(value, "dtype", type(value).__name__)
            raise StageError(f"stage {self.entry.index}: input {spec.name!r} has dtype {got}, expected {spec.dtype}")
        if len(value.shape) != len(spec.shape) or any(
            d != "N" and int(d) != actual for d, actual in zip(spec.shape, value.shape)
        ):
            raise StageError(f"stage {self.entry.index}: input {spec.name!r} has shape {list(value.shape)}, "
                             f"expected {list(spec.shape)}")
        return np.ascontiguousarray(value)
