"""The groups benchmark: hybrid (pipeline + data-parallel groups) placements against their baselines.

One run, on this machine, with ``edgert worker`` processes emulating devices (``--slowdown``:
each computation lasts F times its compute time, sleeping without a core):

1. ``hybrid``: 6 equal devices (``--slowdown``) and a model whose heaviest block is at least
   a quarter of its work (``cnn``: its two conv blocks are 0.48 and 0.47 of its FLOPs).
   ``edgert profile`` measures them; the planner places the model without groups (the best
   pure pipeline it finds on the 6, ``edgert plan --no-groups``) and with them; both train
   the same steps. Ratio ``hybrid_vs_pipeline``: samples/s of the hybrid over the pipeline.
2. ``shares``: one group of 4 devices at 1, 2, 3 and 4 times ``--shares-slowdown`` (a 4x
   speed spread) holding the whole model (data parallelism alone), with each member's share
   of a micro-batch in proportion to its measured speed (DLion) and with equal shares. Ratio
   ``weighted_vs_equal_shares``. Every member steps the whole model's optimizer, and the
   slowest does so 4x slower whatever its share: that fixed cost is the same in both runs
   and shrinks the ratio, so this part trains larger batches (``--shares-batch-size``).
3. ``kill``: ``mlp-deep`` in 3 stages on 4 devices (``--slowdown``), the middle stage held by a
   0.5/0.5 group; one member is SIGKILLed after step ``--kill-at``. The coordinator drops it and
   re-spreads its share over the group, with no re-cut, and replays the steps since the last
   snapshot (docs/FAULTS.md, "Groups"). Figures: ``group_kill_to_next_step_s`` (seconds from the
   SIGKILL to the first step completed after the recovery), ``group_recovery_s`` (the
   coordinator's own count, from noticing the failure to resuming), ``group_steps_lost``.

Each rate is the steady samples/s after ``--warmup`` steps. Run by ``edgert bench groups``
(edgert/cli/bench.py); ``--part`` runs one of the two.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from edgert.bench.faults import run_and_kill
from edgert.bench.harness import (
    Progress,
    Target,
    key_value_lines,
    option,
    progress_field,
    ratio,
    result,
    target_lines,
)
from edgert.bench.runs import steady_rate, train_run
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.profiling import profile_devices
from edgert.devices import DevicesFile, save_devices
from edgert.errors import EdgertError
from edgert.exporter.device_plan import PLACEMENT_NAME, PlannedPlacement, PlannedStage, plan_for_devices
from edgert.exporter.export import ExportOptions, export_plan
from edgert.manifest import TrainingConfig
from edgert.models import build_model, save_model
from edgert.schedule import SCHEDULES, microbatches_per_step

HYBRID_DEVICES = 6
SPREAD = (1, 2, 3, 4)  # the shares part's devices, in multiples of --slowdown


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; the defaults are the documented run (docs/PLANNER.md, "Groups")."""

    model: str = option("cnn", "Zoo model of the hybrid part (its heaviest block should be >= 25% of its work).")
    shares_model: str = option("mlp-deep", "Zoo model of the shares part.")
    batch_size: int = option(128, "Samples per step of the hybrid part.")
    shares_batch_size: int = option(1024, "Samples per step of the shares part (every member steps the whole "
                                          "model's optimizer, so a small batch lets that cost hide the shares).")
    micro_batches: int = option(4, "Micro-batches per step.")
    steps: int = option(30, "Steps of each run.")
    warmup: int = option(5, "Steps left out of each rate.")
    schedule: str = option("1f1b", "Pipeline schedule.", choices=SCHEDULES)
    slowdown: float = option(12.0, "Emulated slowdown of the hybrid part's devices.")
    shares_slowdown: float = option(4.0, "Emulated slowdown of the shares part's fastest device (the others 2, 3, "
                                         "4 times it).")
    kill_at: int = option(10, "Step after which a group member is SIGKILLed (the kill part).")
    part: str = option("all", "The hybrid placement, the speed-weighted shares, a member killed, or all three.",
                       choices=("all", "hybrid", "shares", "kill"))
    progress: Progress = progress_field()

    def micro_batch(self, batch_size: int) -> int:
        """Samples per micro-batch at ``batch_size``: what the devices are profiled with."""
        return batch_size // microbatches_per_step(self.schedule, self.micro_batches)

    def check(self) -> None:
        if self.steps <= self.warmup + 2:
            raise EdgertError(f"--steps must exceed --warmup by at least 3 (got {self.steps} and {self.warmup})")


def targets(_: dict[str, Any] | None = None) -> list[Target]:
    """What the figures are held to (issue 17)."""
    return [Target("hybrid_vs_pipeline", ">=", 1.4, "hybrid over the best pure pipeline, 6 equal devices"),
            Target("weighted_vs_equal_shares", ">=", 1.3, "speed-weighted over equal shares, a group with a 4x spread"),
            Target("group_recovery_s", "<=", 1.0, "a group member killed: seconds to resume, share re-spread")]


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    """The parts ``--part`` names; returns ``{"rows": [...], "ratios": {...}, ...}``."""
    config.check()
    rows, ratios = [], {}
    with tempfile.TemporaryDirectory(prefix="edgert-bench-groups-") as scratch_name:
        scratch = Path(scratch_name)
        if config.part in ("all", "hybrid"):
            part_rows, hybrid = _hybrid(config, scratch / "hybrid")
            rows += part_rows
            ratios["hybrid_vs_pipeline"] = hybrid
        if config.part in ("all", "shares"):
            part_rows, weighted = _shares(config, scratch / "shares")
            rows += part_rows
            ratios["weighted_vs_equal_shares"] = weighted
        if config.part in ("all", "kill"):
            row, figures = _kill(config, scratch / "kill")
            rows.append(row)
            ratios.update(figures)
    return result(rows, ratios, part=config.part, schedule=config.schedule, micro_batches=config.micro_batches,
                  emulation="every device sleeps (slowdown-1)x its compute time; the workers share this host's cores")


def _train(config: BenchConfig, plan: Path, workers: list[str], out: Path, batch_size: int) -> float:
    """Steady samples/s of ``plan`` on ``workers``."""
    _, records = train_run(plan, workers, out, steps=config.steps, epochs=100, batch_size=batch_size,
                           micro_batches=config.micro_batches, schedule=config.schedule)
    return steady_rate(records, config.warmup)


def _hybrid(config: BenchConfig, folder: Path) -> tuple[list[dict[str, Any]], float | None]:
    """The best pure pipeline and the best hybrid placement of 6 equal devices, each trained."""
    folder.mkdir(parents=True)
    model = folder / "model.onnx"
    save_model(build_model(config.model), model)
    names = [f"d{k}" for k in range(HYBRID_DEVICES)]
    rows, rates = [], {}
    with LocalCluster(HYBRID_DEVICES, slowdowns=[f"{config.slowdown:g}"] * HYBRID_DEVICES, names=names) as cluster:
        devices = profile_devices(model, cluster.urls, micro_batch=config.micro_batch(config.batch_size), repeats=3)
        save_devices(devices, folder / "devices.json")
        for kind, groups in (("pipeline", False), ("hybrid", True)):
            _, placement = plan_for_devices(model, folder / "devices.json", folder / kind, TrainingConfig(),
                                            batch_size=config.batch_size, micro_batches=config.micro_batches,
                                            schedule=config.schedule, allow_groups=groups)
            rates[kind] = _train(config, folder / kind, placement.workers, folder / f"run-{kind}", config.batch_size)
            config.progress(f"{kind}: {rates[kind]:.0f} samples/s on {_layout(placement)}")
            rows.append({"run": kind, "model": config.model, "devices": HYBRID_DEVICES, "slowdown": config.slowdown,
                         "stages": _layout(placement), "predicted_step_ms": placement.predicted_step_ms,
                         "samples_per_s": round(rates[kind], 1)})
    return rows, ratio(rates["hybrid"], rates["pipeline"], 3)


def _shares(config: BenchConfig, folder: Path) -> tuple[list[dict[str, Any]], float | None]:
    """One group of 4 devices with a 4x spread holding the whole model: speed-weighted against equal shares."""
    folder.mkdir(parents=True)
    model = folder / "model.onnx"
    save_model(build_model(config.shares_model), model)
    names = [f"x{s}" for s in SPREAD]
    rows, rates = [], {}
    slowdowns = [s * config.shares_slowdown for s in SPREAD]
    with LocalCluster(len(SPREAD), slowdowns=[f"{s:g}" for s in slowdowns], names=names) as cluster:
        devices = profile_devices(model, cluster.urls, micro_batch=config.micro_batch(config.shares_batch_size),
                                  repeats=3)
        speeds = _speeds(devices, names)
        for kind, shares in (("weighted", speeds), ("equal", (1.0,) * len(SPREAD))):
            plan = folder / kind
            manifest = export_plan(model, plan, ExportOptions(stages=1, training=TrainingConfig()))
            _write_group_placement(plan, manifest.stages[0].blocks, names, cluster.urls, shares, config)
            rates[kind] = _train(config, plan, cluster.urls, folder / f"run-{kind}", config.shares_batch_size)
            config.progress(f"{kind} shares {[round(s / sum(shares), 3) for s in shares]}: "
                            f"{rates[kind]:.0f} samples/s")
            rows.append({"run": f"{kind}_shares", "model": config.shares_model,
                         "slowdowns": slowdowns, "batch_size": config.shares_batch_size,
                         "shares": [round(s / sum(shares), 3) for s in shares], "samples_per_s": round(rates[kind], 1)})
    return rows, ratio(rates["weighted"], rates["equal"], 3)


def _kill(config: BenchConfig, folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A member of a 0.5/0.5 group SIGKILLed mid-run: how long until training goes on, and what was lost."""
    folder.mkdir(parents=True)
    model = folder / "model.onnx"
    save_model(build_model("mlp-deep"), model)
    plan = folder / "plan"
    manifest = export_plan(model, plan, ExportOptions(stages=3, training=TrainingConfig()))
    names = ["s0", "s1a", "s1b", "s2"]
    with LocalCluster(len(names), slowdowns=[f"{config.slowdown:g}"] * len(names), names=names) as cluster:
        stages = [PlannedStage(k, entry.blocks, names[k if k == 0 else k + 1], cluster.urls[k if k == 0 else k + 1],
                               0.0, 1, 1) for k, entry in enumerate(manifest.stages)]
        stages[1] = replace(stages[1], device="s1a", url=cluster.urls[1], devices=("s1a", "s1b"),
                            urls=(cluster.urls[1], cluster.urls[2]), shares=(0.5, 0.5))
        _write_placement(plan, tuple(stages), config.batch_size, config)
        out = folder / "run"
        outcome = run_and_kill(lambda: train_run(plan, cluster.urls, out, steps=config.steps, epochs=100,
                                                 batch_size=config.batch_size, micro_batches=config.micro_batches,
                                                 schedule=config.schedule, replicate_every=5),
                               cluster, out, [2], lambda health, step: step >= config.kill_at)
    recovery = next(e for e in outcome.kill.events("recovery"))
    row = {"run": "group_member_killed", "model": "mlp-deep", "stages": ["s0", "s1a+s1b", "s2"], "killed": "s1b",
           "killed_after_step": outcome.kill.step, "regrouped": recovery["regrouped"],
           "resume_step": recovery["resume_step"], "workers_after": recovery["workers"]}
    return row, {"group_kill_to_next_step_s": _rounded(outcome.kill.resumed_after_s()),
                 "group_recovery_s": recovery["total_s"], "group_steps_lost": recovery["steps_lost"]}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _speeds(devices: DevicesFile, names: list[str]) -> tuple[float, ...]:
    """Each device's speed on the whole model (1 / its profiled forward + backward time), by ``names``."""
    by_name = {d.name: d for d in devices.devices}
    times = []
    for name in names:
        whole = by_name[name].whole
        if whole is None:
            raise EdgertError(f"the profile of {name} has no whole-model timing")
        times.append(whole.forward_ms + whole.backward_ms)
    return tuple(1.0 / t for t in times)


def _write_group_placement(plan: Path, blocks: tuple[str, ...], names: list[str], urls: list[str],
                           shares: tuple[float, ...], config: BenchConfig) -> None:
    """``placement.json`` for one stage held by every worker of ``urls`` with ``shares``."""
    total = sum(shares)
    stage = PlannedStage(0, tuple(blocks), names[0], urls[0], 0.0, 1, 1)
    stage = replace(stage, devices=tuple(names), urls=tuple(urls), shares=tuple(s / total for s in shares))
    _write_placement(plan, (stage,), config.shares_batch_size, config)


def _write_placement(plan: Path, stages: tuple[PlannedStage, ...], batch_size: int, config: BenchConfig) -> None:
    """``placement.json`` for ``stages``, as ``edgert plan`` writes it (no link codec: ``none``)."""
    placement = PlannedPlacement(stages=stages, link_codecs=("none",) * (len(stages) - 1),
                                 link_ms=(0.0,) * (len(stages) - 1), bottleneck_ms=0.0, predicted_step_ms=0.0,
                                 unused_devices=(), schedule=config.schedule, batch_size=batch_size,
                                 micro_batches=config.micro_batches, memory_mode="recompute")
    (plan / PLACEMENT_NAME).write_text(json.dumps(asdict(placement), indent=2) + "\n")


def _layout(placement: PlannedPlacement) -> list[str]:
    """Each stage's devices, a group as ``a+b``."""
    return ["+".join(stage.devices or (stage.device,)) for stage in placement.stages]


def format_table(outcome: dict[str, Any]) -> str:
    """Every row and ratio as key=value lines, then the targets."""
    missing = "FAIL" if outcome["part"] == "all" else ""  # a part not asked for is only not measured
    return "\n".join([key_value_lines(outcome), *target_lines(targets(outcome), outcome["ratios"], missing=missing)])
