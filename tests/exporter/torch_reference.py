"""The torch side of the coverage comparison: the reference model an export stands for, which torch tensor each
trained ONNX initializer is, and torch autograd's loss and gradients in float64 and float32.

The reference is the torch model in training mode (edgert removes Dropout and trains every BatchNorm with
batch statistics, and the zoo's dropout probabilities are 0). Where the export folded BatchNorm into the
convolutions before it (the TorchScript exporter in eval mode; the dynamo exporter in either mode), the
reference folds the same Conv->BatchNorm pairs (``torch.fx.experimental.optimization.fuse``), so both
sides compute the same function of the same parameters.

Each trainable initializer of the plan is matched to the reference's parameters: by name and value, else
by value alone (a folded ``onnx::Conv_12``, or a dynamo export's folded ``conv1.weight``), or transposed (a
Linear weight folded into a MatMul's ``onnx::MatMul_7``), else element by element (an LSTM's packed,
gate-reordered weights): its reference gradient is then the torch gradient gathered the same way. The
reference's parameters are then set to the plan's exact values.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

VALUE_RTOL = 1e-4  # a folded weight computed by the exporter vs by torch.fx: equal to float32 rounding
VALUE_ATOL = 1e-6


@dataclass(frozen=True)
class Source:
    """Where one trained ONNX initializer comes from in the reference: ``indices`` into the flat concatenation
    of the reference's parameters (``ParameterPool``), in the initializer's element order."""

    torch_names: tuple[str, ...]
    indices: np.ndarray

    @property
    def group(self) -> str:
        """The module that owns it: its parameters are judged together (a bias beside its weight)."""
        return self.torch_names[0].rsplit(".", 1)[0]


def reference_module(module: nn.Module, batchnorm_nodes: int) -> nn.Module:
    """``module`` in training mode, with Conv->BatchNorm pairs folded when the export kept fewer than
    ``batchnorm_nodes`` of its BatchNorm layers."""
    norms = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
    if norms == batchnorm_nodes:
        return module.train()
    from torch.fx.experimental.optimization import fuse

    fused = fuse(module.eval())
    left = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules())
    if left != batchnorm_nodes:
        raise ReferenceError(f"the export kept {batchnorm_nodes} of {norms} BatchNorm layers; folding every "
                             f"Conv->BatchNorm pair in torch keeps {left}")
    for parameter in fused.parameters():  # torch makes the bias it folds into a bias-free conv with no grad
        parameter.requires_grad_(True)
    return fused.train()


class ReferenceError(Exception):
    """The torch reference cannot stand for the export (a harness limit, not an edgert result)."""


class ParameterPool:
    """The reference's parameters as one flat float64 vector, to match and gather ONNX initializers from."""

    def __init__(self, module: nn.Module):
        self.names = [name for name, _ in module.named_parameters()]
        values = [p.detach().double().reshape(-1).numpy() for _, p in module.named_parameters()]
        self.sizes = [v.size for v in values]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.flat = np.concatenate(values) if values else np.zeros(0)
        self.shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        self.taken = np.zeros(self.flat.size, dtype=bool)

    def owner(self, index: int) -> str:
        return self.names[int(np.searchsorted(self.offsets, index, side="right")) - 1]

    def whole(self, name: str) -> np.ndarray:
        k = self.names.index(name)
        return np.arange(self.offsets[k], self.offsets[k + 1])

    def match_all(self, values: dict[str, np.ndarray]) -> tuple[dict[str, Source], list[str]]:
        """Sources of the ONNX initializers ``values``, and the names of those matched to nothing."""
        sources, unmatched = {}, []
        order = sorted(values, key=lambda n: (n not in self.shapes, n))  # names shared with torch first
        for name in order:
            source = self._match_whole(name, values[name])
            if source is not None:
                sources[name] = source
                self.taken[source.indices] = True
            else:
                unmatched.append(name)
        for name in list(unmatched):
            source = self._match_elements(values[name])
            if source is not None:
                sources[name] = source
                self.taken[source.indices] = True
                unmatched.remove(name)
        return sources, unmatched

    def _match_whole(self, name: str, value: np.ndarray) -> Source | None:
        candidates = [name] if name in self.shapes else []
        candidates += [n for n in self.names if n != name and self.shapes[n] == value.shape]
        for candidate in candidates:
            indices = self.whole(candidate)
            if self.shapes[candidate] != value.shape or self.taken[indices].any():
                continue
            if np.allclose(self.flat[indices], value.reshape(-1), rtol=VALUE_RTOL, atol=VALUE_ATOL):
                return Source((candidate,), indices)
        if value.ndim == 2:  # a Linear weight an eval export folded into a MatMul's [in, out]
            for candidate in [n for n in self.names if self.shapes[n] == value.shape[::-1]]:
                indices = self.whole(candidate).reshape(value.shape[::-1]).T.reshape(-1)
                if not self.taken[indices].any() and np.allclose(self.flat[indices], value.reshape(-1),
                                                                 rtol=VALUE_RTOL, atol=VALUE_ATOL):
                    return Source((candidate,), indices)
        return None

    def _match_elements(self, value: np.ndarray) -> Source | None:
        """Each element found once, by exact value, among the reference's untaken elements (a permuted copy)."""
        free = np.flatnonzero(~self.taken)
        if value.size == 0 or free.size == 0:
            return None
        order = free[np.argsort(self.flat[free], kind="stable")]
        pool = self.flat[order]
        wanted = value.reshape(-1).astype(np.float64)
        at = np.searchsorted(pool, wanted)
        if np.any(at >= pool.size) or not np.array_equal(pool[np.minimum(at, pool.size - 1)], wanted):
            return None
        unique = np.ones(wanted.size, dtype=bool)
        after = at + 1
        unique[after < pool.size] = pool[after[after < pool.size]] != wanted[after < pool.size]
        indices = order[at]
        if not unique.all() or np.unique(indices).size != indices.size:
            return None
        return Source(tuple(dict.fromkeys(self.owner(i) for i in indices[: min(indices.size, 4096)])), indices)

    def load_into(self, module: nn.Module, sources: dict[str, Source], values: dict[str, np.ndarray]) -> None:
        """Set the reference's matched parameters to the ONNX initializers' exact values."""
        flat = self.flat.copy()
        for name, source in sources.items():
            flat[source.indices] = values[name].reshape(-1)
        with torch.no_grad():
            for k, (_, parameter) in enumerate(module.named_parameters()):
                piece = flat[self.offsets[k]:self.offsets[k + 1]].reshape(parameter.shape)
                parameter.copy_(torch.from_numpy(piece).to(parameter.dtype))
        self.flat = flat

    def gather(self, gradients: dict[str, np.ndarray], sources: dict[str, Source],
               shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """Torch ``gradients`` (by torch name) laid out as the ONNX initializers they were matched to."""
        flat = np.concatenate([gradients[n].reshape(-1) for n in self.names]) if self.names else np.zeros(0)
        return {name: flat[source.indices].reshape(shapes[name]) for name, source in sources.items()}


def loss_and_gradients(module: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy of one batch and every parameter's gradient, computed by torch in ``dtype``."""
    model = copy.deepcopy(module).to(dtype).train()
    model.zero_grad(set_to_none=True)
    features = inputs.to(dtype) if inputs.is_floating_point() else inputs
    loss = nn.functional.cross_entropy(model(features), labels)
    loss.backward()
    gradients = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().numpy()
                 for name, p in model.named_parameters()}
    return float(loss.detach()), gradients


def sgd_run(module: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], learning_rate: float,
            dtype: torch.dtype = torch.float64) -> tuple[list[float], dict[str, np.ndarray]]:
    """Plain SGD in ``dtype`` over ``batches`` in order: each step's loss, and the parameters at the end."""
    model = copy.deepcopy(module).to(dtype).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    losses = []
    for inputs, labels in batches:
        optimizer.zero_grad(set_to_none=True)
        features = inputs.to(dtype) if inputs.is_floating_point() else inputs
        loss = nn.functional.cross_entropy(model(features), labels)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach().double().numpy().copy() for name, p in model.named_parameters()}


def group_errors(reference: dict[str, np.ndarray], values: dict[str, np.ndarray], groups: dict[str, str]
                 ) -> dict[str, float]:
    """Per group g: max over tensors t of g of max|values[t] - reference[t]| / (largest |reference| over g)."""
    scale: dict[str, float] = {}
    for name, ref in reference.items():
        scale[groups[name]] = max(scale.get(groups[name], 0.0), float(np.max(np.abs(ref), initial=0.0)))
    errors: dict[str, float] = {}
    for name, ref in reference.items():
        group = groups[name]
        difference = float(np.max(np.abs(np.asarray(values[name], np.float64) - ref), initial=0.0))
        errors[group] = max(errors.get(group, 0.0), difference / scale[group] if scale[group] > 0 else difference)
    return errors
