#!/usr/bin/env python3
"""Heterogeneity benchmark: planned cuts vs equal cuts vs the ideal, and live re-planning.

One run, on this machine, with ``edgert worker`` processes emulating devices of different
speeds (``--slowdown``: each computation lasts F times its compute time):

1. Four devices at relative slowdowns 1, 2, 5, 10 (FTPipeHD's 10x spread). ``edgert profile``
   measures them; the planner cuts ``mlp-deep`` for them (``planned``); the same model cut
   into equal-work stages in device order (``equal``); and the *ideal*, the sum of the
   devices' individual speeds on the whole model: the fastest device training the whole
   model alone times (1 + 1/2 + 1/5 + 1/10) (emulated devices scale exactly).
   Ratios ``planned_vs_equal``, ``planned_vs_ideal``. This host's speed drifts by up to a quarter
   within minutes, so the planned cuts train ``--rounds`` times, each run between two runs
   of the fastest device alone; each round's ratio is against those two, and the median
   round (the upper middle one of an even count) is reported (all rounds are in the table).

   The emulated factors are multiplied by ``--slowdown-base`` (default 2: devices 2x, 4x,
   10x and 20x slower than this host). This machine has 2 cores; a 1x device computes
   without sleeping and would compete with the other three workers and the coordinator for
   them, so the benchmark would measure this host's contention, not the system. (Busy, the
   four need 0.9 of a core: 1/2 + 1/4 + 1/10 + 1/20.)
2. Four devices at 1x, one of which slows to 8x at step ``--change-at`` (``--slowdown-schedule``),
   emulated at twice the base (4x and 32x by default: three equal devices need twice the headroom),
   trained with ``--replan auto``: ``steps_to_recover_after_slowdown`` counts the steps after
   the change until a step runs within 80% of the new ideal (the same devices with the slow
   one at 8x, planned for from the start and measured in this run).

Usage: python tools/bench_hetero.py [--json] [--rounds 3] [--steps 60] [--schedule async] [--memory-mode stash]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.profiling import profile_devices
from edgert.coordinator.runlog import read_metrics
from edgert.devices import save_devices
from edgert.exporter.cuts import balanced_cuts
from edgert.exporter.export import ExportOptions, prepare_analysis, write_plan
from edgert.exporter.planner.replanner import Replanner
from edgert.exporter.planner.solver import plan
from edgert.exporter.source import load_source_model
from edgert.manifest import TrainingConfig
from edgert.models import build_model, save_model

SPREAD = (1, 2, 5, 10)


def run(plan_dir: Path, workers: list[str], out: Path, **options) -> tuple[float, list[dict]]:
    config = TrainConfig(plan_dir=plan_dir, workers=tuple(workers), out_dir=out, listen="coap+tcp://127.0.0.1:0",
                         progress=False, **options)
    summary = train(config)
    return summary.samples_per_s, [m for m in read_metrics(out) if m["type"] in ("step", "event")]


def steady_rate(records: list[dict], skip: int) -> float:
    """Samples per second over the steps after ``skip``: samples over the time they took."""
    steps = [m for m in records if m["type"] == "step"][skip:]
    return sum(m["samples"] for m in steps) / sum(m["step_ms"] / 1000 for m in steps)


def planned_cuts(model: Path, scratch: Path, devices_path: Path, names: list[str], batch: int, micro: int,
                 schedule: str, memory_mode: str) -> tuple[list[int], list[str], float]:
    """Block cuts and worker order the planner chooses from the profile, and its predicted step time."""
    manifest = write_plan(*_source_and_analysis(model), [], scratch / "whole", TrainingConfig())
    replanner = Replanner(scratch / "whole", manifest, scratch / "cache", devices=devices_path, batch_size=batch,
                          micro_batches=micro, schedule=schedule, memory_mode=memory_mode)
    placement = plan(replanner.problem(names))
    cuts = [replanner.unit_first_block(u) for u in placement.cut_units()]
    order = [stage.devices[0] for stage in placement.stages]
    return cuts, order, placement.predicted_step_ms


def _source_and_analysis(model: Path):
    source = load_source_model(model)
    return source, prepare_analysis(source, ExportOptions())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp-deep")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--schedule", default="async")
    parser.add_argument("--memory-mode", default="stash")
    parser.add_argument("--change-at", type=int, default=30)
    parser.add_argument("--slowdown-base", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=3,
                        help="planned runs, each between two runs of the fastest device alone (median reported)")
    parser.add_argument("--keep", type=Path, help="write the plans and runs here (default: a temporary folder)")
    parser.add_argument("--part", choices=("all", "spread", "slowdown"), default="all",
                        help="the 1/2/5/10x comparison, the mid-run slowdown, or both")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    common = dict(batch_size=args.batch_size, micro_batches=args.micro_batches, schedule=args.schedule,
                  memory_mode=args.memory_mode, steps=args.steps, epochs=100)
    rows, ratios = [], {}
    with tempfile.TemporaryDirectory(prefix="edgert-hetero-") as scratch_name:
        scratch = Path(args.keep or scratch_name)
        scratch.mkdir(parents=True, exist_ok=True)
        model = scratch / "model.onnx"
        save_model(build_model(args.model), model)
        source, analysis = _source_and_analysis(model)
        if args.part in ("all", "spread"):
            spread = _spread(args, model, source, analysis, scratch, common)
            rows.extend(spread["rows"])
            ratios.update(spread["ratios"])
        if args.part in ("all", "slowdown"):
            recovery = _recovery(args, model, source, analysis, scratch, common)
            rows.extend(recovery["rows"])
            ratios["steps_to_recover_after_slowdown"] = recovery["steps"]

    result = {"rows": rows, "ratios": ratios, "model": args.model, "schedule": args.schedule,
              "memory_mode": args.memory_mode}
    if args.json:
        print(json.dumps(result))
    else:
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
        print("ratios: " + "  ".join(f"{k}={v}" for k, v in ratios.items()))
    return 0


def _spread(args, model: Path, source, analysis, scratch: Path, common: dict) -> dict:
    """Four devices at 1, 2, 5 and 10x: planned cuts against equal cuts and against the ideal."""
    rows = []
    micro = args.batch_size // (1 if args.schedule == "async" else args.micro_batches)
    names = [f"x{s}" for s in SPREAD]
    factors = [f"{s * args.slowdown_base:g}" for s in SPREAD]
    with LocalCluster(4, slowdowns=factors, names=names) as cluster:
        devices = profile_devices(model, cluster.urls, micro_batch=micro, repeats=3, memory_mode=args.memory_mode)
        save_devices(devices, scratch / "devices.json")
        by_name = dict(zip(names, cluster.urls))
        write_plan(source, analysis, [], scratch / "whole-plan", TrainingConfig())

        def alone(tag: str) -> float:
            """The fastest device training the whole model by itself (measured between the rounds)."""
            _, records = run(scratch / "whole-plan", [by_name["x1"]], scratch / f"run-alone-{tag}",
                             **{**common, "steps": 25, "memory_mode": "recompute"})
            return steady_rate(records, skip=5)

        cuts, order, predicted = planned_cuts(model, scratch, scratch / "devices.json", names, args.batch_size,
                                              args.micro_batches, args.schedule, args.memory_mode)
        write_plan(source, analysis, cuts, scratch / "planned", TrainingConfig())
        equal_cuts = balanced_cuts(analysis, 4)
        alones = [alone("0")]
        planned_rates = []
        for k in range(args.rounds):
            _, records = run(scratch / "planned", [by_name[n] for n in order], scratch / f"run-planned-{k}", **common)
            planned_rates.append(steady_rate(records, skip=5))
            if k == 0:
                equal_rate = _equal(source, analysis, equal_cuts, scratch, cluster.urls, common)
            alones.append(alone(str(k + 1)))
            _progress(args, f"round {k + 1}/{args.rounds}: planned {planned_rates[-1]:.0f} samples/s, "
                            f"x1 alone {alones[-2]:.0f} / {alones[-1]:.0f}")
    speeds = sum(1 / s for s in SPREAD)
    # each round's planned run against the fastest device alone just before and just after it
    ideals = [(before + after) / 2 * speeds for before, after in zip(alones, alones[1:])]
    ratios = [rate / ideal for rate, ideal in zip(planned_rates, ideals)]
    middle = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
    planned = planned_rates[middle]
    rows.append({"run": "planned", "devices": order, "cuts": cuts, "samples_per_s": round(planned, 1),
                 "predicted_step_ms": round(predicted, 2),
                 "rounds_samples_per_s": [round(r, 1) for r in planned_rates]})
    rows.append({"run": "equal", "devices": names, "cuts": equal_cuts,
                 "samples_per_s": round(equal_rate, 1)})
    rows.append({"run": "x1 alone (whole model), between the rounds", "samples_per_s": [round(a, 1) for a in alones],
                 "ideal_sum_of_speeds": round(ideals[middle], 1),
                 "rounds_planned_vs_ideal": [round(r, 3) for r in ratios]})
    return {"rows": rows, "ratios": {"planned_vs_equal": round(planned / equal_rate, 3),
                                     "planned_vs_ideal": round(ratios[middle], 3)}}


def _equal(source, analysis, cuts: list[int], scratch: Path, urls: list[str], common: dict) -> float:
    """Samples/s of equal-work cuts in device order, the baseline the planner must beat 3x."""
    write_plan(source, analysis, cuts, scratch / "equal", TrainingConfig())
    _, records = run(scratch / "equal", urls, scratch / "run-equal", **{**common, "steps": 15})
    return steady_rate(records, skip=3)


def _progress(args, line: str) -> None:
    """A line per round; on stderr under ``--json``, whose stdout is the result alone."""
    print(line, file=sys.stderr if args.json else sys.stdout, flush=True)


def _recovery(args, model: Path, source, analysis, scratch: Path, common: dict) -> dict:
    """One device slows from 1x to 8x mid-run; re-planning must bring throughput back."""
    base = 2 * args.slowdown_base  # three devices at the base speed: twice the headroom of the 1/2/5/10 cluster
    after = [f"{base:g}"] * 3 + [f"{8 * base:g}"]
    names = ["a", "b", "c", "d"]
    schedules = [f"{base:g}"] * 3 + [f"0:{base:g},{args.change_at}:{8 * base:g}"]
    with LocalCluster(4, slowdowns=list(after), names=names) as cluster:
        devices = profile_devices(model, cluster.urls, micro_batch=args.batch_size // (
            1 if args.schedule == "async" else args.micro_batches), repeats=3, memory_mode=args.memory_mode)
        save_devices(devices, scratch / "devices-after.json")
        cuts, order, _ = planned_cuts(model, scratch, scratch / "devices-after.json", names, args.batch_size,
                                      args.micro_batches, args.schedule, args.memory_mode)
        write_plan(source, analysis, cuts, scratch / "after", TrainingConfig())
        by_name = dict(zip(names, cluster.urls))
        _, records = run(scratch / "after", [by_name[n] for n in order], scratch / "run-after",
                         **{**common, "steps": 20})
        new_ideal = steady_rate(records, skip=5)
    with LocalCluster(4, slowdowns=schedules, names=names) as cluster:
        equal = balanced_cuts(analysis, 4)
        write_plan(source, analysis, equal, scratch / "start", TrainingConfig())
        steps = args.change_at + 30
        _, records = run(scratch / "start", cluster.urls, scratch / "run-change",
                         **{**common, "steps": steps, "replan": "auto", "replan_every": 5})
    steps = [m for m in records if m["type"] == "step"]
    window = 3  # a rate over a few steps: one quick step is not a recovery
    recovered = None
    for k in range(len(steps) - window + 1):
        span = steps[k:k + window]
        rate = sum(m["samples"] for m in span) / sum(m["step_ms"] / 1000 for m in span)
        if span[0]["step"] > args.change_at and rate >= 0.8 * new_ideal:
            recovered = span[-1]["step"] - args.change_at
            break
    replans = [m for m in records if m.get("event") == "replan"]
    return {"steps": recovered if recovered is not None else -1,
            "rows": [{"run": "re-planned after a 1x -> 8x slowdown", "new_ideal_samples_per_s": round(new_ideal, 1),
                      "replans": [(m["before_step"], m["new_cuts"]) for m in replans],
                      "recovered_after_steps": recovered}]}


if __name__ == "__main__":
    sys.exit(main())
