"""``edgert bench groups``: hybrid placements and speed-weighted shares, each run short and checked for sense."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_benchmark_trains_a_hybrid_and_weighted_shares():
    command = [sys.executable, "-m", "edgert", "bench", "groups", "--json", "--steps", "12", "--warmup", "3",
               "--shares-batch-size", "256", "--kill-at", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout)
    rows = {row["run"]: row for row in outcome["rows"]}
    assert set(rows) == {"pipeline", "hybrid", "weighted_shares", "equal_shares", "group_member_killed"}
    assert all("+" not in stage for stage in rows["pipeline"]["stages"])  # a pure pipeline: one device a stage
    assert any("+" in stage for stage in rows["hybrid"]["stages"])  # the planner chose a group for cnn
    assert rows["hybrid"]["predicted_step_ms"] < rows["pipeline"]["predicted_step_ms"]
    weighted = rows["weighted_shares"]["shares"]
    # 1x..4x devices, shares as profiled: the 3x and 4x ones (a third apart) may swap under the suite's load
    assert weighted[0] > weighted[1] > max(weighted[2:]) and weighted[0] > 2 * min(weighted)
    assert rows["equal_shares"]["shares"] == [0.25] * 4
    assert outcome["ratios"]["hybrid_vs_pipeline"] > 1.0
    # the shares' gain is the benchmark's to show (1.04-1.32 in 12-step runs alone on this host, 0.93 and 0.97 in
    # two full-suite runs): a run this short is checked for sense only
    assert 0.5 < outcome["ratios"]["weighted_vs_equal_shares"] < 3.0
    killed = rows["group_member_killed"]
    assert killed["regrouped"] is True and killed["workers_after"] == ["s0", "s1a", "s2"]
    assert 0 <= outcome["ratios"]["group_steps_lost"] <= 6 and outcome["ratios"]["group_kill_to_next_step_s"] > 0
