"""The run folder: one run per folder, records a reader reads once per step, a trace streamed to
disk (bounded memory, readable after kill -9, continued by a resumed run), a summary of the
whole run across resumes."""

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest

from edgert.cli.train import print_summary
from edgert.coordinator.errors import TrainingError
from edgert.coordinator.ledger import StepLedger
from edgert.coordinator.run_summary import RunSummary, summarise
from edgert.coordinator.runlog import RunLog, claim_run_folder, new_run_folder, read_metrics
from edgert.coordinator.tracefile import read_trace
from edgert.exporter.export import ExportOptions, export_plan
from edgert.models import build_model, save_model
from edgert.protocol import StepReport

BATCH = 64


def report(step: int, stage: int, stages: int = 2) -> StepReport:
    last = stage == stages - 1
    return StepReport(step=step, stage=stage, samples=BATCH if last else 0, loss_sum=BATCH * 0.5,
                      started=100.0 + step, finished=100.5 + step, forward_ms=1.0, backward_ms=2.0,
                      spans=[(f"F{step}.{m}", 100.0 + step, 0.01) for m in range(4)]
                      + [(f"B{step}.{m}", 100.2 + step, 0.01) for m in range(4)] + [(f"S{step}", 100.4 + step, 0.01)])


def complete(ledger: StepLedger, steps: range, names=("w0", "w1")) -> None:
    for step in steps:
        ledger.reset_timing()  # each step then takes its own 500 ms
        ledger.expect(step, epoch=0, samples=BATCH)
        for stage, name in enumerate(names):
            ledger.add(report(step, stage, len(names)), name)


def test_memory_held_for_trace_and_steps_stays_bounded(tmp_path):
    """C3: spans go to disk as they come; the coordinator holds none of them, nor every step's record."""
    log = RunLog(tmp_path)
    ledger = StepLedger(log)
    ledger.configure(["w0", "w1"])
    complete(ledger, range(200))  # warm: every track named, the ledger's history full
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        complete(ledger, range(200, 2200))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown < 200_000, f"{grown} bytes more held after 2000 steps"  # a span list took ~10 MB
    log.close()
    spans = [e for e in read_trace(tmp_path / "trace.json") if e.get("ph") == "X"]
    assert len(spans) == 2200 * 2 * 9


def test_tracks_are_named_by_the_worker_that_ran_the_spans(tmp_path):
    """Item 6: after a recovery, stage 1 runs on another worker: its spans land on that worker's track."""
    log = RunLog(tmp_path)
    log.spans(1, "pi-1", [("F0.0", 100.0, 0.1)])
    log.spans(1, "pi-2", [("F1.0", 101.0, 0.1)])
    log.close()
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    spans = {e["name"]: (names[e["tid"]], e["args"]["stage"]) for e in trace if e.get("ph") == "X"}
    assert spans == {"F0.0": ("pi-1", 1), "F1.0": ("pi-2", 1)}
    assert names[0] == "events"  # the run's instants (re-plans, recoveries) have a named track too


WRITER = """
import sys, time
from edgert.coordinator.runlog import RunLog
log = RunLog(sys.argv[1], started=1000.0)
step = 0
while True:
    log.spans(step % 2, f"w{step % 2}", [(f"F{step}.0", 1000.0 + step, 0.001)] * 50)
    log.record("step", step=step)
    step += 1
    if step == 20:
        print("ready", flush=True)
"""


def test_a_killed_coordinator_leaves_a_readable_trace_that_a_resume_continues(tmp_path):
    """C3: kill -9 mid-run leaves trace.json readable; the resumed run appends to it, times continued."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(10)
    finally:
        writer.kill()
        writer.stdout.close()
    killed = read_trace(tmp_path / "trace.json")
    assert len([e for e in killed if e.get("ph") == "X"]) >= 20 * 50
    resumed = RunLog(tmp_path, started=1000.0)
    resumed.spans(0, "w0", [("F9999.0", 1500.0, 0.001)])
    resumed.spans(0, "w9", [("F10000.0", 1501.0, 0.001)])
    resumed.close()
    trace = json.loads((tmp_path / "trace.json").read_text())  # closed by the resumed run: plain JSON
    assert trace[:len(killed) - 1] == killed[:-1]  # (the killed run's last line may have been cut)
    tracks = {e["args"]["name"]: e["tid"] for e in trace if e.get("name") == "thread_name"}
    assert tracks == {"events": 0, "w0": 1, "w1": 2, "w9": 3}  # w0 kept its track; events on track 0
    resumed_span = next(e for e in trace if e["name"] == "F9999.0")
    assert resumed_span["tid"] == 1 and resumed_span["ts"] == pytest.approx(500e6)  # times from the run's start
    assert all(isinstance(r["step"], int) for r in read_metrics(tmp_path))  # no cut line left in the metrics


def test_replayed_steps_are_read_once_as_last_run(tmp_path):
    """Item 5: a recovery that resumes at step 3 supersedes the records of steps 3 and 4 and their evaluation."""
    log = RunLog(tmp_path)
    for step in range(5):
        log.record("step", step=step, loss=1.0)
    log.record("eval", epoch=0, step=4, test_loss=0.7)
    log.event("recovery", resume_step=3, snapshot_step=2, workers=["w0"])
    for step in range(3, 6):
        log.record("step", step=step, loss=0.5)
    log.record("eval", epoch=0, step=4, test_loss=0.6)
    log.close()
    seen = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in seen if r["type"] == "step"] == [
        (0, 1.0), (1, 1.0), (2, 1.0), (3, 0.5), (4, 0.5), (5, 0.5)]
    assert [r["test_loss"] for r in seen if r["type"] == "eval"] == [0.6]
    assert len([r for r in read_metrics(tmp_path, superseded=True) if r["type"] == "step"]) == 8


def test_a_folder_holds_one_run(tmp_path):
    """Item 4: a folder with a run is refused unless overwritten; the default folders never collide."""
    run = tmp_path / "same"
    claim_run_folder(run)  # absent: fine
    RunLog(run).close()
    (run / "checkpoints" / "latest").mkdir(parents=True)
    (run / "plan").mkdir()
    with pytest.raises(TrainingError, match=r"already holds a run; continue it with --resume .*--overwrite"):
        claim_run_folder(run)
    claim_run_folder(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["plan"]  # the plan may be the one being trained
    folders = {new_run_folder(tmp_path / "runs") for _ in range(3)}
    assert len(folders) == 3 and all(f.is_dir() and not any(f.iterdir()) for f in folders)


def test_summary_covers_every_process_of_a_resumed_run(tmp_path):
    """C4: two coordinator processes, two recoveries and a resume: the summary counts them all,
    also the time of the segment the killed coordinator never closed."""
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r", "workers": ["w0", "w1"],
                                                   "config": {"batch_size": BATCH, "epochs": 1,
                                                              "schedule": "1f1b"}}))
    first = RunLog(tmp_path, started=1000.0)
    ledger = StepLedger(first)
    ledger.configure(["w0", "w1"])
    started = ledger.begin_segment()
    complete(ledger, range(6))
    first.record("segment", first_step=0, started_s=started, seconds=3.5)  # cut short by a failure
    first.event("recovery", resume_step=4, snapshot_step=3, workers=["w0", "w1"])
    ledger.begin_segment()
    complete(ledger, range(4, 8))
    time.sleep(0.3)
    complete(ledger, range(8, 9))  # killed after this step, before the segment ended
    second = RunLog(tmp_path, started=1000.0)
    second.event("resume", snapshot_step=5, resume_step=6, workers=["w1", "w0"])
    ledger = StepLedger(second)
    ledger.configure(["w1", "w0"])
    started = ledger.begin_segment()
    complete(ledger, range(6, 10), names=("w1", "w0"))
    second.record("segment", first_step=6, started_s=started, seconds=2.0)
    summary = summarise(tmp_path)
    assert summary.recoveries == 1 and summary.steps == 10 and summary.samples == 10 * BATCH
    assert summary.train_seconds == pytest.approx(5.8, abs=0.25)  # 3.5 + 0.3 (unclosed) + 2.0
    assert summary.samples_per_s == pytest.approx(10 * BATCH / summary.train_seconds, rel=1e-3)
    assert summary.workers == ["w1", "w0"] and summary.train_loss == 0.5
    busy = 15 * 3.0 / 1000  # 15 steps ran, 3 ms of compute per stage each
    assert summary.stage_utilisation == pytest.approx([busy / summary.train_seconds] * 2, rel=1e-2)


def test_train_refuses_a_folder_holding_a_run_in_one_line(tmp_path):
    """Item 4, through the command line: exit non-zero, one line naming the folder and the ways out."""
    run = tmp_path / "run"
    RunLog(run).close()
    (tmp_path / "plan").mkdir()
    before = (run / "metrics.jsonl").read_bytes()
    done = subprocess.run([sys.executable, "-m", "edgert", "train", str(tmp_path / "plan"), "--workers",
                           "coap+tcp://127.0.0.1:9", "--insecure", "--out", str(run)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert errors == [f"error: --out {run} already holds a run; continue it with --resume {run}, "
                      f"replace it with --overwrite, or choose another --out"], done.stderr
    assert "Traceback" not in done.stderr and (run / "metrics.jsonl").read_bytes() == before


def test_resume_records_in_the_folder_it_is_given(tmp_path):
    """C2: a run folder moved elsewhere is resumed where it now is, not where run.json says it was."""
    from edgert.coordinator.coordinator import resumed_config

    moved = tmp_path / "moved"
    moved.mkdir()
    config = {"plan_dir": str(tmp_path / "plan"), "workers": ["coap+tcp://127.0.0.1:9"],
              "out_dir": str(tmp_path / "original"), "overwrite": False}
    (moved / "run.json").write_text(json.dumps({"run_id": "abc", "config": config}))
    resumed = resumed_config(moved)
    assert resumed.out_dir == moved and resumed.resume


def test_train_without_out_uses_a_new_folder_each_time_and_says_which(tmp_path):
    """Item 4: the default run folder never collides (here the runs fail at once: no worker answers)."""
    save_model(build_model("mlp"), tmp_path / "mlp.onnx")
    export_plan(tmp_path / "mlp.onnx", tmp_path / "plan", ExportOptions(stages=1))
    folders = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "edgert", "train", "plan", "--workers", "coap+tcp://127.0.0.1:9",
                               "--insecure"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        said = [line for line in done.stderr.splitlines() if line.startswith("run folder: ")]
        assert len(said) == 1, done.stderr
        folders.append(said[0].removeprefix("run folder: "))
    day = time.strftime("%Y-%m-%d")
    assert folders == [f"runs/{day}-1", f"runs/{day}-2"] and all((tmp_path / f).is_dir() for f in folders)


def test_a_summary_without_an_evaluation_is_printed(capsys):
    """A run that never reached an epoch's end has no test loss: the summary line says so."""
    summary = RunSummary(run_dir="runs/x", steps=3, epochs=1, samples=192, train_seconds=1.0, samples_per_s=192.0,
                         train_loss=2.0, test_loss=None, test_accuracy=None, schedule="1f1b")
    print_summary(summary, as_json=False)
    assert "test accuracy n/a, test loss n/a" in capsys.readouterr().out


def test_a_run_failing_before_it_records_anything_leaves_no_default_folder(tmp_path):
    """The folder edgert chose goes again when the run fails before writing to it (here: no plan)."""
    (tmp_path / "plan").mkdir()
    done = subprocess.run([sys.executable, "-m", "edgert", "train", "plan", "--workers", "coap+tcp://127.0.0.1:9",
                           "--insecure"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert (tmp_path / "runs").is_dir() and not any((tmp_path / "runs").iterdir()), done.stderr
