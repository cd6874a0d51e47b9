"""edgert's gradient graphs against a baseline's, stage by stage, in one run.

Every zoo model is cut into ``--stages`` stages and written with edgert's gradient graphs
(exporter/gradients), then again with the same cuts by a baseline:
- ``training``: the ONNX Runtime training build's own gradient graphs (``ConvGrad``,
  ``BatchNormalizationGrad``...; exporter/training_build.py), where the training build is
  installed (the ``reference`` extra), which runs standard operators too;
- ``against``: the plans in ``--against DIR`` (``DIR/<model>-<stages>``, exported by another
  edgert: the release before, say), checked to have the same cuts.
Each stage then trains here through the runtime's :class:`StageSession`, 1 intra-op thread, a
micro-batch of ``--batch`` samples: forward (not on the last stage) + backward + optimizer
step, in both memory modes. The kinds alternate, ``--rounds`` times, and each takes the
median of ``--repeat`` steps per round, so drift of this host's speed hits all alike.

Reported: per stage and mode, edgert / baseline time; per baseline the geometric mean over all
of them and the worst one (targets, issue 29: <= 1.0 against the training build, <= 1.05
against the portable graphs of the release before).

Run by ``edgert bench gradients`` (edgert/cli/bench.py).
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
from edgert.errors import EdgertError, MissingDependencyError  # noqa: E402
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan  # noqa: E402
from edgert.exporter.source import from_model_proto  # noqa: E402
from edgert.manifest import MEMORY_MODES, StageEntry, load_manifest  # noqa: E402
from edgert.models import build_model, list_models  # noqa: E402
from edgert.ort_import import training_folder  # noqa: E402
from edgert.stage import StageSession, Threads  # noqa: E402

EDGERT, TRAINING, AGAINST = "edgert", "training", "against"
TARGETS = (  # issue 29
    Target("edgert_vs_training_geomean", "<=", 1.0, "edgert / training build, geometric mean over the stages"),
    Target("edgert_vs_against_geomean", "<=", 1.05, "edgert / the --against plans, geometric mean over the stages"),
)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; the defaults are the documented run (docs/EXPORTER.md)."""

    models: tuple[str, ...] = option(tuple(spec.name for spec in list_models()), "Zoo models, comma-separated.",
                                     parse=lambda text: tuple(text.split(",")), show=",".join)
    stages: int = option(2, "Stages each model is cut into.")
    batch: int = option(64, "Samples per micro-batch.")
    rounds: int = option(5, "Rounds of the kinds, alternating.")
    repeat: int = option(10, "Steps per kind and round (their median counts).")
    against: str = option("", "A folder of plans <model>-<stages> exported by another edgert, to compare with.")
    progress: Progress = progress_field()

    def check(self) -> None:
        if self.rounds < 1 or self.repeat < 1 or self.stages < 1:
            raise EdgertError("--rounds, --repeat and --stages must be at least 1")
        if self.against and not Path(self.against).is_dir():
            raise EdgertError(f"--against {self.against}: no such folder")

    def baselines(self) -> tuple[str, ...]:
        kinds = ((TRAINING,) if training_folder() is not None else ()) + ((AGAINST,) if self.against else ())
        if not kinds:
            raise MissingDependencyError("nothing to compare with: install the training build (the reference extra, "
                                         "in an environment of its own) or give --against a folder of plans")
        return kinds


def export_kinds(name: str, config: BenchConfig, folder: Path) -> dict[str, Path]:
    """The model cut once and written by edgert and by each baseline (module docstring)."""
    source = from_model_proto(build_model(name), f"{name}.onnx")
    options = ExportOptions(stages=config.stages)
    analysis = prepare_analysis(source, options)
    plans = {EDGERT: folder / f"{name}-{EDGERT}"}
    write_plan(source, analysis, choose_cuts(analysis, options), plans[EDGERT], options.training)
    kinds = config.baselines()
    if TRAINING in kinds:
        from edgert.exporter.training_build import reference_plan

        plans[TRAINING] = folder / f"{name}-{TRAINING}"
        reference_plan(plans[EDGERT], plans[TRAINING])
    if AGAINST in kinds:
        plans[AGAINST] = Path(config.against) / f"{name}-{config.stages}"
        ours, theirs = load_manifest(plans[EDGERT]), load_manifest(plans[AGAINST])
        if [s.blocks for s in ours.stages] != [s.blocks for s in theirs.stages]:
            raise EdgertError(f"{plans[AGAINST]}: its cuts are not this export's; export it with --stages "
                              f"{config.stages} from the same model")
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
    steps = {kind: StageStep(plan, index, mode, batch) for kind, plan in plans.items()}
    for step in steps.values():
        for _ in range(3):
            step()  # warm-up: first runs allocate and tune
    times: dict[str, list[float]] = {kind: [] for kind in plans}
    for _ in range(rounds):
        for kind in plans:
            times[kind].append(steps[kind].median_seconds(repeat))
    medians = {kind: float(np.median(values)) for kind, values in times.items()}
    row = {f"{kind}_ms": seconds * 1e3 for kind, seconds in medians.items()}
    row |= {f"vs_{kind}": medians[EDGERT] / medians[kind] for kind in plans if kind != EDGERT}
    return row


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    """Every stage of every model, in both memory modes; returns ``{"rows": [...], "ratios": {...}, ...}``."""
    config.check()
    kinds = config.baselines()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgert-bench-gradients-") as scratch:
        for name in config.models:
            plans = export_kinds(name, config, Path(scratch))
            for index in range(len(load_manifest(plans[EDGERT]).stages)):
                for mode in MEMORY_MODES:
                    if mode == "stash" and index == config.stages - 1:
                        continue
                    row = {"model": name, "stage": index, "mode": mode,
                           **measure(plans, index, mode, config.batch, config.rounds, config.repeat)}
                    rows.append(row)
                    config.progress(f"{name:17s} stage {index} {mode:9s} " + "  ".join(
                        f"{kind} {row[f'{kind}_ms']:7.2f} ms" for kind in (EDGERT, *kinds)))
    figures = {}
    for kind in kinds:
        ratios = [row[f"vs_{kind}"] for row in rows]
        figures[f"edgert_vs_{kind}_geomean"] = geomean(ratios)
        figures[f"edgert_vs_{kind}_worst"] = max(ratios)
    return result(rows, figures, kinds=list(kinds), targets={t.figure: t.bound for t in TARGETS if t.figure in figures},
                  batch=config.batch, stages=config.stages, threads=1)


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report."""
    kinds = result["kinds"]
    columns = (Column("model", 18, "model", left=True), Column("stage", 5, "stage"),
               Column("  mode", 11, lambda row: f"  {row['mode']}", left=True),
               Column("edgert ms", 10, f"{EDGERT}_ms", "{:.2f}"),
               *(Column(f"{kind} ms", 13, f"{kind}_ms", "{:.2f}") for kind in kinds),
               *(Column(f"vs {kind}", 12, f"vs_{kind}", "{:.3f}") for kind in kinds))
    targets = [t for t in TARGETS if t.figure in result["ratios"]]
    worst = [f"worst against {kind}: {result['ratios'][f'edgert_vs_{kind}_worst']:.3f}" for kind in kinds]
    return "\n".join([
        f"edgert's gradient graphs vs {' and '.join(kinds)} (micro-batch {result['batch']}, {result['stages']} "
        f"stages, 1 thread)", *table(columns, result["rows"]), "", *worst, "",
        *target_lines(targets, result["ratios"])])
