#!/usr/bin/env python3
"""Recovery benchmark: a real SIGKILL mid-step on 4 workers, recovery vs restart, replication's cost.

Measures, in one run on loopback with real worker processes: the time from the kill to
the first step after recovery and the steps replayed; the same failure handled by
stopping everything and restarting from the coordinator's snapshot; the throughput lost
to replication; the test accuracy after a kill against an undisturbed run; and two
simultaneous failures (non-adjacent with 1 replica, adjacent with 2). See
edgert/bench/recovery.py for what each figure is exactly.

Usage: python tools/bench_recovery.py [--json] [--steps 100] [--kill-at 50] [--replicate-every 20]
       [--repeats 3] [--keep DIR]
(runs ``edgert bench recovery``, edgert/cli/bench.py; the implementation is edgert.bench.recovery).
"""

from edgert.cli.bench import recovery

if __name__ == "__main__":
    recovery()
