"""The pipeline benchmark: edgert's overhead and its pipeline efficiency, measured in one run.

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

Run by ``edgert bench pipeline`` (edgert/cli/bench.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgert.bench.harness import key_value_lines, option, ratio, result
from edgert.bench.runs import train_run
from edgert.coordinator.localcluster import LocalCluster
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.ort_training import training_api
from edgert.manifest import TrainingConfig, load_manifest
from edgert.models import build_model, get_model_spec, load_dataset, save_model
from edgert.schedule import simulate

STAGES, MICRO_BATCHES = 4, 8  # the pipelined run


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; the defaults are the documented run (docs/RUNTIME.md)."""

    model: str = option("resnet-mini", "Zoo model of the 1-stage runs.")
    batch_size: int = option(64, "Samples per step.")
    steps: int = option(100, "Steps of each 1-stage run.")
    pipeline_steps: int = option(20, "Steps of the 4-stage run.")
    slowdown: str = option("8", "Emulated device slowdown for the 4-stage run.")
    pipeline_model: str = option("mlp-deep", "Zoo model of the 4-stage run.")
    repeat: int = option(3, "Alternate bare/edgert 1-stage runs this often.")
    keep: Path | None = option(None, "Copy the 4-stage run folder (trace.json, metrics.jsonl) here.", type=Path)


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
    """Samples/s of an edgert run and its step records."""
    summary, records = train_run(plan, workers, out, **options)
    return summary.samples_per_s, [m for m in records if m["type"] == "step"]


def pipeline_figures(steps: list[dict], stages: int, microbatches: int, skip: int) -> dict[str, float]:
    """Ideal, simulated and measured ms per step over the steady steps."""
    steady = steps[skip:]
    compute = [sum(s["forward_ms"] + s["backward_ms"] + s["optimizer_ms"] for s in m["stages"]) for m in steady]
    simulated = [simulate("1f1b", [s["forward_ms"] / microbatches for s in m["stages"]],
                          [s["backward_ms"] / microbatches for s in m["stages"]], microbatches)
                 + max(s["optimizer_ms"] for s in m["stages"]) for m in steady]
    return {"ideal_ms": float(np.mean(compute)) / stages, "simulated_ms": float(np.mean(simulated)),
            "measured_ms": float(np.median([m["step_ms"] for m in steady]))}


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    """The three runs; returns ``{"rows": [...], "ratios": {...}, ...}``."""
    spec = get_model_spec(config.model)
    data = load_dataset(spec.dataset, spec)
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgert-bench-") as scratch:
        folder = Path(scratch)
        save_model(build_model(config.model), folder / "model.onnx")
        training = TrainingConfig(learning_rate=1e-3)
        export_plan(folder / "model.onnx", folder / "plan1", ExportOptions(stages=1, training=training))

        bares, singles = [], []
        with LocalCluster(1) as one:
            for attempt in range(config.repeat):  # alternate, so both see the same machine load
                bares.append(bare_ort(folder / "plan1", data.x_train, data.y_train, config.batch_size, config.steps))
                singles.append(edgert_run(folder / "plan1", one.urls, folder / f"run1-{attempt}", epochs=100,
                                          batch_size=config.batch_size, micro_batches=1, steps=config.steps,
                                          schedule="1f1b")[0])
        bare, single = float(np.median(bares)), float(np.median(singles))
        rows.append({"run": "bare_ort", "model": config.model, "stages": 1, "samples_per_s": round(bare, 1)})
        rows.append({"run": "edgert_1stage", "model": config.model, "stages": 1, "samples_per_s": round(single, 1)})

        save_model(build_model(config.pipeline_model), folder / "pipeline.onnx")
        manifest = export_plan(folder / "pipeline.onnx", folder / "plan4",
                               ExportOptions(stages=STAGES, training=training))
        with LocalCluster(STAGES, slowdowns=[config.slowdown] * STAGES) as four:
            pipelined, steps = edgert_run(folder / "plan4", four.urls, folder / "run4", batch_size=config.batch_size,
                                          micro_batches=MICRO_BATCHES, steps=config.pipeline_steps, schedule="1f1b")
        figures = pipeline_figures(steps, STAGES, MICRO_BATCHES, skip=3)
        if config.keep:
            shutil.copytree(folder / "run4", config.keep, dirs_exist_ok=True)
        rows.append({"run": "edgert_4stage_1f1b", "model": config.pipeline_model,
                     "stages": STAGES, "micro_batches": MICRO_BATCHES, "slowdown": config.slowdown,
                     "blocks_per_stage": [len(s.blocks) for s in manifest.stages], "samples_per_s": round(pipelined, 1),
                     **{k: round(v, 2) for k, v in figures.items()}})

    ratios = {"one_stage_vs_bare_ort": ratio(single, bare, 3),
              "f1b_vs_ideal_4stages": ratio(figures["ideal_ms"], figures["measured_ms"], 3),
              "f1b_bound": ratio(MICRO_BATCHES, MICRO_BATCHES + STAGES - 1, 3),
              "f1b_vs_simulated": ratio(figures["simulated_ms"], figures["measured_ms"], 3),
              "f1b_schedule_ceiling": ratio(figures["ideal_ms"], figures["simulated_ms"], 3)}
    return result(rows, ratios, model=config.model, batch_size=config.batch_size)


format_table = key_value_lines  # no table of its own: every row as key=value, then the ratios
