"""The heterogeneity benchmark: planned cuts vs equal cuts vs the ideal, and live re-planning.

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

Run by ``edgert bench hetero`` (edgert/cli/bench.py); ``--part`` runs one of the two.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgert.bench.harness import Progress, key_value_lines, option, progress_field, ratio, result
from edgert.bench.runs import steady_rate, train_run
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.profiling import profile_devices
from edgert.devices import save_devices
from edgert.errors import EdgertError
from edgert.exporter.cuts import balanced_cuts
from edgert.exporter.export import ExportOptions, prepare_analysis, write_plan
from edgert.exporter.planner.replanner import Replanner
from edgert.exporter.planner.solver import plan
from edgert.exporter.source import load_source_model
from edgert.manifest import MEMORY_MODES, TrainingConfig
from edgert.models import build_model, save_model
from edgert.schedule import SCHEDULES, microbatches_per_step

SPREAD = (1, 2, 5, 10)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; the defaults are the documented run (docs/PLANNER.md)."""

    model: str = option("mlp-deep", "Zoo model.")
    batch_size: int = option(64, "Samples per step.")
    micro_batches: int = option(4, "Micro-batches per step.")
    steps: int = option(60, "Steps of each planned run.")
    schedule: str = option("async", "Pipeline schedule.", choices=SCHEDULES)
    memory_mode: str = option("stash", "Memory mode of the stages.", choices=MEMORY_MODES)
    change_at: int = option(30, "Step at which one device slows from 1x to 8x (the slowdown part).")
    slowdown_base: float = option(2.0, "Factor applied to every emulated slowdown.")
    rounds: int = option(3, "Planned runs, each between two runs of the fastest device alone (median reported).")
    keep: Path | None = option(None, "Write the plans and runs here (default: a temporary folder).", type=Path)
    part: str = option("all", "The 1/2/5/10x comparison, the mid-run slowdown, or both.",
                       choices=("all", "spread", "slowdown"))
    progress: Progress = progress_field()

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch: what the devices are profiled with."""
        return self.batch_size // microbatches_per_step(self.schedule, self.micro_batches)

    def check(self) -> None:
        if self.rounds < 1:
            raise EdgertError("--rounds must be at least 1")


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


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    """The parts ``--part`` names; returns ``{"rows": [...], "ratios": {...}, ...}``."""
    config.check()
    common = dict(batch_size=config.batch_size, micro_batches=config.micro_batches, schedule=config.schedule,
                  memory_mode=config.memory_mode, steps=config.steps, epochs=100)
    rows, ratios = [], {}
    with tempfile.TemporaryDirectory(prefix="edgert-hetero-") as scratch_name:
        scratch = Path(config.keep or scratch_name)
        scratch.mkdir(parents=True, exist_ok=True)
        model = scratch / "model.onnx"
        save_model(build_model(config.model), model)
        source, analysis = _source_and_analysis(model)
        if config.part in ("all", "spread"):
            spread = _spread(config, model, source, analysis, scratch, common)
            rows.extend(spread["rows"])
            ratios.update(spread["ratios"])
        if config.part in ("all", "slowdown"):
            slowdown = _slowdown(config, model, source, analysis, scratch, common)
            rows.extend(slowdown["rows"])
            ratios["steps_to_recover_after_slowdown"] = slowdown["steps"]
    return result(rows, ratios, model=config.model, schedule=config.schedule, memory_mode=config.memory_mode)


format_table = key_value_lines  # no table of its own: every row as key=value, then the ratios


def _spread(config: BenchConfig, model: Path, source, analysis, scratch: Path, common: dict) -> dict:
    """Four devices at 1, 2, 5 and 10x: planned cuts against equal cuts and against the ideal."""
    rows = []
    names = [f"x{s}" for s in SPREAD]
    factors = [f"{s * config.slowdown_base:g}" for s in SPREAD]
    with LocalCluster(4, slowdowns=factors, names=names) as cluster:
        devices = profile_devices(model, cluster.urls, micro_batch=config.micro_batch, repeats=3,
                                  memory_mode=config.memory_mode)
        save_devices(devices, scratch / "devices.json")
        by_name = dict(zip(names, cluster.urls))
        write_plan(source, analysis, [], scratch / "whole-plan", TrainingConfig())

        def alone(tag: str) -> float:
            """The fastest device training the whole model by itself (measured between the rounds)."""
            _, records = train_run(scratch / "whole-plan", [by_name["x1"]], scratch / f"run-alone-{tag}",
                                   **{**common, "steps": 25, "memory_mode": "recompute"})
            return steady_rate(records, 5)

        cuts, order, predicted = planned_cuts(model, scratch, scratch / "devices.json", names, config.batch_size,
                                              config.micro_batches, config.schedule, config.memory_mode)
        write_plan(source, analysis, cuts, scratch / "planned", TrainingConfig())
        equal_cuts = balanced_cuts(analysis, 4)
        alones = [alone("0")]
        planned_rates = []
        for k in range(config.rounds):
            _, records = train_run(scratch / "planned", [by_name[n] for n in order], scratch / f"run-planned-{k}",
                                   **common)
            planned_rates.append(steady_rate(records, 5))
            if k == 0:
                equal_rate = _equal(source, analysis, equal_cuts, scratch, cluster.urls, common)
            alones.append(alone(str(k + 1)))
            config.progress(f"round {k + 1}/{config.rounds}: planned {planned_rates[-1]:.0f} samples/s, "
                            f"x1 alone {alones[-2]:.0f} / {alones[-1]:.0f}")
    speeds = sum(1 / s for s in SPREAD)
    # each round's planned run against the fastest device alone just before and just after it
    ideals = [(before + after) / 2 * speeds for before, after in zip(alones, alones[1:])]
    vs_ideal = [rate / ideal for rate, ideal in zip(planned_rates, ideals)]
    middle = sorted(range(len(vs_ideal)), key=vs_ideal.__getitem__)[len(vs_ideal) // 2]
    planned = planned_rates[middle]
    rows.append({"run": "planned", "devices": order, "cuts": cuts, "samples_per_s": round(planned, 1),
                 "predicted_step_ms": round(predicted, 2),
                 "rounds_samples_per_s": [round(r, 1) for r in planned_rates]})
    rows.append({"run": "equal", "devices": names, "cuts": equal_cuts,
                 "samples_per_s": round(equal_rate, 1)})
    rows.append({"run": "x1 alone (whole model), between the rounds", "samples_per_s": [round(a, 1) for a in alones],
                 "ideal_sum_of_speeds": round(ideals[middle], 1),
                 "rounds_planned_vs_ideal": [round(r, 3) for r in vs_ideal]})
    return {"rows": rows, "ratios": {"planned_vs_equal": ratio(planned, equal_rate, 3),
                                     "planned_vs_ideal": round(vs_ideal[middle], 3)}}


def _equal(source, analysis, cuts: list[int], scratch: Path, urls: list[str], common: dict) -> float:
    """Samples/s of equal-work cuts in device order, the baseline the planner must beat 3x."""
    write_plan(source, analysis, cuts, scratch / "equal", TrainingConfig())
    _, records = train_run(scratch / "equal", urls, scratch / "run-equal", **{**common, "steps": 15})
    return steady_rate(records, 3)


def _slowdown(config: BenchConfig, model: Path, source, analysis, scratch: Path, common: dict) -> dict:
    """One device slows from 1x to 8x mid-run; re-planning must bring throughput back."""
    base = 2 * config.slowdown_base  # three devices at the base speed: twice the headroom of the 1/2/5/10 cluster
    after = [f"{base:g}"] * 3 + [f"{8 * base:g}"]
    names = ["a", "b", "c", "d"]
    schedules = [f"{base:g}"] * 3 + [f"0:{base:g},{config.change_at}:{8 * base:g}"]
    with LocalCluster(4, slowdowns=list(after), names=names) as cluster:
        devices = profile_devices(model, cluster.urls, micro_batch=config.micro_batch, repeats=3,
                                  memory_mode=config.memory_mode)
        save_devices(devices, scratch / "devices-after.json")
        cuts, order, _ = planned_cuts(model, scratch, scratch / "devices-after.json", names, config.batch_size,
                                      config.micro_batches, config.schedule, config.memory_mode)
        write_plan(source, analysis, cuts, scratch / "after", TrainingConfig())
        by_name = dict(zip(names, cluster.urls))
        _, records = train_run(scratch / "after", [by_name[n] for n in order], scratch / "run-after",
                               **{**common, "steps": 20})
        new_ideal = steady_rate(records, 5)
    with LocalCluster(4, slowdowns=schedules, names=names) as cluster:
        equal = balanced_cuts(analysis, 4)
        write_plan(source, analysis, equal, scratch / "start", TrainingConfig())
        steps = config.change_at + 30
        _, records = train_run(scratch / "start", cluster.urls, scratch / "run-change",
                               **{**common, "steps": steps, "replan": "auto", "replan_every": 5})
    steps = [m for m in records if m["type"] == "step"]
    window = 3  # a rate over a few steps: one quick step is not a recovery
    recovered = None
    for k in range(len(steps) - window + 1):
        span = steps[k:k + window]
        rate = sum(m["samples"] for m in span) / sum(m["step_ms"] / 1000 for m in span)
        if span[0]["step"] > config.change_at and rate >= 0.8 * new_ideal:
            recovered = span[-1]["step"] - config.change_at
            break
    replans = [m for m in records if m.get("event") == "replan"]
    return {"steps": recovered if recovered is not None else -1,
            "rows": [{"run": "re-planned after a 1x -> 8x slowdown", "new_ideal_samples_per_s": round(new_ideal, 1),
                      "replans": [(m["before_step"], m["new_cuts"]) for m in replans],
                      "recovered_after_steps": recovered}]}
