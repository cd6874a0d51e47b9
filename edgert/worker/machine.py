"""What this board has to train with: the cores this process may run on and its memory.

One place for the facts a worker reports about itself (``/profile``'s ``cores`` and
``memory_bytes``, ``edgert doctor``'s machine line).
"""

from __future__ import annotations

import os
from pathlib import Path


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a worker started under ``taskset``, or in a
    container given a cpuset, has fewer than the machine), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def memory_bytes(field: str = "MemAvailable") -> int:
    """A ``/proc/meminfo`` field in bytes (``MemAvailable``: what training may take; ``MemTotal``), 0 where
    unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
