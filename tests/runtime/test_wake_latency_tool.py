"""tools/wake_latency.py: a real blocked reader in another process, woken after idle gaps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "wake_latency.py"

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the tool forks its receiver")


def test_every_gap_gets_a_latency_and_the_ratio_is_theirs():
    result = subprocess.run([sys.executable, str(TOOL), "--gaps-us", "0,2000", "--rounds", "20", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert [row["gap_us"] for row in figures["rows"]] == [0, 2000]
    for row in figures["rows"]:
        assert 0 < row["p10_us"] <= row["median_us"] < 100_000  # a wake, not a timeout
        assert 0 < row["write_median_us"] < 100_000
    busy, idle = (row["median_us"] for row in figures["rows"])
    assert figures["wake_idle_vs_busy"] == pytest.approx(idle / busy, rel=0.01)


def test_a_malformed_gap_is_refused_in_one_line():
    result = subprocess.run([sys.executable, str(TOOL), "--gaps-us", "0,soon"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("got '0,soon'")
