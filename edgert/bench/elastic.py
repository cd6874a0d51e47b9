"""The elastic-membership benchmark: a device that joins mid-run, and how soon it does work.

One run, on this machine, with ``edgert worker`` processes emulating devices (``--slowdown``:
each computation lasts F times its compute time): ``--stages`` slow devices train the model
with re-planning left at its default (off: only the weighing of idle devices checks the
placement); at step ``--join-at`` a device ``--slow / --fast`` times faster starts with
``edgert worker --join``. The run records the join, every check's decision and the re-plan
that puts the newcomer to work (docs/RUNS.md). Figures:

- ``steps_until_work``: steps completed from the join until the first step the newcomer
  computes (the re-plan's ``before_step`` minus the first step after the join);
- ``seconds_until_work``: from the join event (written after the newcomer's quick profile,
  ``profile_s`` in the row) to its first completed step: the check, the drain, the
  re-partition, the first step;
- ``rate_after_vs_before``: samples/s over the steps after the newcomer's placement
  (``--warmup`` skipped) over the steps before the join, in the same run;
- ``predicted_gain``: the planner's ``current / proposed`` step time of that re-plan.

Run by ``edgert bench elastic`` (edgert/cli/bench.py).
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgert.bench.faults import MetricsTail
from edgert.bench.harness import Progress, Target, key_value_lines, option, progress_field, ratio, result, target_lines
from edgert.bench.runs import train_config
from edgert.coordinator.coordinator import train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.errors import EdgertError
from edgert.exporter.export import ExportOptions, export_plan
from edgert.manifest import TrainingConfig
from edgert.models import build_model, save_model
from edgert.schedule import SCHEDULES

JOINER = "joiner"


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; the defaults are the documented run (docs/FAULTS.md, "Rejoin")."""

    model: str = option("mlp-deep", "Zoo model.")
    stages: int = option(3, "Stages, each on one slow device, before the join.")
    slow: float = option(16.0, "Emulated slowdown of the devices that start the run.")
    fast: float = option(2.0, "Emulated slowdown of the device that joins.")
    steps: int = option(120, "Steps of the run.")
    join_at: int = option(20, "Step after which the device joins.")
    replan_every: int = option(5, "Steps between the checks that weigh an idle device (--replan-every).")
    warmup: int = option(3, "Steps after the re-plan left out of the rate after it.")
    batch_size: int = option(64, "Samples per step.")
    micro_batches: int = option(4, "Micro-batches per step.")
    schedule: str = option("1f1b", "Pipeline schedule.", choices=SCHEDULES)
    progress: Progress = progress_field()

    def check(self) -> None:
        if not 1 <= self.join_at < self.steps - 10:
            raise EdgertError(f"--join-at must leave at least 10 steps after it (got {self.join_at} of {self.steps})")


def targets(outcome: dict[str, Any]) -> list[Target]:
    """What the figures of ``outcome`` (a :func:`run` result) are held to."""
    return [Target("steps_until_work", "<=", outcome["replan_every"],
                   "steps from the join until the device computes (one check period at most)"),
            Target("rate_after_vs_before", ">=", 1.1, "samples/s with the joined device over before its join")]


def _loopback_port() -> int:
    """A loopback port free now, for the coordinator's ``--listen`` (the joiner must know it before it starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    """Train with the slow devices, start the joiner at ``join_at``; returns ``{"rows", "ratios", ...}``."""
    config.check()
    with tempfile.TemporaryDirectory(prefix="edgert-bench-elastic-") as scratch:
        folder = Path(scratch)
        save_model(build_model(config.model), folder / "model.onnx")
        export_plan(folder / "model.onnx", folder / "plan",
                    ExportOptions(stages=config.stages, training=TrainingConfig(learning_rate=1e-3)))
        listen = f"coap+tcp://127.0.0.1:{_loopback_port()}"
        out = folder / "run"
        joiner = LocalCluster(1, names=[JOINER], slowdowns=[f"{config.fast:g}"], extra_args=["--join", listen])
        with LocalCluster(config.stages, slowdowns=[f"{config.slow:g}"] * config.stages) as first:
            outcome: dict[str, Any] = {}

            def go() -> None:
                try:
                    outcome["summary"] = train(train_config(
                        folder / "plan", first.urls, out, listen=listen, steps=config.steps, epochs=100,
                        batch_size=config.batch_size, micro_batches=config.micro_batches, schedule=config.schedule,
                        replan_every=config.replan_every))
                except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                    outcome["error"] = error

            thread = threading.Thread(target=go, name="edgert-bench-elastic", daemon=True)
            thread.start()
            try:
                if not _start_at(joiner, MetricsTail(out), config.join_at, thread):
                    raise outcome.get("error") or EdgertError(f"the run ended before step {config.join_at}")
                config.progress(f"{JOINER} started after step {config.join_at} (slowdown {config.fast:g} vs "
                                f"{config.slow:g})")
                thread.join(600)
            finally:
                console = joiner.consoles[0] if joiner.consoles else []
                joiner.stop()
        if "error" in outcome:
            raise outcome["error"]
        return _figures(config, read_metrics(out), console)


def _start_at(joiner: LocalCluster, tail: MetricsTail, step: int, job: threading.Thread) -> bool:
    """Start ``joiner`` once the run has completed ``step``; False if the run ended first."""
    while tail.last_step < step:
        if not job.is_alive():
            return False
        tail.poll()
        time.sleep(0.02)
    joiner.start()
    return True


def _figures(config: BenchConfig, records: list[dict[str, Any]], console: list[str]) -> dict[str, Any]:
    """The figures of the run's records (module docstring)."""
    events = [r for r in records if r["type"] == "event"]
    join = next((e for e in events if e["event"] == "join" and e["worker"] == JOINER), None)
    if join is None:
        raise EdgertError(f"{JOINER} never joined the run")
    steps = [r for r in records if r["type"] == "step"]
    before = [s for s in steps if s["time_s"] < join["time_s"]]
    placed = next((e for e in events if e["event"] == "join_placed" and e["worker"] == JOINER), None)
    replan = next((e for e in events
                   if e["event"] == "replan" and placed and e["before_step"] == placed["before_step"]), None)
    working = [s for s in steps if any(stage["worker"] == JOINER for stage in s["stages"])]
    first_after = before[-1]["step"] + 1 if before else 0
    after = working[config.warmup:]
    rate_before = _rate(before[config.warmup:])
    rate_after = _rate(after)
    profiled = next((e for e in events if e["event"] == "profiled" and e["workers"] == [JOINER]), None)
    kept_idle = [e["reason"] for e in events if e["event"] == "join_kept_idle" and e["worker"] == JOINER]
    row = {"run": "join", "model": config.model, "stages_before": config.stages,
           "stages_after": len(working[0]["stages"]) if working else None, "slow": config.slow, "fast": config.fast,
           "joined_before_step": first_after, "placed_before_step": placed["before_step"] if placed else None,
           "profile_s": profiled["seconds"] if profiled else None, "checks_kept_idle": len(kept_idle),
           "samples_per_s_before": round(rate_before, 1),
           "samples_per_s_after": round(rate_after, 1) if after else None,
           "worker_console": [line for line in console if "joined" in line or "given stage" in line]}
    figures = {"steps_until_work": placed["before_step"] - first_after if placed else None,
               "seconds_until_work": round(working[0]["time_s"] - join["time_s"], 3) if working else None,
               "rate_after_vs_before": ratio(rate_after, rate_before, 3) if after else None,
               "predicted_gain": replan["predicted_gain"] if replan else None}
    return result([row], figures, emulation="every device sleeps (slowdown-1)x its compute time",
                  replan_every=config.replan_every, kept_idle_reasons=kept_idle)


def _rate(steps: list[dict[str, Any]]) -> float:
    """Samples per second over ``steps`` (0 when there are none)."""
    seconds = sum(s["step_ms"] for s in steps) / 1000
    return sum(s["samples"] for s in steps) / seconds if seconds else 0.0


def format_table(outcome: dict[str, Any]) -> str:
    """The row and ratios as key=value lines, then the targets."""
    return "\n".join([key_value_lines(outcome), *target_lines(targets(outcome), outcome["ratios"], missing="FAIL")])
