#!/usr/bin/env python3
"""Pipeline benchmark: edgert's overhead and its pipeline efficiency, measured in one run.

1. ``bare_ort``: a bare ORT Training loop (Module + ORT's optimizer model) over the same
   model and batches: the baseline.
2. ``edgert_1stage``: the same model as one stage on one ``edgert worker`` process, fed
   over CoAP by the coordinator. Ratio ``one_stage_vs_bare_ort``.
3. ``edgert_4stage_1f1b``: four equal stages on four workers, 8 micro-batches, 1F1B. The
   model is ``mlp-deep`` (24 identical layers), cut so that the stages' estimated work is
   equal. Its ideal is the pipeline's compute-only time divided by the stages
   (every stage's measured forward, backward and optimizer time, summed, over 4): ratio
   ``f1b_vs_ideal_4stages``. A synchronous 1F1B pipeline cannot beat M / (M + S - 1) of
   it (the flush at every step; 0.727 for 8 micro-batches on 4 stages): ratio
   ``f1b_bound``. ``f1b_vs_simulated`` compares with the same schedule simulated from the
   measured stage times with free, instant messages: what the runtime's overhead costs.
   ``f1b_schedule_ceiling`` (ideal over simulated) is what ``f1b_vs_ideal_4stages`` would be
   with free messages: the bound, less what the measured stages' imbalance costs.

This machine has 2 cores; four compute-bound workers would contend for them, which is not
what four devices do. So the 4-stage run emulates devices ``--slowdown`` times slower than
this host (each worker sleeps (F-1)x its measured compute, sleeping without a core), which
is what the pipeline's ideal assumes: stages that run in parallel.

Usage: python tools/bench_pipeline.py [--json] [--model resnet-mini] [--steps 100] [--slowdown 8] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.ort_training import training_api
from edgert.manifest import TrainingConfig, load_manifest
from edgert.models import build_model, get_model_spec, load_dataset, save_model
from edgert.schedule import simulate


def bare_ort(plan: Path, x: np.ndarray, y: np.ndarray, batch: int, steps: int, warmup: int = 3) -> float:
    """Samples/s of ORT's own training loop on the 1-stage plan's artifacts."""
    from onnxruntime import SessionOptions

    api = training_api()
    entry = load_manifest(plan).stages[0]
    options = SessionOptions()
    options.intra_op_num_threads = 1
    state = api.CheckpointState.load_checkpoint(str(plan / entry.artifact("checkpoint").path))
    module = api.Module(str(plan / entry.artifact("training").path), state,
                        str(plan / entry.artifact("eval").path), session_options=options)
    optimizer = api.Optimizer(str(plan / entry.artifact("optimizer").path), module)
    module.train()
    scale = np.array(1.0, np.float32)
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        part = slice((step * batch) % (len(x) - batch), (step * batch) % (len(x) - batch) + batch)
        module(x[part], y[part], scale)
        optimizer.step()
        module.lazy_reset_grad()
    return steps * batch / (time.perf_counter() - started)


def edgert_run(plan: Path, workers: list[str], out: Path, **options) -> tuple[float, list[dict]]:
    config = TrainConfig(plan_dir=plan, workers=tuple(workers), out_dir=out, listen="coap+tcp://127.0.0.1:0",
                         progress=False, **options)
    summary = train(config)
    steps = [m for m in read_metrics(out) if m["type"] == "step"]
    return summary.samples_per_s, steps


def pipeline_figures(steps: list[dict], stages: int, microbatches: int, skip: int) -> dict[str, float]:
    """Ideal, simulated and measured ms per step over the steady steps."""
    steady = steps[skip:]
    compute = [sum(s["forward_ms"] + s["backward_ms"] + s["optimizer_ms"] for s in m["stages"]) for m in steady]
    simulated = [simulate("1f1b", [s["forward_ms"] / microbatches for s in m["stages"]],
                          [s["backward_ms"] / microbatches for s in m["stages"]], microbatches)
                 + max(s["optimizer_ms"] for s in m["stages"]) for m in steady]
    return {"ideal_ms": float(np.mean(compute)) / stages, "simulated_ms": float(np.mean(simulated)),
            "measured_ms": float(np.median([m["step_ms"] for m in steady]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet-mini")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="steps of each 1-stage run")
    parser.add_argument("--pipeline-steps", type=int, default=20, help="steps of the 4-stage run")
    parser.add_argument("--slowdown", default="8", help="emulated device slowdown for the 4-stage run")
    parser.add_argument("--pipeline-model", default="mlp-deep", help="model of the 4-stage run")
    parser.add_argument("--repeat", type=int, default=3, help="alternate bare/edgert 1-stage runs this often")
    parser.add_argument("--keep", type=Path, help="copy the 4-stage run folder (trace.json, metrics.jsonl) here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    spec = get_model_spec(args.model)
    data = load_dataset(spec.dataset, spec)
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgert-bench-") as scratch:
        folder = Path(scratch)
        save_model(build_model(args.model), folder / "model.onnx")
        training = TrainingConfig(learning_rate=1e-3)
        export_plan(folder / "model.onnx", folder / "plan1", ExportOptions(stages=1, training=training))

        bares, singles = [], []
        with LocalCluster(1) as one:
            for attempt in range(args.repeat):  # alternate, so both see the same machine load
                bares.append(bare_ort(folder / "plan1", data.x_train, data.y_train, args.batch_size, args.steps))
                singles.append(edgert_run(folder / "plan1", one.urls, folder / f"run1-{attempt}", epochs=100,
                                          batch_size=args.batch_size, micro_batches=1, steps=args.steps,
                                          schedule="1f1b")[0])
        bare, single = float(np.median(bares)), float(np.median(singles))
        rows.append({"run": "bare_ort", "model": args.model, "stages": 1, "samples_per_s": round(bare, 1)})
        rows.append({"run": "edgert_1stage", "model": args.model, "stages": 1, "samples_per_s": round(single, 1)})

        save_model(build_model(args.pipeline_model), folder / "pipeline.onnx")
        manifest = export_plan(folder / "pipeline.onnx", folder / "plan4", ExportOptions(stages=4, training=training))
        with LocalCluster(4, slowdowns=[args.slowdown] * 4) as four:
            pipelined, steps = edgert_run(folder / "plan4", four.urls, folder / "run4", batch_size=args.batch_size,
                                          micro_batches=8, steps=args.pipeline_steps, schedule="1f1b")
        figures = pipeline_figures(steps, 4, 8, skip=3)
        if args.keep:
            shutil.copytree(folder / "run4", args.keep, dirs_exist_ok=True)
        rows.append({"run": "edgert_4stage_1f1b", "model": args.pipeline_model,
                     "stages": 4, "micro_batches": 8, "slowdown": args.slowdown,
                     "blocks_per_stage": [len(s.blocks) for s in manifest.stages], "samples_per_s": round(pipelined, 1),
                     **{k: round(v, 2) for k, v in figures.items()}})

    ratios = {"one_stage_vs_bare_ort": round(single / bare, 3),
              "f1b_vs_ideal_4stages": round(figures["ideal_ms"] / figures["measured_ms"], 3),
              "f1b_bound": round(8 / (8 + 4 - 1), 3),
              "f1b_vs_simulated": round(figures["simulated_ms"] / figures["measured_ms"], 3),
              "f1b_schedule_ceiling": round(figures["ideal_ms"] / figures["simulated_ms"], 3)}
    result = {"rows": rows, "ratios": ratios, "model": args.model, "batch_size": args.batch_size}
    if args.json:
        print(json.dumps(result))
    else:
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
        print("ratios: " + "  ".join(f"{k}={v}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
