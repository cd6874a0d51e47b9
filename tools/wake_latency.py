#!/usr/bin/env python3
"""How long this machine takes to wake a process whose CPU has been idle: what a hop pays per thread it wakes.

A hop wakes the receiver's transport loop and then its waiting compute thread (docs/RUNTIME.md,
"Measured"); in a pipeline of slow devices each of them has been idle for milliseconds when the
tensor arrives. On a virtual machine an idle CPU halts after at most ``guest_halt_poll_ns`` of
polling (the guest's haltpoll governor; printed where the guest has one), and waking a halted one
costs a VM exit and the host's wake of its thread, longer the longer it was idle. This measures it:
two processes on two different CPUs, the receiver blocked reading a pipe, the sender writing one
byte after the receiver has been idle ``gap`` (spinning the last 100 us itself, so that only the
receiver's CPU was idle); the latency is the receiver's wake-up time stamp less the write's (one
monotonic clock), and the write's own time is what waking costs the sender. Printed per gap: the
latency's median and 10th percentile, the write's median; and the latency's median after the
longest gap over that with no gap (``wake_idle_vs_busy``).

Usage: python tools/wake_latency.py [--gaps-us 0,50,200,1000,5000] [--rounds 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

HALT_POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
SPIN_S = 100e-6  # the sender's own CPU is busy this long before it writes


def wake_latencies(gap_s: float, rounds: int, cpus: tuple[int, int] | None) -> tuple[list[float], list[float]]:
    """Microseconds from a write to the blocked reader's wake, and in the write, ``rounds`` times after ``gap_s``
    idle."""
    to_reader, from_writer = os.pipe()
    to_writer, from_reader = os.pipe()
    child = os.fork()
    if child == 0:  # the receiver: wakes, stamps, answers with the stamp
        try:
            if cpus:
                os.sched_setaffinity(0, {cpus[1]})
            while os.read(to_reader, 1) == b"w":
                os.write(from_reader, time.monotonic_ns().to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(to_reader)
    os.close(from_reader)
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
    latencies, writes = [], []
    try:
        for _ in range(rounds):
            deadline = time.monotonic() + gap_s
            if gap_s > SPIN_S:
                time.sleep(gap_s - SPIN_S)
            while time.monotonic() < deadline:
                pass
            written = time.monotonic_ns()
            os.write(from_writer, b"w")
            writes.append((time.monotonic_ns() - written) / 1000)
            woke = int.from_bytes(os.read(to_writer, 8), "little")
            latencies.append((woke - written) / 1000)
    finally:
        os.write(from_writer, b"q")
        os.waitpid(child, 0)
        os.close(from_writer)
        os.close(to_writer)
    return latencies, writes


def measure(gaps_us: list[int], rounds: int) -> dict:
    """The latencies per gap, and the machine facts that explain them."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = (usable[0], usable[1]) if len(usable) >= 2 else None
    rows = []
    for gap in gaps_us:
        latencies, writes = wake_latencies(gap / 1e6, rounds, cpus)
        latencies.sort()
        rows.append({"gap_us": gap, "median_us": round(statistics.median(latencies), 1),
                     "p10_us": round(latencies[len(latencies) // 10], 1),
                     "write_median_us": round(statistics.median(writes), 1)})
    busiest, idlest = min(rows, key=lambda r: r["gap_us"]), max(rows, key=lambda r: r["gap_us"])
    return {"rows": rows, "cpus": list(cpus) if cpus else None, "rounds": rounds,
            "guest_halt_poll_ns": int(HALT_POLL.read_text()) if HALT_POLL.exists() else None,
            "wake_idle_vs_busy": round(idlest["median_us"] / max(busiest["median_us"], 1e-3), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gaps-us", default="0,50,200,1000,5000",
                        help="idle gaps before each wake, microseconds, comma-separated")
    parser.add_argument("--rounds", type=int, default=300, help="wakes per gap")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    try:
        gaps = [int(g) for g in args.gaps_us.split(",")]
    except ValueError:
        parser.error(f"--gaps-us takes whole microseconds separated by commas, got {args.gaps_us!r}")
    if args.rounds < 1 or any(g < 0 for g in gaps):
        parser.error("--rounds must be at least 1 and every gap at least 0")
    figures = measure(gaps, args.rounds)
    if args.json:
        print(json.dumps(figures))
        return
    where = f"CPU {figures['cpus'][0]} wakes CPU {figures['cpus'][1]}" if figures["cpus"] else "one CPU"
    poll = figures["guest_halt_poll_ns"]
    print(f"wake latency after an idle gap ({where}; {figures['rounds']} wakes a gap"
          + (f"; the guest polls at most {poll / 1000:g} us before halting an idle CPU)" if poll is not None else ")"))
    for row in figures["rows"]:
        print(f"  idle {row['gap_us']:>6} us: median {row['median_us']:>7.1f} us, p10 {row['p10_us']:>7.1f} us; "
              f"the write {row['write_median_us']:.1f} us")
    print(f"wake_idle_vs_busy {figures['wake_idle_vs_busy']} (the longest gap's median over the shortest's)")


if __name__ == "__main__":
    main()
