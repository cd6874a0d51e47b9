#!/usr/bin/env python3
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

Usage: python tools/bench_portable.py [--json] [--stages 2] [--batch 64] [--models cnn,resnet-mini]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan  # noqa: E402
from edgert.exporter.source import from_model_proto  # noqa: E402
from edgert.manifest import MEMORY_MODES, StageEntry, load_manifest  # noqa: E402
from edgert.models import build_model, list_models  # noqa: E402
from edgert.stage import StageSession, Threads  # noqa: E402

GEOMEAN_TARGET, WORST_TARGET = 1.15, 1.5
KINDS = ("portable", "training")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(spec.name for spec in list_models()))
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object (progress on stderr)")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeat < 1 or args.stages < 1:
        parser.error("--rounds, --repeat and --stages must be at least 1")
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else print
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgert-bench-portable-") as scratch:
        for name in args.models.split(","):
            plans = export_both(name, args.stages, Path(scratch))
            for index in range(len(load_manifest(plans["portable"]).stages)):
                for mode in MEMORY_MODES:
                    if mode == "stash" and index == args.stages - 1:
                        continue
                    row = {"model": name, "stage": index, "mode": mode,
                           **measure(plans, index, mode, args.batch, args.rounds, args.repeat)}
                    rows.append(row)
                    say(f"{name:17s} stage {index} {mode:9s} portable {row['portable_ms']:7.2f} ms  "
                        f"training build {row['training_ms']:7.2f} ms  ratio {row['ratio']:.3f}")
    ratios = [row["ratio"] for row in rows]
    result = {
        "portable_vs_training_geomean": math.exp(sum(math.log(r) for r in ratios) / len(ratios)),
        "portable_vs_training_worst": max(ratios),
        "worst_stage": max(rows, key=lambda row: row["ratio"]),
        "targets": {"geomean": GEOMEAN_TARGET, "worst": WORST_TARGET},
        "batch": args.batch, "stages": args.stages, "threads": 1, "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return
    worst = result["worst_stage"]
    print(f"\nportable / training build: geometric mean {result['portable_vs_training_geomean']:.3f} "
          f"(target <= {GEOMEAN_TARGET}), worst {result['portable_vs_training_worst']:.3f} "
          f"({worst['model']} stage {worst['stage']} {worst['mode']}; target <= {WORST_TARGET})")


if __name__ == "__main__":
    main()
