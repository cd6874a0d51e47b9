#!/usr/bin/env python3
"""A plan made for a runtime variant against one made without it, from one real profile, both trained.

The user's path end to end, with the CLI as a user runs it: ``--workers`` local ``edgert worker``
processes, each pinned to ``--cores-per-worker`` CPUs of its own (as ``taskset`` would: a device
of that many cores, which is what its profile reports); ``edgert profile`` of ``--model`` on
them; ``edgert plan`` with the variant's flag and with its opposite from that profile (one
device a stage); then ``edgert train`` on each plan in alternating rounds, the same workers,
each run's samples/s over its steps after ``WARMUP``. Printed: each plan's cuts, threads
(forward/backward per stage) and predicted ms a step, each round's samples/s, and
``<variant>_vs_<baseline>`` (samples/s over samples/s, the median of the rounds' ratios) beside
the ratio the planner predicted. The variants (``VARIANTS``): ``side-by-side`` (issue 18, item 2:
forwards beside backwards, each device's cores split between them; it needs at least ``2 x
--workers`` usable cores to mean anything, a worker of one core is planned one after the other
either way) and ``split-backward`` (weight gradients once a step, profiled with ``edgert profile
--split-backward``).

Usage: python tools/planned_gain.py [--variant side-by-side|split-backward] [--workers 4]
       [--cores-per-worker N] [--model mlp-deep] [--batch-size 64] [--micro-batches 8] [--steps 30]
       [--rounds 2] [--json]
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
from edgert.devices import load_devices
from edgert.exporter.device_plan import PlannedPlacement, load_placement
from edgert.models import build_model, save_model
from edgert.worker.machine import usable_cores

# variant -> (the baseline's name and plan flag, the variant's, the profile's flags)
VARIANTS = {
    "side-by-side": (("one_after_the_other", "--one-after-the-other"), ("side_by_side", "--side-by-side"), ()),
    "split-backward": (("whole_backward", "--whole-backward"), ("split_backward", "--split-backward"),
                       ("--split-backward",)),
}


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
    (baseline, _), (variant, _), profile_flags = VARIANTS[args.variant]
    ways = dict(VARIANTS[args.variant][:2])
    cores = core_sets(args.workers, args.cores_per_worker)
    save_model(build_model(args.model), folder / "model.onnx")
    shape = ["--batch-size", str(args.batch_size), "--micro-batches", str(args.micro_batches)]
    with LocalCluster(args.workers, cores=cores, names=[f"device-{k}" for k in range(args.workers)]) as cluster:
        print(f"profiling {args.model} on {args.workers} workers of {args.cores_per_worker} cores ...",
              file=sys.stderr)
        edgert("profile", str(folder / "model.onnx"), "--workers", ",".join(cluster.urls), "--insecure",
               "--micro-batch", str(args.batch_size // args.micro_batches), "-o", str(folder / "devices.json"),
               *profile_flags)
        profiled = load_devices(folder / "devices.json").devices
        plans = {}
        for way, flag in ways.items():
            edgert("plan", str(folder / "model.onnx"), "--devices", str(folder / "devices.json"), "-o",
                   str(folder / way), "--no-groups", flag, *shape)
            plans[way] = load_placement(folder / way)
        rates: dict[str, list[float]] = {way: [] for way in ways}
        for round_ in range(args.rounds):
            for way in ways:
                out = folder / f"run-{way}-{round_}"
                edgert("train", str(folder / way), "--workers", ",".join(plans[way].workers), "--insecure",
                       "--listen", LISTEN, "--steps", str(WARMUP + args.steps), "--out", str(out), *shape)
                rates[way].append(steady_rate(read_metrics(out), WARMUP))
                print(f"round {round_ + 1}: {way} {rates[way][-1]:.1f} samples/s", file=sys.stderr)
    ratios = [with_it / without for with_it, without in zip(rates[variant], rates[baseline])]
    return {"variant": args.variant, "model": args.model, "workers": args.workers,
            "cores_per_worker": args.cores_per_worker, "batch_size": args.batch_size,
            "micro_batches": args.micro_batches, "steps": args.steps,
            "plans": {way: described(plans[way]) for way in ways},
            "samples_per_s": {way: [round(rate, 1) for rate in rates[way]] for way in ways},
            # of the profiled backwards, the weight halves' share (0: not profiled split)
            "weight_share": round(sum(t.weight_ms for d in profiled for t in d.blocks)
                                  / max(sum(t.backward_ms for d in profiled for t in d.blocks), 1e-9), 3),
            f"{variant}_vs_{baseline}": round(statistics.median(ratios), 3),
            f"predicted_{variant}_vs_{baseline}": round(plans[baseline].predicted_step_ms
                                                        / plans[variant].predicted_step_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=tuple(VARIANTS), default="side-by-side")
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
    (baseline, _), (variant, _), _ = VARIANTS[args.variant]
    name = f"{variant}_vs_{baseline}"
    print(f"{name}={figures[name]} (predicted {figures['predicted_' + name]})")


if __name__ == "__main__":
    main()
