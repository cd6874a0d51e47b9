#!/usr/bin/env python3
"""A plan made side by side against one made one after the other, from one real profile, both trained.

The user's path end to end, with the CLI as a user runs it: ``--workers`` local ``edgert worker``
processes, each pinned to ``--cores-per-worker`` CPUs of its own (as ``taskset`` would: a device
of that many cores, which is what its profile reports); ``edgert profile`` of ``--model`` on
them; ``edgert plan --side-by-side`` and ``edgert plan --one-after-the-other`` from that
profile (one device a stage); then ``edgert train`` on each plan in alternating rounds, the
same workers, each run's samples/s over its steps after ``WARMUP``. Printed: each plan's cuts,
threads (forward/backward per stage) and predicted ms a step, each round's samples/s, and
``side_by_side_vs_one_after_the_other`` (samples/s over samples/s, the median of the rounds'
ratios) beside the ratio the planner predicted. This is the planner's side-by-side split
(issue 18, item 2) measured where each worker has cores of its own: it needs at least
``2 x --workers`` usable cores to mean anything (a worker of one core is planned one after the
other either way).

Usage: python tools/planned_side_by_side.py [--workers 4] [--cores-per-worker N] [--model mlp-deep]
       [--batch-size 64] [--micro-batches 8] [--steps 30] [--rounds 2] [--json]
Run it from outside the checkout's root (``python -m edgert`` there would find the source folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from edgert.bench.pipeline import WARMUP
from edgert.bench.runs import LISTEN, steady_rate
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.exporter.device_plan import PlannedPlacement, load_placement
from edgert.models import build_model, save_model
from edgert.worker.machine import usable_cores

WAYS = {"one_after_the_other": "--one-after-the-other", "side_by_side": "--side-by-side"}


def edgert(*args: str) -> str:
    """Run ``python -m edgert ARGS`` as a user would; its output, or exit with what it printed."""
    done = subprocess.run([sys.executable, "-m", "edgert", *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"edgert {args[0]} failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def core_sets(workers: int, per_worker: int) -> list[set[int]]:
    """``per_worker`` of this process's CPUs for each worker, disjoint, in order."""
    cpus = sorted(os.sched_getaffinity(0))
    if workers * per_worker > len(cpus):
        sys.exit(f"{workers} workers x {per_worker} cores need {workers * per_worker} CPUs; this process may use "
                 f"{len(cpus)}")
    return [set(cpus[k * per_worker:(k + 1) * per_worker]) for k in range(workers)]


def described(placement: PlannedPlacement) -> dict:
    """What a plan decided: blocks and (forward, backward) threads per stage, the predicted step."""
    return {"blocks": [len(stage.blocks) for stage in placement.stages],
            "threads": [f"{stage.forward_threads}/{stage.backward_threads}" for stage in placement.stages],
            "predicted_step_ms": placement.predicted_step_ms}


def measure(args: argparse.Namespace, folder: Path) -> dict:
    """Profile, plan both ways, train alternately; the figures."""
    cores = core_sets(args.workers, args.cores_per_worker)
    save_model(build_model(args.model), folder / "model.onnx")
    shape = ["--batch-size", str(args.batch_size), "--micro-batches", str(args.micro_batches)]
    with LocalCluster(args.workers, cores=cores, names=[f"device-{k}" for k in range(args.workers)]) as cluster:
        print(f"profiling {args.model} on {args.workers} workers of {args.cores_per_worker} cores ...",
              file=sys.stderr)
        edgert("profile", str(folder / "model.onnx"), "--workers", ",".join(cluster.urls), "--insecure",
               "--micro-batch", str(args.batch_size // args.micro_batches), "-o", str(folder / "devices.json"))
        plans = {}
        for way, flag in WAYS.items():
            edgert("plan", str(folder / "model.onnx"), "--devices", str(folder / "devices.json"), "-o",
                   str(folder / way), "--no-groups", flag, *shape)
            plans[way] = load_placement(folder / way)
        rates: dict[str, list[float]] = {way: [] for way in WAYS}
        for round_ in range(args.rounds):
            for way in WAYS:
                out = folder / f"run-{way}-{round_}"
                edgert("train", str(folder / way), "--workers", ",".join(plans[way].workers), "--insecure",
                       "--listen", LISTEN, "--steps", str(WARMUP + args.steps), "--out", str(out), *shape)
                rates[way].append(steady_rate(read_metrics(out), WARMUP))
                print(f"round {round_ + 1}: {way} {rates[way][-1]:.1f} samples/s", file=sys.stderr)
    ratios = [side / one for side, one in zip(rates["side_by_side"], rates["one_after_the_other"])]
    predicted = {way: plans[way].predicted_step_ms for way in WAYS}
    return {"model": args.model, "workers": args.workers, "cores_per_worker": args.cores_per_worker,
            "batch_size": args.batch_size, "micro_batches": args.micro_batches, "steps": args.steps,
            "plans": {way: described(plans[way]) for way in WAYS},
            "samples_per_s": {way: [round(rate, 1) for rate in rates[way]] for way in WAYS},
            "side_by_side_vs_one_after_the_other": round(statistics.median(ratios), 3),
            "predicted_side_by_side_vs_one_after_the_other": round(predicted["one_after_the_other"]
                                                                    / predicted["side_by_side"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp-deep")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--cores-per-worker", type=int, default=None,
                        help="CPUs pinned to each worker (default: this process's CPUs over --workers)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="measured steps of each run, after the warm-up")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.cores_per_worker = args.cores_per_worker or max(1, usable_cores() // args.workers)
    with tempfile.TemporaryDirectory(prefix="edgert-planned-") as scratch:
        figures = measure(args, Path(scratch))
    if args.json:
        print(json.dumps(figures))
        return
    for way, plan in figures["plans"].items():
        print(f"{way}: blocks {plan['blocks']}, threads (forward/backward) {plan['threads']}, predicted "
              f"{plan['predicted_step_ms']} ms a step; samples/s {figures['samples_per_s'][way]}")
    print(f"side_by_side_vs_one_after_the_other={figures['side_by_side_vs_one_after_the_other']} (predicted "
          f"{figures['predicted_side_by_side_vs_one_after_the_other']})")


if __name__ == "__main__":
    main()
