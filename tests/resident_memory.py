"""A process's resident memory, as the memory tests of tests/security measure it."""

from pathlib import Path


def resident_bytes(pid: int | str = "self") -> int:
    """VmRSS of process ``pid`` (this process by default), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")
