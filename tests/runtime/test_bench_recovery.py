"""The recovery benchmark: the within-run overhead figure, and one short real run of ``edgert bench recovery``."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from edgert.bench.recovery import copy_step_excess
from edgert.bench.runs import steady_rate
from edgert.cli import main


def steps(times):
    return [{"type": "step", "step": k, "step_ms": ms, "samples": 64} for k, ms in enumerate(times)]


def test_copy_step_excess_counts_the_time_around_the_copies():
    flat = [10.0] * 40
    assert copy_step_excess([steps(flat)], warmup=0, every=10, central_every=0) == 0.0
    copied = list(flat)
    for step in (9, 19, 29, 39):
        copied[step] += 2.0  # a copy after every 10th step costs 2 ms
    assert copy_step_excess([steps(copied)], warmup=0, every=10, central_every=0) == pytest.approx(8 / 408)
    assert steady_rate(steps(flat), warmup=5, period=10) == pytest.approx(64 / 0.010)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_benchmark_measures_recovery_restart_and_overhead(tmp_path):
    command = [sys.executable, "-m", "edgert", "bench", "recovery", "--json", "--steps", "30", "--kill-at", "14",
               "--replicate-every", "5", "--central-every", "10", "--repeats", "1", "--warmup", "5",
               "--keep", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    ratios = data["ratios"]
    for key in ("recovery_s", "steps_lost", "restart_s", "recovery_vs_restart", "replication_overhead",
                "replication_overhead_local", "accuracy_delta_pp", "two_failures_nonadjacent_ok",
                "two_failures_nonadjacent_recovery_s", "two_failures_adjacent_r2_ok",
                "two_failures_adjacent_r2_recovery_s"):
        assert key in ratios, key
    assert 0 < ratios["recovery_s"] < 30 and 0 <= ratios["steps_lost"] <= 5
    assert ratios["restart_s"] > ratios["recovery_s"] and ratios["recovery_vs_restart"] > 1
    assert -1 < ratios["replication_overhead"] < 1 and -1 < ratios["replication_overhead_local"] < 1
    assert ratios["accuracy_delta_pp"] <= 1.0  # gpipe/1f1b replay exactly: the same weights, the same accuracy
    assert ratios["two_failures_nonadjacent_ok"] and ratios["two_failures_adjacent_r2_ok"]
    sections = [row["section"] for row in data["rows"]]
    assert sections == ["throughput", "throughput", "kill", "two_failures", "two_failures", "restart"]
    kill = data["rows"][2]
    assert kill["killed_after_step"] >= 14 and kill["activity"].startswith(("forward", "backward"))
    assert 1 <= len(kill["workers"]) <= 3 and kill["steps"] == 30  # the planner may leave a survivor out
    assert (tmp_path / "kill" / "metrics.jsonl").is_file()


def test_cli_has_the_recovery_benchmark():
    result = CliRunner().invoke(main, ["bench", "recovery", "--help"])
    assert result.exit_code == 0 and "--replicate-every" in result.output and "--kill-at" in result.output


def test_the_command_line_imports_a_benchmark_only_when_it_runs():
    code = ("import sys\nfrom click.testing import CliRunner\nfrom edgert.cli import main\n"
            "for args in (['--help'], ['bench', '--help'], ['worker', '--help']):\n"
            "    assert CliRunner().invoke(main, args).exit_code == 0, args\n"
            "print(sorted(name for name in sys.modules if name.startswith('edgert.bench')))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"
