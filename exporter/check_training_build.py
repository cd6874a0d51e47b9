"""``edgert check --reference training-build``: each stage's graphs against the training build's.

For each stage and each memory mode, the plan's graphs (edgert's gradients) and the same stage
written by the ONNX Runtime training build's gradient builder (exporter/training_build.py), both
run by the runtime's :class:`StageSession`, take the same inputs: the stage's boundary inputs
for the check's seeded batch and seeded gradients of its outputs (or the labels). Their
parameter gradients, boundary-input gradients and updated running statistics must agree.
Runs only where the training build is installed (the ``reference`` extra).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from edgert.exporter.check import relative_difference
from edgert.exporter.training_build import reference_plan
from edgert.manifest import MEMORY_MODES, Manifest, StageEntry, load_manifest
from edgert.stage import StageSession

TRAINING_BUILD_TOLERANCE = 1e-5


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
class StageComparison:
    """Largest relative differences of one stage's graphs from the training build's, in one memory mode."""

    stage: int
    memory_mode: str
    max_param_grad_rel_diff: float
    max_input_grad_rel_diff: float
    max_statistics_rel_diff: float

    @property
    def largest(self) -> float:
        return max(self.max_param_grad_rel_diff, self.max_input_grad_rel_diff, self.max_statistics_rel_diff)

    @property
    def ok(self) -> bool:
        return self.largest <= TRAINING_BUILD_TOLERANCE


def compare_with_training_build(plan_dir: Path, manifest: Manifest, stage_inputs: list[dict[str, np.ndarray]],
                                labels: Mapping[str, np.ndarray], seed: int, scratch: Path
                                ) -> tuple[list[StageComparison], list[str]]:
    """Per stage and memory mode, the plan's graphs against the training build's; also notes on stages skipped."""
    reference_dir = scratch / "plan"
    reference_plan(plan_dir, reference_dir)
    reference = load_manifest(reference_dir)
    comparisons, notes = [], []
    rng = np.random.default_rng(seed + 1)
    for entry, built, inputs in zip(manifest.stages, reference.stages, stage_inputs):
        gaps = training_build_gaps(onnx.load(str(plan_dir / entry.artifact("eval").path)).graph.node)
        if gaps:
            notes.append(f"stage {entry.index}: not compared with the training build, whose {', '.join(gaps)} "
                         f"cannot serve as a reference")
            continue
        batch = len(next(iter(inputs.values())))
        grads = {} if entry.is_last else {t.name: t.sample(rng, batch) for t in entry.outputs
                                           if t.name in entry.output_gradients}
        stage_labels = dict(labels) if entry.is_last else None
        for mode in MEMORY_MODES:
            if mode == "stash" and entry.is_last:
                continue
            expected = _step(reference_dir, reference, built, mode, inputs, grads, stage_labels)
            got = _step(plan_dir, manifest, entry, mode, inputs, grads, stage_labels)
            comparisons.append(StageComparison(entry.index, mode, *(relative_difference(expected[k], got[k])[1]
                                                                    for k in ("params", "inputs", "statistics"))))
    return comparisons, notes


def _step(plan_dir: Path, manifest: Manifest, entry: StageEntry, mode: str, inputs, grads, labels
          ) -> dict[str, dict]:
    """One forward + backward of ``entry`` through the runtime's own session, in memory mode ``mode``."""
    session = StageSession(entry, plan_dir, manifest.training, memory_mode=mode)
    result = session.train_micro_batch(inputs, grads or None, labels)
    statistics = session.parameters(include_buffers=True)
    return {
        "params": session.gradients(),
        "inputs": result.input_gradients,
        "statistics": {name: statistics[name] for name in entry.buffer_updates.values()},
    }
