"""``edgert check``, stage by stage: the portable graphs a board runs against the training build's own.

For each stage and each memory mode, the portable graphs (``backward.onnx``, or
``forward_stash.onnx`` + ``backward_stash.onnx``, run by the runtime's :class:`StageSession`)
and the training build's ``training.onnx`` (run by ORT's own ``Module``) take the same
inputs: the stage's boundary inputs for the check's seeded batch and seeded gradients of its
outputs (or the labels). Their parameter gradients, boundary-input gradients and updated
running statistics must agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from edgert.exporter.ort_training import training_api
from edgert.manifest import MEMORY_MODES, Manifest, StageEntry
from edgert.stage import StageSession

PORTABLE_TOLERANCE = 1e-5


def training_build_gaps(nodes: Iterable[onnx.NodeProto]) -> list[str]:
    """What in ``nodes`` the training build (ORT 1.19.2) cannot differentiate correctly on the CPU.

    A session loading its AveragePoolGrad crashes, it has no CPU ConvTransposeGrad, and its
    ConvGrad ignores ``auto_pad`` SAME_*. The portable forms of these are checked against
    central differences (tests/exporter/test_portable_ops.py); a plan using them is compared
    with its unsplit portable self instead of the training build.
    """
    gaps = set()
    for node in nodes:
        if node.op_type == "AveragePool":
            gaps.add("AveragePoolGrad (crashes)")
        elif node.op_type == "ConvTranspose":
            gaps.add("ConvTransposeGrad (no CPU kernel)")
        elif node.op_type == "Conv" and any(a.name == "auto_pad" and a.s.startswith(b"SAME") for a in node.attribute):
            gaps.add("ConvGrad with auto_pad SAME (wrong results)")
    return sorted(gaps)


@dataclass
class PortableDiff:
    """Largest relative differences of one stage's portable graphs from the training build's, in one memory mode."""

    stage: int
    memory_mode: str
    max_param_grad_rel_diff: float
    max_input_grad_rel_diff: float
    max_statistics_rel_diff: float

    @property
    def largest(self) -> float:
        return max(self.max_param_grad_rel_diff, self.max_input_grad_rel_diff, self.max_statistics_rel_diff)


def compare_portable(plan_dir: Path, manifest: Manifest, stage_inputs: list[dict[str, np.ndarray]],
                     labels: Mapping[str, np.ndarray], seed: int) -> tuple[list[PortableDiff], list[str]]:
    """Per stage and memory mode, the portable graphs against ``training.onnx``; also notes on stages skipped."""
    diffs, notes = [], []
    rng = np.random.default_rng(seed + 1)
    for entry, inputs in zip(manifest.stages, stage_inputs):
        gaps = training_build_gaps(onnx.load(str(plan_dir / entry.artifact("eval").path)).graph.node)
        if gaps:
            notes.append(f"stage {entry.index}: not compared with the training build, whose {', '.join(gaps)} "
                         f"cannot serve as a reference")
            continue
        batch = len(next(iter(inputs.values())))
        grads = {} if entry.is_last else {t.name: t.sample(rng, batch) for t in entry.outputs
                                           if t.name in entry.output_gradients}
        stage_labels = dict(labels) if entry.is_last else None
        reference = _training_build_step(plan_dir, entry, inputs, grads, stage_labels)
        for mode in MEMORY_MODES:
            if mode == "stash" and entry.is_last:
                continue
            portable = _portable_step(plan_dir, manifest, entry, mode, inputs, grads, stage_labels)
            diffs.append(PortableDiff(entry.index, mode, *(relative_difference(reference[k], portable[k])[1]
                                                           for k in ("params", "inputs", "statistics"))))
    return diffs, notes


def _step_feeds(entry: StageEntry, inputs: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
                labels: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    feeds = dict(inputs)
    feeds.update({entry.output_gradients[name]: value for name, value in grads.items()})
    if labels is not None:
        feeds.update(labels)
        feeds["loss_scale"] = np.array(1.0, dtype=np.float32)
    return feeds


def _training_build_step(plan_dir: Path, entry: StageEntry, inputs, grads, labels) -> dict[str, dict]:
    """One forward + backward of ``training.onnx`` with ORT's Module: what the training build computes."""
    api = training_api()
    state = api.CheckpointState.load_checkpoint(str(plan_dir / entry.artifact("checkpoint").path))
    module = api.Module(str(plan_dir / entry.artifact("training").path), state)
    module.train()
    feeds = _step_feeds(entry, inputs, grads, labels)
    outputs = module(*[feeds[name] for name in module.input_names()])
    named = dict(zip(module.output_names(), outputs if isinstance(outputs, (list, tuple)) else [outputs]))
    trainable = [p.name for p in entry.parameters if p.trainable]
    return {
        "params": {p: np.array(state.parameters[p].grad) for p in trainable},
        "inputs": {name: named[exposed] for name, exposed in entry.input_gradients.items()},
        "statistics": {entry.buffer_updates[out]: named[out] for out in entry.buffer_updates if out in named},
    }


def _portable_step(plan_dir: Path, manifest: Manifest, entry: StageEntry, mode: str, inputs, grads, labels
                   ) -> dict[str, dict]:
    """The same step through the runtime's own session, on the portable graphs of ``mode``."""
    session = StageSession(entry, plan_dir, manifest.training, memory_mode=mode)
    result = session.train_micro_batch(inputs, grads or None, labels)
    statistics = session.parameters(include_buffers=True)
    return {
        "params": session.gradients(),
        "inputs": result.input_gradients,
        "statistics": {name: statistics[name] for name in entry.buffer_updates.values()},
    }


def relative_difference(reference: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray]
                        ) -> tuple[float, float]:
    """Largest absolute difference over a group of tensors, and that relative to the group's largest reference value.

    Relative to the group rather than to each tensor: a tensor whose exact gradient is zero (a
    bias before BatchNorm, an attention key bias) holds rounding noise that Adam amplifies,
    and is meaningless relative to itself.
    """
    if not reference:
        return 0.0, 0.0
    difference = max(float(np.max(np.abs(np.asarray(values[k], np.float64) - reference[k]), initial=0.0))
                     for k in reference)
    scale = max(float(np.max(np.abs(reference[k]), initial=0.0)) for k in reference)
    return difference, (difference / scale if scale > 0 else difference)
