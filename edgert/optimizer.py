"""AdamW and SGD applied in place to a stage's parameters, with state readable by name.

ORT's Python API keeps optimizer moments out of reach, but the runtime must move them
between workers (re-partitioning, replication). So the runtime steps the parameters
itself, in place in ORT's buffers. AdamW follows ORT's ``AdamWOptimizer`` (adam_mode 1,
the Hugging Face form) exactly; SGD adds PyTorch-style momentum and weight decay, which
ORT's SGD lacks. ``edgert check`` compares both against ORT's optimizer models.

Parameters, gradients and optimizer state live in flat float32 vectors with one slice per
parameter (:class:`FlatParameters`), so a step is a dozen in-place vector operations
however many parameters the stage has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from edgert.errors import EdgertError
from edgert.manifest import TrainingConfig

StateDict = dict[str, dict[str, np.ndarray]]


class FlatParameters:
    """Named parameters stored as slices of one flat float32 vector (float64 for ``edgert check``'s reference).

    The optimizer then steps every parameter with a handful of whole-vector operations, and
    ORT reads each parameter through a contiguous view, without copies.
    """

    def __init__(self, values: Mapping[str, np.ndarray], dtype: type = np.float32):
        self.names = list(values)
        self.shapes = {name: tuple(np.shape(value)) for name, value in values.items()}
        self.slices: dict[str, slice] = {}
        offset = 0
        for name in self.names:
            size = int(np.prod(self.shapes[name], dtype=np.int64))
            self.slices[name] = slice(offset, offset + size)
            offset += size
        self.flat = np.zeros(offset, dtype)
        self.views = {name: self.flat[self.slices[name]].reshape(self.shapes[name]) for name in self.names}
        for name, value in values.items():
            self.views[name][...] = value

    def zeros(self) -> np.ndarray:
        """A flat vector with this layout, zeroed (gradients, optimizer buffers)."""
        return np.zeros_like(self.flat)

    def piece(self, flat: np.ndarray, name: str) -> np.ndarray:
        """``name``'s part of a flat vector with this layout, shaped like the parameter."""
        return flat[self.slices[name]].reshape(self.shapes[name])


class Optimizer:
    """Base: named buffers laid out like the parameters, and one step count."""

    buffer_names: tuple[str, ...] = ()

    def __init__(self, config: TrainingConfig):
        self.config = config
        self.learning_rate = config.learning_rate
        self.steps = 0
        self._layout: FlatParameters | None = None
        self._buffers: dict[str, np.ndarray] = {}
        self._scratch = np.zeros(0, np.float32)
        self._pending: StateDict = {}  # loaded before the first step: applied once laid out

    def step(self, parameters: FlatParameters, gradient: np.ndarray) -> None:
        """Update ``parameters.flat`` in place from the flat ``gradient`` (which it may overwrite)."""
        if not parameters.names:
            return
        if self._layout is not parameters:
            self._adopt(parameters)
        self.steps += 1
        self._update(parameters.flat, gradient)

    def _adopt(self, parameters: FlatParameters) -> None:
        known = {**self._laid_out_state(), **self._pending}
        self._layout = parameters
        self._buffers = {b: parameters.zeros() for b in self.buffer_names}
        self._scratch = parameters.zeros()
        self._pending = {}
        self._restore(known)

    def _update(self, parameter: np.ndarray, gradient: np.ndarray) -> None:
        raise NotImplementedError

    def _laid_out_state(self) -> StateDict:
        if self.steps == 0 or self._layout is None:
            return {}
        layout = self._layout
        return {name: {"step": np.array(self.steps, dtype=np.int64),
                       **{b: layout.piece(self._buffers[b], name).copy() for b in self.buffer_names}}
                for name in layout.names}

    def state_dict(self, names: list[str] | None = None) -> StateDict:
        """Copies of the optimizer state of ``names`` (default: all), by parameter name."""
        state = {**self._laid_out_state(), **self._pending}
        return state if names is None else {n: state[n] for n in names if n in state}

    def load_state_dict(self, state: StateDict) -> None:
        """Replace the state of the parameters named in ``state`` (others are kept)."""
        for name, entry in state.items():
            missing = [b for b in (*self.buffer_names, "step") if b not in entry]
            if missing:
                raise EdgertError(f"optimizer state for {name!r} lacks {', '.join(missing)}")
        steps = {int(entry["step"]) for entry in state.values()}
        if len(steps) > 1:
            raise EdgertError(f"optimizer states disagree on the step count: {sorted(steps)}")
        if steps:
            self.steps = steps.pop()
            self._restore(state)

    def _restore(self, state: StateDict) -> None:
        layout = self._layout
        for name, entry in state.items():
            if layout is None or name not in layout.slices:
                self._pending[name] = entry
                continue
            for b in self.buffer_names:
                value = np.asarray(entry[b], np.float32)
                if value.shape != layout.shapes[name]:
                    raise EdgertError(f"optimizer state {name}#{b} has shape {list(value.shape)}, "
                                      f"the parameter {list(layout.shapes[name])}")
                layout.piece(self._buffers[b], name)[...] = value


class AdamW(Optimizer):
    """Decoupled weight decay Adam, identical to ORT's AdamWOptimizer in adam_mode 1."""

    buffer_names = ("exp_avg", "exp_avg_sq")

    def _update(self, parameter: np.ndarray, gradient: np.ndarray) -> None:
        beta1, beta2 = self.config.betas
        lr = self.learning_rate
        exp_avg, exp_avg_sq, scratch = self._buffers["exp_avg"], self._buffers["exp_avg_sq"], self._scratch
        exp_avg *= beta1
        np.multiply(gradient, 1.0 - beta1, out=scratch)
        exp_avg += scratch
        exp_avg_sq *= beta2
        np.multiply(gradient, gradient, out=scratch)
        scratch *= 1.0 - beta2
        exp_avg_sq += scratch
        step_size = lr * math.sqrt(1.0 - beta2 ** self.steps) / (1.0 - beta1 ** self.steps)
        np.sqrt(exp_avg_sq, out=scratch)
        scratch += self.config.eps
        np.divide(exp_avg, scratch, out=scratch)
        scratch *= step_size
        parameter -= scratch
        if self.config.weight_decay:
            np.multiply(parameter, lr * self.config.weight_decay, out=scratch)
            parameter -= scratch


class SGD(Optimizer):
    """SGD with optional momentum and (coupled, PyTorch-style) weight decay."""

    buffer_names = ("momentum_buffer",)

    def _update(self, parameter: np.ndarray, gradient: np.ndarray) -> None:
        direction = gradient
        if self.config.weight_decay:
            np.multiply(parameter, self.config.weight_decay, out=self._scratch)
            direction += self._scratch
        if self.config.momentum:
            buffer = self._buffers["momentum_buffer"]
            if self.steps == 1:
                buffer[...] = direction
            else:
                buffer *= self.config.momentum
                buffer += direction
            direction = buffer
        np.multiply(direction, self.learning_rate, out=self._scratch)
        parameter -= self._scratch


def make_optimizer(config: TrainingConfig) -> Optimizer:
    """The runtime optimizer a manifest's training config asks for."""
    kinds = {"adamw": AdamW, "sgd": SGD}
    if config.optimizer not in kinds:
        raise EdgertError(f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(kinds)}")
    return kinds[config.optimizer](config)
