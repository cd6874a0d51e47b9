"""``edgert bench state``: same-round ratios from the rows, and one short real run through the CLI whose receiver
holds no more than the state and two pieces."""

import json
import subprocess
import sys

import pytest

from edgert.bench.state import BenchConfig, _summary, format_table
from edgert.transport.pieces import PIECE_BYTES


def rows(raw_s: tuple[float, ...], push_s: tuple[float, ...], pull_s: tuple[float, ...], size: int = 10**8):
    made = []
    for index, seconds in enumerate(zip(raw_s, push_s, pull_s)):
        for way, s in zip(("raw-tcp", "coap-push", "coap-pull"), seconds):
            made.append({"round": index, "way": way, "bytes": size, "seconds": s, "mb_per_s": size / s / 1e6,
                         "receiver_extra_bytes": size + (PIECE_BYTES if way != "raw-tcp" else 0)})
    return made


def test_ratios_are_raw_time_over_coap_time_in_the_same_round_with_their_range():
    outcome = _summary(rows((1.0, 2.0, 1.0), (2.0, 2.5, 1.0), (4.0, 2.0, 1.0)), BenchConfig(size=10**8, rounds=3))
    figures = outcome["ratios"]
    assert figures["push_vs_raw"] == 0.8 and figures["push_vs_raw_range"] == [0.5, 1.0]
    assert figures["pull_vs_raw"] == 1.0 and figures["pull_vs_raw_range"] == [0.25, 1.0]
    assert figures["push_peak_over_bound"] == pytest.approx((10**8 + PIECE_BYTES) / (10**8 + 2 * PIECE_BYTES), abs=1e-3)
    assert "coap+tcp push vs raw TCP: 0.800 of its rate (rounds: 0.500 to 1.000)" in format_table(outcome)


def test_a_short_real_run_moves_the_state_both_ways_within_its_memory_bound():
    done = subprocess.run([sys.executable, "-m", "edgert", "bench", "state", "--size", "64000000", "--rounds", "1",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)["ratios"]
    assert figures["state_bytes"] > 64_000_000 and figures["rounds"] == 1
    assert figures["push_vs_raw"] > 0 and figures["pull_vs_raw"] > 0
    assert figures["push_peak_over_bound"] <= 1.0 and figures["pull_peak_over_bound"] <= 1.0, figures
