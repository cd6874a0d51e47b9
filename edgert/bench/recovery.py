"""The recovery benchmark: a real SIGKILL mid-step, recovery vs restart, the cost of replication.

Run by ``edgert bench recovery`` (edgert/cli/bench.py). One run, on loopback,
with real ``edgert worker`` processes (LocalCluster); the model and data are the demo's
(``cnn`` on scikit-learn's digits, 4 stages, 1F1B, batch 64 in 4 micro-batches, lr 3e-3).
Every fault-tolerant run gets the same ``devices.json``, profiled once at the start, so no
run (nor the restart below) spends time profiling.

Sections (``rows``; the figures are in ``ratios``):

- ``throughput``: ``--repeats`` pairs of undisturbed runs on one cluster, in ABBA order, with
  the default fault tolerance (``--replicate-every K``, ``--central-every``) and with it off
  (both 0). Samples/s over the steady steps (after ``--warmup``, a whole number of K-step
  periods, so the window holds its share of copies). ``replication_overhead`` is
  ``1 - median(with / without)`` over the pairs, the fraction of throughput replication
  costs; ``replication_overhead_range`` its extremes over the pairs (this host's speed drifts
  by 10-20% from run to run). ``replication_overhead_local`` is the same cost measured
  within runs, which the drift does not touch: the step time in excess of the neighbouring
  steps' median at the steps where copies are made (:func:`copy_step_excess`), in the runs
  with copies less the same figure at the same steps in the runs without (noise alone).
  The first run with replication is the undisturbed reference of ``accuracy_delta_pp``.
- ``kill``: the same run on 4 fresh workers; once step ``--kill-at`` has completed and
  worker ``--victim`` is computing a forward or a backward, it gets SIGKILL.
  ``recovery_s`` is the wall-clock time from the kill until the first step after the
  recovery is recorded (``metrics.jsonl``, read as it is written); the run's ``recovery``
  event gives ``detection_s``, ``replan_s``, ``transfer_s``, ``total_s`` and ``steps_lost``
  (completed steps after the snapshot, replayed). ``accuracy_delta_pp``: the final test
  accuracy of this run against the reference, in percentage points.
- ``two_failures``: two workers killed at once: non-adjacent ones (stages 0 and 2) with one
  replica, adjacent ones (1 and 2) with ``--replicas 2``, no coordinator copies
  (``--central-every 0``). ``..._ok``: the run finished every step on the 2 survivors.
- ``restart``: the alternative to recovery, on 4 fresh workers: the coordinator runs as an
  ``edgert train`` process with coordinator snapshots as often as the replicas
  (``--central-every K``); at the same kill point the victim *and the coordinator* get
  SIGKILL, the survivors are stopped, the exporter's stage cache is deleted, 3 fresh
  worker processes start, and ``edgert train --resume`` (a fresh coordinator process)
  reloads the newest snapshot from disk, re-exports the plan for the 3 workers and trains
  on. ``restart_s`` is the time from the kill until its first step is recorded, plus the
  ``detection_s`` of the ``kill`` run (a restart has to notice the failure too).
  ``recovery_vs_restart = restart_s / recovery_s``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgert.bench.faults import MetricsTail, Outcome, run_and_kill
from edgert.bench.harness import (
    Column,
    Progress,
    Target,
    cell,
    heading,
    line,
    option,
    progress_field,
    ratio,
    result,
    table,
    target_lines,
)
from edgert.bench.runs import LISTEN, steady_rate, train_config
from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.errors import EdgertError
from edgert.schedule import SCHEDULES, microbatches_per_step

STAGES = 4
COMPUTING = ("forward", "backward")  # a victim's /health activity while it computes: "mid-step"
EDGERT_TRAIN = [sys.executable, "-m", "edgert", "train"]


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; the defaults take about 2 minutes on a 2-core machine."""

    model: str = option("cnn", "Zoo model (the demo's).")
    steps: int = option(100, "Steps of every run.")
    kill_at: int = option(50, "Kill once this step has completed, while the victim computes.")
    victim: int = option(2, "Stage whose worker is killed.")
    replicate_every: int = option(20, "K: steps between replicas.")
    central_every: int = option(100, "Steps between copies to the coordinator.")
    batch_size: int = option(64, "Samples per step.")
    micro_batches: int = option(4, "Micro-batches per step.")
    schedule: str = option("1f1b", "Pipeline schedule.", choices=SCHEDULES)
    learning_rate: float = option(3e-3, "Learning rate of the exported plan.", flag="--lr")
    threads: int = option(1, "ORT intra-op threads per worker session.")
    repeats: int = option(6, "Pairs of throughput runs (with / without replication, alternating).")
    warmup: int = option(10, "Steps left out of each throughput figure.")
    keep: Path | None = option(None, "Write the plan, runs and logs here (default: a temporary folder).", type=Path)
    progress: Progress = progress_field()

    def check(self) -> None:
        if self.steps < 2 or not 0 <= self.kill_at < self.steps - 1:
            raise EdgertError(f"--kill-at must be between 0 and --steps - 2 (got {self.kill_at}, steps {self.steps})")
        if not 0 <= self.victim < STAGES:
            raise EdgertError(f"--victim must be a stage index, 0 to {STAGES - 1} (got {self.victim})")
        if self.replicate_every < 1 or self.repeats < 1 or self.threads < 1:
            raise EdgertError("--replicate-every, --repeats and --threads must be at least 1")
        if self.warmup >= self.steps:
            raise EdgertError(f"--warmup {self.warmup} leaves no step of --steps {self.steps} to measure")


def run(config: BenchConfig = BenchConfig()) -> dict[str, Any]:
    """Run the whole benchmark; returns ``{"rows": [...], "ratios": {...}, ...}``."""
    config.check()
    with tempfile.TemporaryDirectory(prefix="edgert-recovery-") as scratch_name:
        scratch = Path(config.keep or scratch_name)
        scratch.mkdir(parents=True, exist_ok=True)
        return _Bench(config, scratch).run()


class _Bench:
    def __init__(self, config: BenchConfig, scratch: Path):
        self.config = config
        self.scratch = scratch
        self.plan = scratch / "plan"
        self.devices = scratch / "devices.json"
        self.say = config.progress

    # -- the runs --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        self._prepare()
        throughput = self._throughput()
        kill = self._kill()
        two = [self._two_failures([0, 2], replicas=1), self._two_failures([1, 2], replicas=2)]
        restart = self._restart(detection_s=kill["detection_s"])
        reference = throughput["reference_accuracy"]
        ratios = {
            "recovery_s": kill["recovery_s"],
            "steps_lost": kill["steps_lost"],
            "restart_s": restart["restart_s"],
            "recovery_vs_restart": ratio(restart["restart_s"], kill["recovery_s"], 2),
            "replication_overhead": throughput["overhead"],
            "replication_overhead_range": throughput["overhead_range"],
            "replication_overhead_local": throughput["overhead_local"],
            "accuracy_delta_pp": _pp(kill["test_accuracy"], reference),
            "two_failures_nonadjacent_ok": two[0]["ok"],
            "two_failures_nonadjacent_recovery_s": two[0]["recovery_s"],
            "two_failures_adjacent_r2_ok": two[1]["ok"],
            "two_failures_adjacent_r2_recovery_s": two[1]["recovery_s"],
        }
        c = self.config
        return result([*throughput["rows"], kill, *two, restart], ratios, model=c.model, steps=c.steps,
                      kill_at=c.kill_at, replicate_every=c.replicate_every, central_every=c.central_every,
                      schedule=c.schedule, seconds=round(time.monotonic() - started, 1))

    def _prepare(self) -> None:
        from edgert.coordinator.profiling import profile_devices
        from edgert.devices import save_devices
        from edgert.exporter.export import ExportOptions, export_plan
        from edgert.manifest import TrainingConfig
        from edgert.models import build_model, save_model

        c = self.config
        model = self.scratch / f"{c.model}.onnx"
        save_model(build_model(c.model), model)
        training = TrainingConfig(learning_rate=c.learning_rate)
        export_plan(model, self.plan, ExportOptions(stages=STAGES, training=training))
        self.say(f"exported {c.model} in {STAGES} stages; profiling {STAGES} local workers")
        with self._cluster(STAGES) as cluster:
            micro = c.batch_size // microbatches_per_step(c.schedule, c.micro_batches)
            save_devices(profile_devices(self.plan / "source.onnx", cluster.urls, micro_batch=micro, repeats=2),
                         self.devices)

    def _config(self, workers: list[str], out: Path, **options) -> TrainConfig:
        c = self.config
        settings = dict(steps=c.steps, epochs=1_000, batch_size=c.batch_size, micro_batches=c.micro_batches,
                        schedule=c.schedule, forward_threads=c.threads, backward_threads=c.threads,
                        replicate_every=c.replicate_every, central_every=c.central_every, devices=self.devices)
        settings.update(options)
        if not (settings["replicate_every"] or settings["central_every"]):
            settings["devices"] = None  # fault tolerance off: no planner, nothing to profile
        return train_config(self.plan, workers, out, **settings)

    def _cluster(self, count: int, names: list[str] | None = None) -> LocalCluster:
        return LocalCluster(count, names=names, log_dir=self.scratch / "worker-logs")

    def _kill_mid_step(self, job: Callable[[], Any], cluster: LocalCluster, out: Path, victims: list[int],
                       **options) -> Outcome:
        """Run ``job``; SIGKILL ``victims`` once step ``--kill-at`` has completed, while one computes."""
        step = self.config.kill_at
        return run_and_kill(job, cluster, out, victims, poll_s=0.002, **options,
                            when=lambda health, completed: completed >= step and health.activity.startswith(COMPUTING))

    def _throughput(self) -> dict[str, Any]:
        c = self.config
        rates: dict[bool, list[float]] = {True: [], False: []}
        records: dict[bool, list[list[dict[str, Any]]]] = {True: [], False: []}
        reference = None
        with self._cluster(STAGES) as cluster:
            for attempt in range(c.repeats):
                for replicated in (True, False) if attempt % 2 == 0 else (False, True):  # ABBA: drift cancels
                    tag = "with" if replicated else "without"
                    out = self.scratch / f"throughput-{attempt}-{tag}"
                    options = {} if replicated else {"replicate_every": 0, "central_every": 0}
                    summary = train(self._config(cluster.urls, out, **options))
                    records[replicated].append(read_metrics(out))
                    rates[replicated].append(steady_rate(records[replicated][-1], c.warmup, c.replicate_every))
                    if replicated and reference is None:
                        reference = summary.test_accuracy
                    self.say(f"throughput {attempt + 1}/{c.repeats} {tag} replication: "
                             f"{rates[replicated][-1]:.1f} samples/s")
        pairs = [w / wo for w, wo in zip(rates[True], rates[False])]
        # the same step-time excess at the copy steps, in the runs without copies: what noise alone gives
        local = {replicated: copy_step_excess(records[replicated], c.warmup, c.replicate_every, c.central_every)
                 for replicated in (True, False)}
        rows = [{"section": "throughput", "run": "replication on" if replicated else "replication off",
                 "replicate_every": c.replicate_every if replicated else 0,
                 "central_every": c.central_every if replicated else 0,
                 "samples_per_s": [round(r, 1) for r in rates[replicated]],
                 "median_samples_per_s": round(statistics.median(rates[replicated]), 1),
                 "copy_step_excess": round(local[replicated], 4)} for replicated in (True, False)]
        rows[0]["first_run_test_accuracy"] = reference  # the undisturbed reference of the kill run
        return {"rows": rows, "reference_accuracy": reference,
                "overhead": round(1 - statistics.median(pairs), 4),
                "overhead_range": [round(1 - max(pairs), 4), round(1 - min(pairs), 4)],
                "overhead_local": round(local[True] - local[False], 4)}

    def _kill(self) -> dict[str, Any]:
        c = self.config
        out = self.scratch / "kill"
        with self._cluster(STAGES) as cluster:
            outcome = self._kill_mid_step(lambda: train(self._config(cluster.urls, out)), cluster, out, [c.victim])
        summary, kill = outcome.result, outcome.kill
        events = kill.events("recovery")
        if summary.recoveries != 1 or len(events) != 1:
            raise EdgertError(f"expected one recovery after the kill, the run recorded {len(events)}")
        event = events[0]
        row = {"section": "kill", "run": f"kill stage {c.victim} mid-step", "victims": [c.victim],
               "killed_after_step": kill.step, "activity": kill.activity,
               "recovery_s": _round(kill.resumed_after_s()), **_recovery_fields(event),
               "steps": summary.steps, "test_accuracy": summary.test_accuracy}
        self.say(f"kill: recovered in {row['recovery_s']} s, {row['steps_lost']} steps replayed")
        return row

    def _two_failures(self, victims: list[int], replicas: int) -> dict[str, Any]:
        c = self.config
        label = "adjacent" if victims[1] - victims[0] == 1 else "non-adjacent"
        out = self.scratch / f"two-{label}-r{replicas}"
        run = f"kill stages {victims[0]} and {victims[1]} ({label}), {replicas} replica{'s' * (replicas > 1)}"
        row: dict[str, Any] = {"section": "two_failures", "run": run, "victims": victims, "replicas": replicas,
                               "ok": False, "recovery_s": None}
        with self._cluster(STAGES) as cluster:
            try:
                outcome = self._kill_mid_step(
                    lambda: train(self._config(cluster.urls, out, replicas=replicas, central_every=0)), cluster, out,
                    victims)
            except EdgertError as error:
                row["error"] = str(error)
                self.say(f"two failures ({label}): not survived: {error}")
                return row
        summary, kill = outcome.result, outcome.kill
        events = kill.events("recovery")
        victim_names = {cluster.names[v] for v in victims}
        carried_on = bool(events) and not victim_names & set(events[-1]["workers"])  # on survivors only
        row.update(ok=summary.steps == c.steps and carried_on,
                   recovery_s=_round(kill.resumed_after_s()), recoveries=len(events),
                   **(_recovery_fields(events[-1]) if events else {}), test_accuracy=summary.test_accuracy)
        self.say(f"two failures ({label}, {replicas} replicas): ok={row['ok']}, recovered in {row['recovery_s']} s")
        return row

    def _restart(self, detection_s: float) -> dict[str, Any]:
        """Kill the victim and the coordinator; stop everything; resume from the coordinator's snapshot."""
        c = self.config
        out = self.scratch / "restart"
        logs = self.scratch / "coordinator-logs"
        logs.mkdir(exist_ok=True)
        cluster = self._cluster(STAGES)
        cluster.start()
        try:
            survivors = [name for k, name in enumerate(cluster.names) if k != c.victim]
            command = [*EDGERT_TRAIN, str(self.plan), "--workers", ",".join(cluster.urls),
                       "--out", str(out), "--steps", str(c.steps), "--epochs", "1000",
                       "--batch-size", str(c.batch_size), "--micro-batches", str(c.micro_batches),
                       "--schedule", c.schedule, "--threads", str(c.threads),
                       "--replicate-every", str(c.replicate_every), "--central-every", str(c.replicate_every),
                       "--devices", str(self.devices), "--listen", LISTEN, "--insecure"]
            with open(logs / "first.log", "wb") as log:
                coordinator = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
                try:
                    kill = self._kill_mid_step(coordinator.wait, cluster, out, [c.victim],
                                               on_kill=coordinator.kill).kill
                finally:
                    coordinator.kill()
                    coordinator.wait(10)
        finally:
            cluster.stop()
        stopped = time.monotonic()
        shutil.rmtree(out / "stage-cache", ignore_errors=True)  # the exporter starts from nothing
        with self._cluster(STAGES - 1, names=survivors) as fresh:
            workers_up = time.monotonic()
            tail = MetricsTail(out)
            tail.poll()
            before = len(tail.records)
            command = [*EDGERT_TRAIN, "--resume", str(out), "--workers", ",".join(fresh.urls), "--json"]
            with open(logs / "resume.log", "wb") as log:
                launched = time.monotonic()
                resumed = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log)
                first = _first_step_after(tail, "resume", resumed, before)
                output, _ = resumed.communicate(timeout=300)
        if resumed.returncode != 0 or first is None:
            raise EdgertError(f"edgert train --resume failed (exit {resumed.returncode}); see {logs / 'resume.log'}")
        seen, step = first
        event = next(r for _, r in tail.records[before:] if r.get("event") == "resume")
        opened = event["process_started_s"]  # the run's time_s when the resumed coordinator opened the run log
        log_started = seen - (step["time_s"] - opened)  # the same moment, on this process's monotonic clock
        summary = json.loads(output)
        restart_s = detection_s + seen - kill.at
        row = {"section": "restart", "run": "restart from the coordinator's snapshot",
               "killed_after_step": kill.step, "activity": kill.activity, "restart_s": round(restart_s, 3),
               "detection_s": detection_s, "stop_s": round(stopped - kill.at, 3),
               "workers_start_s": round(workers_up - stopped, 3),
               "coordinator_start_s": round(log_started - launched, 3),
               "replan_restore_s": round(event["time_s"] - opened, 3),
               "first_step_s": round(step["time_s"] - event["time_s"], 3),
               "snapshot_step": event["snapshot_step"], "steps_lost": kill.step - event["snapshot_step"],
               "new_cuts": event["cuts"], "steps": summary["steps"], "test_accuracy": summary["test_accuracy"]}
        self.say(f"restart: first step {restart_s:.2f} s after the kill")
        return row


def copy_step_excess(runs: list[list[dict[str, Any]]], warmup: int, every: int, central_every: int,
                     after: int = 3, around: int = 10) -> float:
    """The share of the steady steps' time spent in excess at the steps where copies are made.

    A stage copies its state after step ``s`` when ``s + 1`` is a multiple of ``every`` (or of
    ``central_every``); steps ``s`` to ``s + after - 1`` (the copy, its send, its receipt) are
    compared with the median of the other steps among the ``around`` on either side. Local, so
    a host whose speed drifts from run to run still gives a precise figure (for ``every``
    well above ``after``).
    """
    excess = total = 0.0
    for records in runs:
        times = {m["step"]: m["step_ms"] for m in records if m["type"] == "step" and m["step"] >= warmup}
        copies = [s for s in times if (s + 1) % every == 0 or (central_every and (s + 1) % central_every == 0)]
        touched = {s for step in copies for s in range(step, step + after)}
        for step in copies:
            hit = [s for s in range(step, step + after) if s in times]
            near = [times[s] for s in range(step - around, step + after + around) if s in times and s not in touched]
            if near:
                excess += sum(times[s] for s in hit) - len(hit) * statistics.median(near)
        total += sum(times.values())
    return excess / total if total else 0.0


def _first_step_after(tail: MetricsTail, event: str, process: subprocess.Popen,
                      skip: int) -> tuple[float, dict[str, Any]] | None:
    """The first step recorded after ``event`` and when it was seen (None: ``process`` ended first)."""
    seen_event = False
    while True:
        running = process.poll() is None
        tail.poll()
        for seen, record in tail.records[skip:]:
            seen_event = seen_event or record.get("event") == event
            if seen_event and record["type"] == "step":
                return seen, record
        skip = len(tail.records)
        if not running:
            return None
        time.sleep(0.005)


def _recovery_fields(event: dict[str, Any]) -> dict[str, Any]:
    keys = ("detection_s", "replan_s", "transfer_s", "total_s", "snapshot_step", "resume_step", "steps_lost",
            "new_cuts", "workers")
    return {key: event.get(key) for key in keys}


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _pp(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(abs(a - b) * 100, 3)


# -- reporting ------------------------------------------------------------------------------------


def targets(result: dict[str, Any]) -> list[Target]:
    """Every target (``steps_lost``'s bound is the run's ``--replicate-every``)."""
    return [
        Target("recovery_s", "<=", 3.0, "seconds from the SIGKILL to the first step after recovery"),
        Target("steps_lost", "<=", result["replicate_every"], "steps replayed (at most --replicate-every)"),
        Target("recovery_vs_restart", ">=", 10.0, "restart from the coordinator's snapshot / recovery"),
        Target("replication_overhead", "<=", 0.05, "throughput lost to replication (A/B runs)"),
        Target("replication_overhead_local", "<=", 0.05, "the same, within runs (step time at the copy steps)"),
        Target("accuracy_delta_pp", "<=", 1.0, "test accuracy, killed run vs undisturbed (pp)"),
        Target("two_failures_nonadjacent_ok", "==", True, "two non-adjacent failures, 1 replica"),
        Target("two_failures_adjacent_r2_ok", "==", True, "two adjacent failures, 2 replicas"),
    ]


THROUGHPUT_COLUMNS = (
    Column("fault tolerance", 18, "run", left=True),
    Column("replicate/central", 19, lambda row: f"{row['replicate_every']}/{row['central_every']}"),
    Column("median samples/s", 18, "median_samples_per_s", "{:.1f}"),
    Column("copy steps", 12, "copy_step_excess", "{:.2%}"),
    Column("  runs", 0, lambda row: f"  {row['samples_per_s']}", left=True),
)
FAILURE_COLUMNS = (
    Column("run", 50, "run", left=True),
    Column("ok", 4, lambda row: "yes" if row.get("ok", True) else "NO"),
    Column("resumed s", 11, "recovery_s", "{:.3f}"), Column("detect s", 10, "detection_s", "{:.3f}"),
    Column("replan s", 10, "replan_s", "{:.3f}"), Column("move s", 8, "transfer_s", "{:.3f}"),
    Column("lost", 6, "steps_lost", "{}"), Column("accuracy", 10, "test_accuracy", "{:.4f}"),
)


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report."""
    rows, figures = result["rows"], result["ratios"]
    lines = [f"Recovery ({result['model']}, {STAGES} workers, {result['steps']} steps, {result['schedule']}, "
             f"--replicate-every {result['replicate_every']}, kill after step {result['kill_at']})", "",
             "Throughput (undisturbed runs, alternating)",
             *table(THROUGHPUT_COLUMNS, [row for row in rows if row["section"] == "throughput"])]
    low, high = figures["replication_overhead_range"]
    lines.append(f"replication overhead: {figures['replication_overhead']:.2%} (pairs from {low:.2%} to {high:.2%}); "
                 f"within runs, at the copy steps: {figures['replication_overhead_local']:.2%}")
    lines += ["", f"Failures (undisturbed accuracy: {cell(rows[0].get('first_run_test_accuracy'), '{:.4f}')})",
              heading(FAILURE_COLUMNS)]
    for row in rows:
        if row["section"] in ("kill", "two_failures"):
            lines.append(line(FAILURE_COLUMNS, row))
            if "error" in row:
                lines.append(f"    error: {row['error']}")
    restart = next((row for row in rows if row["section"] == "restart"), None)
    if restart is not None:
        lines += ["", "Restart from the coordinator's snapshot (the baseline)",
                  f"  {restart['detection_s']:.3f} s detection (the kill run's)",
                  f"+ {restart['stop_s']:.3f} s stopping the coordinator and the survivors",
                  f"+ {restart['workers_start_s']:.3f} s starting {STAGES - 1} fresh worker processes",
                  f"+ {restart['coordinator_start_s']:.3f} s starting `edgert train --resume` (process, imports, data)",
                  f"+ {restart['replan_restore_s']:.3f} s connecting, re-planning, exporting {STAGES - 1} stages "
                  f"afresh, assigning them, restoring the snapshot",
                  f"+ {restart['first_step_s']:.3f} s to its first step",
                  f"= {restart['restart_s']:.3f} s; resumed after step {restart['snapshot_step']} "
                  f"({restart['steps_lost']} steps lost), final accuracy {cell(restart['test_accuracy'], '{:.4f}')}"]
    lines += ["", *target_lines(targets(result), figures, missing="FAIL")]
    lines.append(f"  (two failures, seconds to resume: non-adjacent "
                 f"{cell(figures.get('two_failures_nonadjacent_recovery_s'))}, adjacent with 2 replicas "
                 f"{cell(figures.get('two_failures_adjacent_r2_recovery_s'))}; benchmark took {result['seconds']} s)")
    return "\n".join(lines)
