"""tools/planned_gain.py: real workers pinned to cores of their own, profiled, planned both ways, trained."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "planned_gain.py"

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")


def test_one_core_workers_are_planned_the_same_both_ways_and_each_plan_trains(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), "--workers", "2", "--cores-per-worker", "1", "--model", "mlp",
                             "--steps", "2", "--rounds", "1", "--json"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    plans = figures["plans"]
    # a device of one core has no second core for a forward lane: the side-by-side plan is the other one
    assert plans["side_by_side"] == plans["one_after_the_other"]
    assert set(plans["side_by_side"]["threads"]) == {"1/1"} and sum(plans["side_by_side"]["blocks"]) > 0
    assert figures["predicted_side_by_side_vs_one_after_the_other"] == 1.0
    assert all(len(rates) == 1 and rates[0] > 0 for rates in figures["samples_per_s"].values())
    assert figures["side_by_side_vs_one_after_the_other"] > 0
    assert figures["weight_share"] == 0.0  # profiled whole


def test_a_plan_for_the_split_backward_is_profiled_split_and_trains(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), "--variant", "split-backward", "--workers", "2",
                             "--cores-per-worker", "1", "--model", "mlp", "--steps", "2", "--rounds", "1", "--json"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert set(figures["plans"]) == {"whole_backward", "split_backward"}
    assert 0.0 < figures["weight_share"] < 0.7  # the profile timed the weight halves: part of each backward
    assert all(len(rates) == 1 and rates[0] > 0 for rates in figures["samples_per_s"].values())
    assert figures["split_backward_vs_whole_backward"] > 0
    assert figures["predicted_split_backward_vs_whole_backward"] >= 1.0  # the planner costs the split lower or equal


def test_more_cores_than_this_process_may_use_are_refused_in_one_line(tmp_path):
    cores = len(os.sched_getaffinity(0))
    result = subprocess.run([sys.executable, str(TOOL), "--workers", "2", "--cores-per-worker", str(cores)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == f"2 workers x {cores} cores need {2 * cores} CPUs; this process may use {cores}"
