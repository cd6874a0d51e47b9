"""Observations for the latency predictor: measured stage times through the real runtime.

A model is exported as a "units" plan (a cut at every legal cut, so each stage is one
block) and, optionally, as balanced k-stage plans (real multi-block stages); each stage is
measured with :func:`edgert.worker.stage_timer.measure_stage` on every device setup and micro-batch.
Devices on one host differ by ORT threads of the forward and backward sessions (matmuls
scale with threads, small element-wise ops do not) and by emulated slowdown (a pure scale).
:func:`observations_from_devices` turns a ``devices.json`` into observations;
:func:`refresh_features` recomputes cached observations' features.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from edgert.devices import DevicesFile
from edgert.exporter.analyse import ModelAnalysis
from edgert.exporter.errors import PredictorError
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
from edgert.exporter.predictor.features import Features, block_features, join_features
from edgert.exporter.predictor.latency import Observation
from edgert.exporter.slice import stage_ranges
from edgert.exporter.source import from_model_proto
from edgert.manifest import StageEntry, TrainingConfig
from edgert.stage import StageSession, Threads
from edgert.worker.slowdown import SlowdownSchedule


@dataclass(frozen=True)
class DeviceSetup:
    """An emulated device on this host: ORT threads and a slowdown factor."""

    name: str
    threads: Threads = Threads()
    slowdown: float = 1.0


# Not Threads(2, 2): on 2 cores, the idle spinning ORT pool of one session steals a core
# from the other session's pool, and forward times come out 5-20x too slow, at random.
DEFAULT_DEVICES = (
    DeviceSetup("t11"),
    DeviceSetup("t12", Threads(1, 2)),
    DeviceSetup("t21", Threads(2, 1)),
    DeviceSetup("t11-x3", Threads(1, 1), 3.0),
)
DEFAULT_MICRO_BATCHES = (2, 8, 32)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class StageToMeasure:
    """One stage of an exported plan, with its features."""

    model: str
    name: str  # block names joined by "+"
    features: Features
    entry: StageEntry
    plan_dir: Path
    training: TrainingConfig


def export_stages(model: onnx.ModelProto, name: str, workdir: Path,
                  stage_counts: Iterable[int] = ()) -> list[StageToMeasure]:
    """Export ``model`` cut at every legal cut (and into balanced ``stage_counts``-stage plans)."""
    source = from_model_proto(model, f"{name}.onnx")
    options = ExportOptions()
    analysis = prepare_analysis(source, options)
    blocks = block_features(analysis)
    plans = {"units": [c.index for c in analysis.cuts if c.legal]}
    for count in stage_counts:
        if count <= len(analysis.blocks):
            plans[f"stages{count}"] = choose_cuts(analysis, ExportOptions(stages=count))
    stages: dict[str, StageToMeasure] = {}
    for plan_name, cuts in plans.items():
        plan_dir = workdir / name / plan_name
        manifest = write_plan(source, analysis, cuts, plan_dir, options.training)
        for entry, (first, end) in zip(manifest.stages, stage_ranges(cuts, len(analysis.blocks))):
            stage = "+".join(entry.blocks)
            if stage not in stages:
                stages[stage] = StageToMeasure(name, stage, join_features(blocks[first:end]), entry, plan_dir,
                                               manifest.training)
    return list(stages.values())


def measure_stages(stages: list[StageToMeasure], devices: Iterable[DeviceSetup] = DEFAULT_DEVICES,
                   micro_batches: Iterable[int] = DEFAULT_MICRO_BATCHES, rounds: int = 6, repeats: int = 1,
                   progress: Progress = lambda _: None) -> list[Observation]:
    """Every stage on every device and micro-batch, in ``rounds`` passes over all of them.

    Each pass times each stage (the median of ``repeats`` runs after a warm-up run); an
    observation keeps the fastest pass: load from other processes only ever slows a run down,
    passes spread each stage's runs over the whole profiling time, and the predictor models
    the undisturbed device. ``Observation.spread`` is the relative difference between the
    fastest of the odd and of the even passes: the noise that is left.
    """
    from edgert.worker.stage_timer import measure_stage

    devices, micro_batches = list(devices), list(micro_batches)
    runs: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for round_index in range(rounds):
        progress(f"pass {round_index + 1}/{rounds} over {len(stages)} stages x {len(devices)} devices")
        for index, stage in enumerate(stages):
            for device in devices:
                # One stage's sessions at a time, as on a worker: idle ORT thread pools of other
                # sessions spin and steal the cores of a multi-threaded one.
                session = StageSession(stage.entry, stage.plan_dir, stage.training, device.threads)
                slowdown = SlowdownSchedule(((0, device.slowdown),))
                for micro_batch in micro_batches:
                    timing = measure_stage(session, micro_batch, repeats=repeats, warmup=1, slowdown=slowdown)
                    runs.setdefault((index, device.name, micro_batch), []).append(
                        (timing.forward_ms, timing.backward_ms))
                del session
    return [_observation(stages[index], device, micro_batch, times)
            for (index, device, micro_batch), times in runs.items()]


def _observation(stage: StageToMeasure, device: str, micro_batch: int, times: list[tuple[float, float]]) -> Observation:
    fastest = np.min(times, axis=0)
    spread = 0.0
    if len(times) > 1:
        odd, even = np.min(times[1::2], axis=0), np.min(times[::2], axis=0)
        spread = float(np.mean(np.abs(odd - even) / fastest))
    return Observation(device, stage.features, micro_batch, float(fastest[0]), float(fastest[1]), model=stage.model,
                       stage=stage.name, spread=round(spread, 4))


def profile_models(models: dict[str, Callable[[], onnx.ModelProto]], workdir: Path,
                   devices: Iterable[DeviceSetup] = DEFAULT_DEVICES,
                   micro_batches: Iterable[int] = DEFAULT_MICRO_BATCHES, stage_counts: Iterable[int] = (),
                   rounds: int = 6, repeats: int = 1, progress: Progress = lambda _: None) -> list[Observation]:
    """Export and measure several models (name -> builder) into one list of observations."""
    stage_counts = list(stage_counts)
    stages = []
    for name, build in models.items():
        progress(f"exporting {name}")
        stages += export_stages(build(), name, workdir, stage_counts)
    return measure_stages(stages, devices, micro_batches, rounds, repeats, progress)


def save_observations(observations: list[Observation], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps([o.to_json() for o in observations]) + "\n")
    return path


def load_observations(path: str | Path) -> list[Observation]:
    path = Path(path)
    try:
        return [Observation.from_json(item) for item in json.loads(path.read_text())]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise PredictorError(f"{path}: not a file of predictor observations ({error})") from None


def refresh_features(observations: list[Observation], analyses: dict[str, ModelAnalysis]) -> list[Observation]:
    """The observations with features computed again (by this version of the code) from their models."""
    features = {model: (block_features(a), {b.name: b.index for b in a.blocks}) for model, a in analyses.items()}
    refreshed = []
    for o in observations:
        if o.model not in features:
            raise PredictorError(f"observation of model {o.model!r}, which is not among {sorted(analyses)}")
        blocks, index = features[o.model]
        names = o.stage.split("+")
        refreshed.append(replace(o, features=join_features(blocks[index[names[0]]:index[names[-1]] + 1])))
    return refreshed


def analyse_model(model: onnx.ModelProto, name: str) -> ModelAnalysis:
    """The exporter's analysis of ``model``, as profiling sees it."""
    return prepare_analysis(from_model_proto(model, f"{name}.onnx"), ExportOptions())


def observations_from_devices(devices: DevicesFile, analysis: ModelAnalysis, model: str = "") -> list[Observation]:
    """Every device's block timings in ``devices.json`` as observations (``a+b`` timings are stages)."""
    features = block_features(analysis)
    index = {block.name: block.index for block in analysis.blocks}
    observations = []
    for device in devices.devices:
        for timing in device.blocks:
            names = timing.block.split("+")
            unknown = [n for n in names if n not in index]
            if unknown:
                raise PredictorError(f"devices file: device {device.name!r} times block(s) {unknown} "
                                     f"that the model does not have")
            first, last = index[names[0]], index[names[-1]]
            if [index[n] for n in names] != list(range(first, last + 1)):
                raise PredictorError(f"devices file: {timing.block!r} is not a run of adjacent blocks")
            if timing.forward_ms > 0 and timing.backward_ms > 0:
                observations.append(Observation(device.name, join_features(features[first:last + 1]),
                                                devices.micro_batch, timing.forward_ms, timing.backward_ms,
                                                model=model, stage=timing.block))
    return observations
