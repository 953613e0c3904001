"""The CPU cores and memory this server may use, asked once at the edge with the GPUs.

Both honour the limits a container or a unit puts on the server, not only the hardware: the
cores of its CPU affinity, fewer where the cgroup's `cpu.max` quota allows fewer, and the
physical memory, less where the cgroup's `memory.max` is lower. The compiler bounds the stage
processes a plan may start by them (`compiler.placement.check_machine`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")  # cgroup v2's unified hierarchy, as containers mount it


def cpus(cgroup: Path = CGROUP) -> int:
    """The cores this process may run on: its affinity, capped by the cgroup's quota."""
    count = len(os.sched_getaffinity(0))
    quota = _read(cgroup / "cpu.max").split()
    if len(quota) == 2 and quota[0].isdigit() and quota[1].isdigit() and int(quota[1]) > 0:
        count = min(count, max(1, math.ceil(int(quota[0]) / int(quota[1]))))
    return count


def memory_bytes(cgroup: Path = CGROUP) -> int:
    """The memory this process may use: physical memory, capped by the cgroup's limit."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _read(cgroup / "memory.max")
    return min(total, int(limit)) if limit.isdigit() else total


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # no cgroup v2 here, or not readable: no limit beyond the hardware's
        return ""
