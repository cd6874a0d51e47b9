"""The pipeline benchmark: its figures from step records, and one short real run of ``edgert bench pipeline``."""

import json
import subprocess
import sys

import pytest

from edgert.bench.pipeline import WARMUP, pipeline_figures
from edgert.bench.trace_hops import trace_hops
from edgert.coordinator.tracefile import TraceWriter
from edgert.ort_import import training_folder
from edgert.schedule import simulate


def _step(step_ms: float, forward: float, backward: float, optimizer: float) -> dict:
    stages = [{"forward_ms": forward * 8, "backward_ms": backward * 8, "optimizer_ms": optimizer}] * 4
    return {"type": "step", "step_ms": step_ms, "stages": stages}


def test_pipeline_figures_from_step_records():
    # 4 equal stages, 8 micro-batches of 1 ms forward and 2 ms backward, a 0.5 ms optimizer step.
    records = [_step(999.0, 5, 5, 5)] + [_step(ms, 1.0, 2.0, 0.5) for ms in (60.0, 70.0, 80.0)]
    figures = pipeline_figures(records, stages=4, microbatches=8, skip=1)  # the first is warm-up
    assert figures["ideal_ms"] == pytest.approx((8 * 3.0 + 0.5) * 4 / 4)
    assert figures["simulated_ms"] == pytest.approx(simulate("1f1b", [1.0] * 4, [2.0] * 4, 8) + 0.5)
    assert figures["measured_ms"] == 70.0


def test_hops_in_a_trace_run_from_the_producers_end_to_the_end_of_the_wait(tmp_path):
    trace = TraceWriter(tmp_path / "trace.json", started=100.0)
    # step 0 (warm-up): a 50 ms hop. Step 1: stage 0 computes F1.0 until 100.010, stage 1 waits for it until
    # 100.012 (a 2 ms hop), and its B1.0 ends at 100.030; stage 0 waits for that gradient until 100.033 (3 ms).
    # Step 2: stage 1's wait ended before stage 0's F2.0 did (it waited for something else): no hop
    trace.spans("w0", 0, [("F0.0", 99.0, 0.001), ("F1.0", 100.0, 0.010), ("wait grad", 100.011, 0.022),
                          ("B1.0", 100.033, 0.005), ("F2.0", 100.040, 0.010)])
    trace.spans("w1", 1, [("wait act", 99.0, 0.051), ("F0.0", 99.051, 0.001), ("wait act", 100.005, 0.007),
                          ("F1.0", 100.012, 0.004), ("B1.0", 100.020, 0.010),
                          ("wait act", 100.040, 0.001), ("F2.0", 100.050, 0.002)])
    trace.close()
    figures = trace_hops(tmp_path / "trace.json", skip_steps=1)
    assert figures["hops"] == 2
    assert figures["act_median_ms"] == pytest.approx(2.0, abs=0.01)
    assert figures["grad_median_ms"] == pytest.approx(3.0, abs=0.01)
    assert figures["all_median_ms"] == pytest.approx(2.5, abs=0.01)  # the median of two is their mean
    everything = trace_hops(tmp_path / "trace.json")
    assert everything["hops"] == 3 and everything["act_p90_ms"] == pytest.approx(50.0, abs=0.01)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_benchmark_prints_rows_and_ratios(tmp_path):
    command = [sys.executable, "-m", "edgert", "bench", "pipeline", "--json", "--steps", "5", "--repeat", "1",
               "--pipeline-steps", "6", "--keep", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    runs = [(row["run"], row.get("slowdown")) for row in data["rows"]]
    variants = [(f"edgert_4stage_1f1b{name}", slowdown) for slowdown in ("1", "8")
                for name in ("", "_side_by_side", "_split_backward")]
    # the bare ORT Training loop runs where the training build is (the reference extra)
    bare = [("bare_ort", None)] if training_folder() is not None else []
    assert runs[:3 + len(bare)] == [("idle_hop", None), *bare, ("edgert_1stage", None), ("stage_call", None)]
    assert runs[3 + len(bare):9 + len(bare)] == variants
    ratios = data["ratios"]
    hop, call = data["rows"][0], data["rows"][2 + len(bare)]
    # an idle hop costs more than the same bytes over a raw socket, and less than a step's worth of time
    assert 0 < hop["raw_tcp_median_ms"] < hop["median_ms"] < 50 and ratios["hop_vs_raw_tcp"] > 1
    assert 0 < call["bare_backward_ms"] and 0 < call["backward_1row_ms"] <= call["backward_ms"] * 1.5
    assert 0 < call["accumulate_ms"] < call["backward_ms"]  # part of the runtime's backward
    assert 0 < ratios["call_vs_bare_session"] <= 1.2
    # this 2-core host cannot give each worker its cores: the emulated run is the headline, and it says so
    assert data["cores"] >= 16 or (data["headline"].startswith("slowdown 8") and data["headline_suffix"] == "")
    assert 0 < ratios["f1b_vs_simulated_slowdown1"] <= 1.1
    assert ratios["f1b_bound"] == pytest.approx(8 / 11, abs=1e-3)
    assert (0 < ratios["one_stage_vs_bare_ort"] < 2) if bare else ratios["one_stage_vs_bare_ort"] is None
    # a pipeline cannot beat its own schedule with free messages by more than measurement noise
    assert 0 < ratios["f1b_vs_ideal_4stages"] <= ratios["f1b_schedule_ceiling"] * 1.1
    assert 0 < ratios["f1b_vs_simulated"] <= 1.1
    # a same-run ratio of two trainings of the same shape (the gain itself is the benchmark's to show, not a test's)
    for name in ("side_by_side", "split_backward"):
        assert 0 < ratios[f"{name}_vs_one_after_the_other"] < 3
        assert 0 < ratios[f"{name}_vs_one_after_the_other_slowdown1"] < 3
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "metrics.jsonl").is_file()
    # the hops the pipeline met (its trace) cost at least what an idle hop does, less than a step
    pipelined = data["rows"][3 + len(bare)]
    assert pipelined["hops"] > 0 and 0 < pipelined["hop_all_p10_ms"] <= pipelined["hop_all_median_ms"] < 1000
    assert ratios["hop_in_pipeline_vs_idle_slowdown1"] > 0 and ratios["hop_in_pipeline_vs_idle"] > 0
    # edgert's runs take the warm-up steps the bare loop and the peer take, and measure the 6 after them
    steps = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(WARMUP + 6))
