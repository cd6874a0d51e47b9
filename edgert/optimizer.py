"""AdamW and SGD applied in place to a stage's parameters, with state readable by name.

ORT's Python API keeps optimizer moments out of reach, but the runtime must move them
between workers (re-partitioning, replication). So the runtime steps the parameters
itself, in place in ORT's buffers. AdamW follows ORT's ``AdamWOptimizer`` (adam_mode 1,
the Hugging Face form) exactly; SGD adds PyTorch-style momentum and weight decay, which
ORT's SGD lacks. ``edgert check`` compares both against ORT's optimizer models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edgert.errors import EdgertError
from edgert.manifest import TrainingConfig

StateDict = dict[str, dict[str, np.ndarray]]


@dataclass
class _Slot:
    step: int
    buffers: dict[str, np.ndarray]


class Optimizer:
    """Base: per-parameter slots of named buffers plus a step count."""

    buffer_names: tuple[str, ...] = ()

    def __init__(self, config: TrainingConfig):
        self.config = config
        self.learning_rate = config.learning_rate
        self._slots: dict[str, _Slot] = {}

    def step(self, parameters: Mapping[str, np.ndarray], gradients: Mapping[str, np.ndarray]) -> None:
        """Update every parameter in place from its gradient."""
        for name, parameter in parameters.items():
            gradient = gradients[name]
            slot = self._slots.get(name)
            if slot is None:
                slot = self._slots[name] = _Slot(0, {b: np.zeros_like(parameter) for b in self.buffer_names})
            slot.step += 1
            self._update(parameter, gradient, slot)

    def _update(self, parameter: np.ndarray, gradient: np.ndarray, slot: _Slot) -> None:
        raise NotImplementedError

    def state_dict(self, names: list[str] | None = None) -> StateDict:
        """Copies of the optimizer state of ``names`` (default: all), by parameter name."""
        wanted = self._slots if names is None else {n: self._slots[n] for n in names if n in self._slots}
        return {name: {"step": np.array(slot.step, dtype=np.int64), **{k: v.copy() for k, v in slot.buffers.items()}}
                for name, slot in wanted.items()}

    def load_state_dict(self, state: StateDict) -> None:
        """Replace the state of the parameters named in ``state`` (others are kept)."""
        for name, entry in state.items():
            missing = [b for b in (*self.buffer_names, "step") if b not in entry]
            if missing:
                raise EdgertError(f"optimizer state for {name!r} lacks {', '.join(missing)}")
            buffers = {b: np.array(entry[b], dtype=np.float32, copy=True) for b in self.buffer_names}
            self._slots[name] = _Slot(int(entry["step"]), buffers)

    def forget(self, names: list[str]) -> None:
        """Drop the state of parameters this stage no longer owns."""
        for name in names:
            self._slots.pop(name, None)


class AdamW(Optimizer):
    """Decoupled weight decay Adam, identical to ORT's AdamWOptimizer in adam_mode 1."""

    buffer_names = ("exp_avg", "exp_avg_sq")

    def _update(self, parameter: np.ndarray, gradient: np.ndarray, slot: _Slot) -> None:
        beta1, beta2 = self.config.betas
        lr = self.learning_rate
        exp_avg, exp_avg_sq = slot.buffers["exp_avg"], slot.buffers["exp_avg_sq"]
        exp_avg *= beta1
        exp_avg += (1.0 - beta1) * gradient
        exp_avg_sq *= beta2
        exp_avg_sq += (1.0 - beta2) * gradient * gradient
        step_size = lr * math.sqrt(1.0 - beta2 ** slot.step) / (1.0 - beta1 ** slot.step)
        denominator = np.sqrt(exp_avg_sq)
        denominator += self.config.eps
        parameter -= step_size * exp_avg / denominator
        if self.config.weight_decay:
            parameter -= (lr * self.config.weight_decay) * parameter


class SGD(Optimizer):
    """SGD with optional momentum and (coupled, PyTorch-style) weight decay."""

    buffer_names = ("momentum_buffer",)

    def _update(self, parameter: np.ndarray, gradient: np.ndarray, slot: _Slot) -> None:
        direction = gradient
        if self.config.weight_decay:
            direction = direction + self.config.weight_decay * parameter
        if self.config.momentum:
            buffer = slot.buffers["momentum_buffer"]
            if slot.step == 1:
                buffer[...] = direction
            else:
                buffer *= self.config.momentum
                buffer += direction
            direction = buffer
        parameter -= self.learning_rate * direction


def make_optimizer(config: TrainingConfig) -> Optimizer:
    """The runtime optimizer a manifest's training config asks for."""
    kinds = {"adamw": AdamW, "sgd": SGD}
    if config.optimizer not in kinds:
        raise EdgertError(f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(kinds)}")
    return kinds[config.optimizer](config)
