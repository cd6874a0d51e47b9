"""Portable stage graphs against the training build's, stage by stage, in one run.

Every zoo model is cut into ``--stages`` stages twice from the same slices: once with the
portable gradient graphs a board runs (stock onnxruntime operators only) and once with the
training build's own operators (``ConvGrad``, ``BatchNormalizationGrad``...). Each stage
then trains here through the runtime's :class:`StageSession`, 1 intra-op thread, a
micro-batch of ``--batch`` samples: forward (not on the last stage) + backward + optimizer
step, in both memory modes. The two kinds alternate, ``--rounds`` times, and each takes the
median of ``--repeat`` steps per round, so drift of this host's speed hits both alike.

Reported: per stage and mode, portable / training time; the geometric mean over all of
them and the worst one (targets: <= 1.15 and <= 1.5, issue 14). Both kinds run on this
host's training build, which also runs standard operators: the ratio is the cost of the
portable form itself, not of a different onnxruntime.

Run by ``edgert bench portable`` (edgert/cli/bench.py).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before onnxruntime loads

import numpy as np  # noqa: E402

from edgert.bench.harness import (  # noqa: E402
    Column,
    Progress,
    Target,
    geomean,
    option,
    progress_field,
    result,
    table,
    target_lines,
)
from edgert.errors import EdgertError  # noqa: E402
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan  # noqa: E402
from edgert.exporter.source import from_model_proto  # noqa: E402
from edgert.manifest import MEMORY_MODES, StageEntry, load_manifest  # noqa: E402
from edgert.models import build_model, list_models  # noqa: E402
from edgert.stage import StageSession, Threads  # noqa: E402

KINDS = ("portable", "training")
TARGETS = (  # issue 14
    Target("portable_vs_training_geomean", "<=", 1.15, "portable / training build, geometric mean over the stages"),
    Target("portable_vs_training_worst", "<=", 1.5, "portable / training build, the worst stage"),
)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; the defaults are the documented run (docs/EXPORTER.md)."""

    models: tuple[str, ...] = option(tuple(spec.name for spec in list_models()), "Zoo models, comma-separated.",
                                     parse=lambda text: tuple(text.split(",")), show=",".join)
    stages: int = option(2, "Stages each model is cut into.")
    batch: int = option(64, "Samples per micro-batch.")
    rounds: int = option(5, "Rounds of the two kinds, alternating.")
    repeat: int = option(10, "Steps per kind and round (their median counts).")
    progress: Progress = progress_field()

    def check(self) -> None:
        if self.rounds < 1 or self.repeat < 1 or self.stages < 1:
            raise EdgertError("--rounds, --repeat and --stages must be at least 1")


def export_both(name: str, stages: int, folder: Path) -> dict[str, Path]:
    """The model cut once, written with portable and with training-build gradient graphs."""
    source = from_model_proto(build_model(name), f"{name}.onnx")
    options = ExportOptions(stages=stages)
    analysis = prepare_analysis(source, options)
    cuts = choose_cuts(analysis, options)
    plans = {}
    for kind in KINDS:
        plans[kind] = folder / f"{name}-{kind}"
        write_plan(source, analysis, cuts, plans[kind], options.training, portable=kind == "portable")
    return plans


class StageStep:
    """One stage's forward + backward + optimizer step on a fixed random micro-batch."""

    def __init__(self, plan: Path, index: int, mode: str, batch: int):
        manifest = load_manifest(plan)
        self.entry: StageEntry = manifest.stages[index]
        self.session = StageSession(self.entry, plan, manifest.training, Threads(1, 1), mode)
        rng = np.random.default_rng(0)
        self.inputs = {t.name: t.sample(rng, batch, 4) for t in self.entry.inputs}
        self.grads = {t.name: t.sample(rng, batch) for t in self.entry.outputs
                      if t.name in self.entry.output_gradients} or None
        self.labels = {t.name: t.sample(rng, batch) for t in self.entry.labels} or None

    def __call__(self) -> None:
        self.session.train_micro_batch(self.inputs, self.grads, self.labels)
        self.session.step()

    def median_seconds(self, repeat: int) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            self()
            times.append(time.perf_counter() - start)
        return float(np.median(times))


def measure(plans: dict[str, Path], index: int, mode: str, batch: int, rounds: int, repeat: int) -> dict:
    steps = {kind: StageStep(plans[kind], index, mode, batch) for kind in KINDS}
    for step in steps.values():
        for _ in range(3):
            step()  # warm-up: first runs allocate and tune
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(rounds):
        for kind in KINDS:
            times[kind].append(steps[kind].median_seconds(repeat))
    portable, training = (float(np.median(times[k])) for k in KINDS)
    return {"portable_ms": portable * 1e3, "training_ms": training * 1e3, "ratio": portable / training}


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    """Every stage of every model, in both memory modes; returns ``{"rows": [...], "ratios": {...}, ...}``."""
    config.check()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgert-bench-portable-") as scratch:
        for name in config.models:
            plans = export_both(name, config.stages, Path(scratch))
            for index in range(len(load_manifest(plans["portable"]).stages)):
                for mode in MEMORY_MODES:
                    if mode == "stash" and index == config.stages - 1:
                        continue
                    row = {"model": name, "stage": index, "mode": mode,
                           **measure(plans, index, mode, config.batch, config.rounds, config.repeat)}
                    rows.append(row)
                    config.progress(f"{name:17s} stage {index} {mode:9s} portable {row['portable_ms']:7.2f} ms  "
                                    f"training build {row['training_ms']:7.2f} ms  ratio {row['ratio']:.3f}")
    ratios = [row["ratio"] for row in rows]
    figures = {"portable_vs_training_geomean": geomean(ratios), "portable_vs_training_worst": max(ratios)}
    return result(rows, figures, worst_stage=max(rows, key=lambda row: row["ratio"]),
                  targets={target.figure: target.bound for target in TARGETS},
                  batch=config.batch, stages=config.stages, threads=1)


COLUMNS = (Column("model", 18, "model", left=True), Column("stage", 5, "stage"),
           Column("  mode", 11, lambda row: f"  {row['mode']}", left=True),
           Column("portable ms", 12, "portable_ms", "{:.2f}"), Column("training ms", 13, "training_ms", "{:.2f}"),
           Column("ratio", 8, "ratio", "{:.3f}"))


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report."""
    worst = result["worst_stage"]
    return "\n".join([
        f"Portable vs training-build stage graphs (micro-batch {result['batch']}, {result['stages']} stages, "
        f"1 thread)", *table(COLUMNS, result["rows"]), "",
        f"worst: {worst['model']} stage {worst['stage']} {worst['mode']}", "",
        *target_lines(TARGETS, result["ratios"])])
