"""CPU time of a local server's process tree, per process and thread, from /proc (Linux).

`omni-bench speech --server-pid PID` snapshots the tree before and after each level: the delta
over the level's wall time is how many cores each thread kept busy. A stage whose compute thread
sits at 1.0 core while the machine has more is the bottleneck, whatever the queues say.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Snapshot:
    """CPU seconds so far. A process's figure comes from its own stat line, which keeps the time
    of threads that already exited (Flask starts a thread per request); threads are listed live."""

    processes: dict[tuple[int, str], float] = field(default_factory=dict)  # (pid, label)
    threads: dict[tuple[int, str], float] = field(default_factory=dict)  # (tid, "label/name:tid")


def _stat_fields(path: Path) -> list[str] | None:
    try:
        text = path.read_text()
    except OSError:  # the task ended between listing and reading
        return None
    return text.rsplit(")", 1)[1].split()  # fields after "pid (comm)", from state on


def _comm(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def _tree(pid: int, exclude: Collection[int] = ()) -> list[int]:
    """`pid` and its descendants, less the subtrees rooted at `exclude`."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in exclude:
            continue
        out.append(p)
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            with contextlib.suppress(OSError):
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return out


def _label(pid: int) -> str:
    """The process by what it runs: `omni_server` main or `worker <index>`."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return str(pid)
    if "omni_server.stage.worker" in argv:
        i = argv.index("omni_server.stage.worker")
        return f"worker{argv[i + 3]}" if len(argv) > i + 3 else "worker"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]  # e.g. piper.http_server
    return Path(argv[0]).name


def _cpu_seconds(stat: Path) -> float | None:
    fields = _stat_fields(stat)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime: fields 14, 15


def snapshot(pid: int, exclude: Collection[int] = ()) -> Snapshot:
    """The tree of `pid`, less the subtrees of `exclude` (a server the bench started itself is
    measured on its own, not as part of the bench)."""
    out = Snapshot()
    for p in _tree(pid, exclude):
        label = "main" if p == pid else _label(p)
        total = _cpu_seconds(Path(f"/proc/{p}/stat"))
        if total is None:
            continue
        out.processes[(p, label)] = total
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            seconds = _cpu_seconds(task / "stat")
            if seconds is not None:
                out.threads[(int(task.name), f"{label}/{_comm(task / 'comm')}:{task.name}")] = (
                    seconds
                )
    return out


def cores(before: Snapshot, after: Snapshot, wall: float, min_cores: float = 0.02) -> dict:
    """Cores kept busy over `wall` seconds: per thread, per process, and in total; threads and
    processes below `min_cores` are left out."""
    by_thread = {
        key[1]: (seconds - before.threads.get(key, 0.0)) / wall
        for key, seconds in after.threads.items()
    }
    by_process: dict[str, float] = {}
    for key, seconds in after.processes.items():
        used = (seconds - before.processes.get(key, 0.0)) / wall
        by_process[key[1]] = by_process.get(key[1], 0.0) + used
    return {
        "total": sum(by_process.values()),
        "processes": {k: v for k, v in sorted(by_process.items()) if v >= min_cores},
        "threads": {
            k: v for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1]) if v >= min_cores
        },
    }
