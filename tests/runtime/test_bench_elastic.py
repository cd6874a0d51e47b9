"""``edgert bench elastic``: a fast device joins slow ones mid-run and is put to work within a check period."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_a_joining_device_computes_soon_and_speeds_the_run_up():
    done = subprocess.run([sys.executable, "-m", "edgert", "bench", "elastic", "--json", "--steps", "40",
                           "--join-at", "6"], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout)
    (row,) = outcome["rows"]
    figures = outcome["ratios"]
    assert row["stages_after"] is not None and row["placed_before_step"] > row["joined_before_step"] - 1
    assert 0 <= figures["steps_until_work"] <= outcome["replan_every"]
    assert figures["predicted_gain"] >= 1.1
    assert figures["rate_after_vs_before"] > 1.1  # 8x faster device: the emulated run speeds up by ~2x
    assert any("accepted" in line for line in row["worker_console"])
    assert any("given stage" in line for line in row["worker_console"])
