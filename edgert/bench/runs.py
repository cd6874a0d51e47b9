"""Training runs as the benchmarks start them: a coordinator on loopback, and the rate of the steady steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.run_summary import RunSummary
from edgert.coordinator.runlog import read_metrics

LISTEN = "coap+tcp://127.0.0.1:0"  # every benchmark run's coordinator, in this process or an `edgert train` one


def train_config(plan: Path, workers: list[str], out: Path, **options: Any) -> TrainConfig:
    """The :class:`TrainConfig` of a benchmark run: on loopback (``LISTEN`` unless ``options`` say where), no
    progress line, ``options`` as given."""
    options = {"listen": LISTEN, "progress": False, **options}
    return TrainConfig(plan_dir=plan, workers=tuple(workers), out_dir=out, **options)


def train_run(plan: Path, workers: list[str], out: Path, **options: Any) -> tuple[RunSummary, list[dict[str, Any]]]:
    """Train to the end; the run's summary and its records (``metrics.jsonl``)."""
    summary = train(train_config(plan, workers, out, **options))
    return summary, read_metrics(out)


def steady_rate(records: list[dict[str, Any]], warmup: int, period: int = 1) -> float:
    """Samples per second over the steps after ``warmup``, cut to a whole number of ``period``-step windows."""
    steps = [m for m in records if m["type"] == "step"][warmup:]
    if len(steps) >= period:
        steps = steps[len(steps) % period:]
    return sum(m["samples"] for m in steps) / sum(m["step_ms"] / 1000 for m in steps)
