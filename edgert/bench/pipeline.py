"""The pipeline benchmark: edgert's overhead, its pipeline efficiency and a peer, measured in one run.

1. ``bare_ort``: a bare ORT Training loop (Module + ORT's optimizer model, the training build's
   own gradient graphs: exporter/training_build.py) over the same model and batches: the
   baseline, where the training build is installed (the ``reference`` extra); else skipped.
2. ``edgert_1stage``: the same model as one stage on one ``edgert worker`` process, fed
   over CoAP by the coordinator. Ratio ``one_stage_vs_bare_ort``.
3. ``edgert_4stage_1f1b``: four equal stages on four workers, 8 micro-batches, 1F1B, twice:
   with real compute (slowdown 1) and on devices emulated ``--slowdown`` times slower. The
   model is ``mlp-deep`` (24 identical layers), cut so that the stages' estimated work is
   equal. Its ideal is the pipeline's compute-only time divided by the stages
   (every stage's measured forward, backward and optimizer time, summed, over 4): ratio
   ``f1b_vs_ideal_4stages``. A synchronous 1F1B pipeline cannot beat M / (M + S - 1) of
   it (the flush at every step; 0.727 for 8 micro-batches on 4 stages): ratio
   ``f1b_bound``. ``f1b_vs_simulated`` compares with the same schedule simulated from the
   measured stage times with free, instant messages: what the runtime's overhead costs.
   ``f1b_schedule_ceiling`` (ideal over simulated) is what ``f1b_vs_ideal_4stages`` would be
   with free messages: the bound, less what the measured stages' imbalance costs. The
   emulated run's ratios have no suffix, the slowdown-1 run's end in ``_slowdown1``.
4. ``torch_pipelining_4stage_1f1b``: the same shape trained by ``torch.distributed.pipelining``
   (edgert/bench/torch_peer.py; where torch is installed): ``edgert_vs_torch_pipelining`` is
   edgert's slowdown-1 samples/s over it, ``edgert_side_by_side_vs_torch_pipelining`` and
   ``edgert_split_backward_vs_torch_pipelining`` those of the variants below.
5. ``idle_hop`` (first, on the idle machine; edgert/bench/hop.py): a compute thread's 8 KiB
   activation to a peer process's waiting compute thread over the worker's own path, median and
   10th percentile, beside half a raw TCP round trip of the same bytes (``hop_vs_raw_tcp``); and
   the hops each 4-stage run met, from its trace (edgert/bench/trace_hops.py: a neighbour's
   computation's end to the end of the wait for it): ``hop_in_pipeline_vs_idle``.
6. ``edgert_4stage_1f1b_side_by_side``: each 4-stage run again, every stage's forwards on a
   thread of their own beside its backwards (``edgert train --side-by-side``), in the same
   cluster right after: ``side_by_side_vs_one_after_the_other`` (samples/s over samples/s). At
   slowdown 1 it gains only where each worker has a core for each lane; emulated devices sleep
   without a core, so the emulated ratio is that of devices with two cores each.
   ``edgert_4stage_1f1b_split_backward`` likewise, each stage after the first computing its
   parameter gradients once a step over all its micro-batches (``edgert train --split-backward``),
   on the plan cut for it (``edgert export --split-backward``: those stages take more blocks):
   ``split_backward_vs_one_after_the_other``.
7. ``stage_call`` (edgert/bench/calls.py): the runtime's forward and backward of the pipeline's
   stage 1 on one micro-batch against bare ``InferenceSession.run`` (``call_vs_bare_session``),
   and a 1-row backward: the fixed cost per call (``fixed_share_of_backward``).

Every run's samples/s is over the steps it takes after ``WARMUP`` warm-up steps (sessions'
first calls, connections), the bare loop's, the peer's and edgert's alike.

Which figures are the headline depends on the machine. Emulation slows only the compute: on
a real board the Python message path slows down as much, so the slowdown-1 figures are the
honest ones, where each worker has its own cores (``CORES_PER_WORKER``). With fewer cores
(this 2-core host: four workers and the coordinator) a slowdown-1 pipeline measures their
contention for cores, and the emulated run (each worker sleeps (F-1)x its measured compute,
sleeping without a core) is the headline; the result says which (``headline``).

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

from edgert.bench import torch_peer
from edgert.bench.calls import call_costs
from edgert.bench.harness import key_value_lines, option, ratio, result
from edgert.bench.hop import idle_hop
from edgert.bench.runs import steady_rate, train_run
from edgert.bench.trace_hops import trace_hops
from edgert.coordinator.localcluster import LocalCluster
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.ort_training import training_api
from edgert.manifest import TrainingConfig, load_manifest
from edgert.models import build_model, get_model_spec, load_dataset, save_model
from edgert.ort_import import training_folder
from edgert.schedule import simulate
from edgert.worker.machine import usable_cores

STAGES, MICRO_BATCHES = 4, 8  # the pipelined run
WARMUP = 3  # steps every run takes before its rate is measured (session start-up, first calls): all alike
LEARNING_RATE = 1e-3
CORES_PER_WORKER = 2  # with fewer, a slowdown-1 pipeline measures the workers' contention for cores


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
    keep: Path | None = option(None, "Copy the emulated 4-stage run folder (trace.json, metrics.jsonl) here.",
                               type=Path)
    peer: bool = option(True, "Also train the 4-stage shape with torch.distributed.pipelining (where torch is "
                              "installed).")
    side_by_side: bool = option(True, "Also train each 4-stage run with the forwards beside the backwards.")
    split_backward: bool = option(True, "Also train each 4-stage run with the parameter gradients once a step.")


# each variant of the 4-stage run: its `edgert train` option (and `edgert export` option where the cuts change for
# it), and what the report calls it
VARIANTS = {"side_by_side": "forwards beside backwards", "split_backward": "parameter gradients once a step"}
CUT_FOR = ("split_backward",)


def bare_ort(plan: Path, x: np.ndarray, y: np.ndarray, batch: int, steps: int, warmup: int = WARMUP) -> float:
    """Samples/s of ORT's own training loop on a 1-stage reference plan's artifacts (the training build's:
    exporter/training_build.py), over the steps after ``warmup``."""
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


def edgert_run(plan: Path, workers: list[str], out: Path, steps: int, **options) -> tuple[float, list[dict]]:
    """Samples/s of an edgert run over ``steps`` steps after ``WARMUP`` more (as the bare loop and the peer
    measure theirs), and its step records."""
    _, records = train_run(plan, workers, out, steps=WARMUP + steps, **options)
    return steady_rate(records, WARMUP), [m for m in records if m["type"] == "step"]


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
    """The runs; returns ``{"rows": [...], "ratios": {...}, "headline": ..., ...}``."""
    spec = get_model_spec(config.model)
    data = load_dataset(spec.dataset, spec)
    hop = idle_hop()
    rows = [{"run": "idle_hop", "bytes": hop["envelope_bytes"], "median_ms": round(hop["hop_median_ms"], 3),
             "p10_ms": round(hop["hop_p10_ms"], 3), "raw_tcp_median_ms": round(hop["raw_tcp_median_ms"], 3)}]
    with tempfile.TemporaryDirectory(prefix="edgert-bench-") as scratch:
        folder = Path(scratch)
        save_model(build_model(config.model), folder / "model.onnx")
        training = TrainingConfig(learning_rate=LEARNING_RATE)
        export_plan(folder / "model.onnx", folder / "plan1", ExportOptions(stages=1, training=training))

        bares, singles = [], []
        bare_plan = None
        if training_folder() is not None:
            from edgert.exporter.training_build import reference_plan

            bare_plan = folder / "plan1-training-build"
            reference_plan(folder / "plan1", bare_plan)
        with LocalCluster(1) as one:
            for attempt in range(config.repeat):  # alternate, so both see the same machine load
                if bare_plan is not None:
                    bares.append(bare_ort(bare_plan, data.x_train, data.y_train, config.batch_size, config.steps,
                                          WARMUP))
                singles.append(edgert_run(folder / "plan1", one.urls, folder / f"run1-{attempt}", epochs=100,
                                          batch_size=config.batch_size, micro_batches=1, steps=config.steps,
                                          schedule="1f1b")[0])
        bare, single = float(np.median(bares)) if bares else None, float(np.median(singles))
        if bare is not None:
            rows.append({"run": "bare_ort", "model": config.model, "stages": 1, "samples_per_s": round(bare, 1)})
        rows.append({"run": "edgert_1stage", "model": config.model, "stages": 1, "samples_per_s": round(single, 1)})

        save_model(build_model(config.pipeline_model), folder / "pipeline.onnx")
        manifest = export_plan(folder / "pipeline.onnx", folder / "plan4",
                               ExportOptions(stages=STAGES, training=training))
        blocks = [len(s.blocks) for s in manifest.stages]
        plans = {name: folder / "plan4" for name in VARIANTS}
        for name in CUT_FOR:
            if getattr(config, name):
                plans[name] = folder / f"plan4-{name}"
                export_plan(folder / "pipeline.onnx", plans[name],
                            ExportOptions(stages=STAGES, training=training, **{name: True}))
        calls = call_costs(folder / "plan4", 1, config.batch_size // MICRO_BATCHES)
        rows.append({"run": "stage_call", "model": config.pipeline_model, "stage": 1,
                     "rows": config.batch_size // MICRO_BATCHES, **{k: round(v, 4) for k, v in calls.items()}})
        pipelined: dict[str, Any] = {}
        variants: dict[str, dict[str, float]] = {name: {} for name in VARIANTS if getattr(config, name)}
        for slowdown in dict.fromkeys(("1", config.slowdown)):  # real compute first, then the emulated devices
            with LocalCluster(STAGES, slowdowns=[slowdown] * STAGES) as four:
                out = folder / f"run4-slowdown{slowdown}"
                shape = dict(batch_size=config.batch_size, micro_batches=MICRO_BATCHES, steps=config.pipeline_steps,
                             schedule="1f1b")
                rate, steps = edgert_run(folder / "plan4", four.urls, out, **shape)
                for name, rates in variants.items():  # in the same cluster, right after
                    rates[slowdown] = edgert_run(plans[name], four.urls, folder / f"{name}-slowdown{slowdown}",
                                                 **{name: True}, **shape)[0]
            figures = pipeline_figures(steps, STAGES, MICRO_BATCHES, skip=WARMUP)
            hops = trace_hops(out / "trace.json", WARMUP)
            pipelined[slowdown] = rate, figures, hops
            if config.keep and slowdown == config.slowdown:
                shutil.copytree(out, config.keep, dirs_exist_ok=True)
            rows.append({"run": "edgert_4stage_1f1b", "model": config.pipeline_model, "stages": STAGES,
                         "micro_batches": MICRO_BATCHES, "slowdown": slowdown, "blocks_per_stage": blocks,
                         "samples_per_s": round(rate, 1), **{k: round(v, 2) for k, v in figures.items()},
                         **{f"hop_{k}": v for k, v in hops.items() if k.startswith("all_")}, "hops": hops["hops"]})
            for name, rates in variants.items():
                rows.append({"run": f"edgert_4stage_1f1b_{name}", "model": config.pipeline_model,
                             "stages": STAGES, "micro_batches": MICRO_BATCHES, "slowdown": slowdown,
                             "blocks_per_stage": [len(s.blocks) for s in load_manifest(plans[name]).stages],
                             "samples_per_s": round(rates[slowdown], 1)})
        peer = None
        if config.peer and torch_peer.available():
            pipeline_spec = get_model_spec(config.pipeline_model)
            flat = load_dataset(pipeline_spec.dataset, pipeline_spec)
            peer = torch_peer.samples_per_s(flat.x_train, flat.y_train.astype(np.int64), blocks, MICRO_BATCHES,
                                            config.batch_size, config.pipeline_steps, LEARNING_RATE, WARMUP)
            rows.append({"run": "torch_pipelining_4stage_1f1b", "model": config.pipeline_model, "stages": STAGES,
                         "micro_batches": MICRO_BATCHES, "slowdown": "1", "blocks_per_stage": blocks,
                         "samples_per_s": round(peer, 1)})

    ratios = {"one_stage_vs_bare_ort": ratio(single, bare, 3),
              "f1b_bound": ratio(MICRO_BATCHES, MICRO_BATCHES + STAGES - 1, 3)}
    for slowdown, (_, figures, hops) in pipelined.items():
        suffix = "" if slowdown == config.slowdown else f"_slowdown{slowdown}"
        ratios.update({f"f1b_vs_ideal_4stages{suffix}": ratio(figures["ideal_ms"], figures["measured_ms"], 3),
                       f"f1b_vs_simulated{suffix}": ratio(figures["simulated_ms"], figures["measured_ms"], 3),
                       f"f1b_schedule_ceiling{suffix}": ratio(figures["ideal_ms"], figures["simulated_ms"], 3)})
        ratios[f"hop_in_pipeline_vs_idle{suffix}"] = ratio(hops.get("all_median_ms"), hop["hop_median_ms"], 2)
        for name, rates in variants.items():
            ratios[f"{name}_vs_one_after_the_other{suffix}"] = ratio(rates[slowdown], pipelined[slowdown][0], 3)
    ratios["edgert_vs_torch_pipelining"] = ratio(pipelined["1"][0], peer, 3)
    for name, rates in variants.items():
        ratios[f"edgert_{name}_vs_torch_pipelining"] = ratio(rates["1"], peer, 3)
    ratios["hop_vs_raw_tcp"] = ratio(hop["hop_median_ms"], hop["raw_tcp_median_ms"], 2)
    ratios["call_vs_bare_session"] = ratio(calls["bare_forward_ms"] + calls["bare_backward_ms"],
                                           calls["forward_ms"] + calls["backward_ms"], 3)
    ratios["fixed_share_of_backward"] = ratio(calls["backward_1row_ms"], calls["backward_ms"], 3)
    cores = usable_cores()
    honest = cores >= CORES_PER_WORKER * STAGES
    headline = (f"slowdown 1 (real compute, {cores} cores: {CORES_PER_WORKER} or more per worker)" if honest else
                f"slowdown {config.slowdown} (emulated devices; only {cores} cores for {STAGES} workers, so the "
                f"slowdown-1 run measures their contention)")
    return result(rows, ratios, model=config.model, batch_size=config.batch_size, cores=cores, headline=headline,
                  headline_suffix="_slowdown1" if honest and config.slowdown != "1" else "",
                  peer=None if peer is not None else ("not run (--no-peer)" if not config.peer else
                                                      "not run: torch is not installed"))


def format_table(outcome: dict[str, Any]) -> str:
    """The headline's ratios first (which ones, and why), then every row and ratio."""
    figures, suffix = outcome["ratios"], outcome["headline_suffix"]
    names = ("f1b_vs_ideal_4stages", "f1b_vs_simulated", "f1b_schedule_ceiling")
    lines = [f"headline: {outcome['headline']}",
             "  " + "  ".join(f"{name}={figures.get(name + suffix)}" for name in names),
             f"  edgert_vs_torch_pipelining={figures['edgert_vs_torch_pipelining']} (slowdown 1"
             f"{'' if outcome['peer'] is None else '; ' + outcome['peer']})"]
    for name, what in VARIANTS.items():
        if f"{name}_vs_one_after_the_other{suffix}" in figures:
            lines.append(f"  {name}_vs_one_after_the_other={figures[f'{name}_vs_one_after_the_other{suffix}']}"
                         f" ({what}, samples/s over one after the other; over torch pipelining at slowdown 1: "
                         f"{figures[f'edgert_{name}_vs_torch_pipelining']})")
    hop = next((row for row in outcome["rows"] if row["run"] == "idle_hop"), None)
    call = next((row for row in outcome["rows"] if row["run"] == "stage_call"), None)
    if hop is not None:
        lines.append(f"idle hop: median {hop['median_ms']} ms, p10 {hop['p10_ms']} ms (half a raw TCP round trip "
                     f"of the same {hop['bytes']} bytes: {hop['raw_tcp_median_ms']} ms)")
    for row in outcome["rows"]:
        if row["run"] == "edgert_4stage_1f1b" and "hop_all_median_ms" in row:
            lines.append(f"hops in the slowdown-{row['slowdown']} pipeline (a neighbour's computation's end to the end "
                         f"of the wait for it): median {row['hop_all_median_ms']} ms, p10 {row['hop_all_p10_ms']} ms, "
                         f"p90 {row['hop_all_p90_ms']} ms over {row['hops']}")
    if call is not None:
        lines.append(f"per call (stage 1, {call['rows']} rows): forward {call['forward_ms']} ms (bare session "
                     f"{call['bare_forward_ms']}), backward {call['backward_ms']} ms (bare "
                     f"{call['bare_backward_ms']}; of which adding its gradients to the flat gradient "
                     f"{call['accumulate_ms']}), backward of 1 row {call['backward_1row_ms']} ms")
    lines += ["", key_value_lines(outcome)]
    return "\n".join(lines)
