"""A process's identity: its pid and its start time (clock ticks since boot, /proc/PID/stat
field 22). A reused pid has another start time, so an identity written by a process that died
is never mistaken for a live process: run directories and weight-sharing manifests name their
owner this way, and a later start removes what a dead owner left."""

from __future__ import annotations

from pathlib import Path


def process_identity(pid: int) -> str:
    """ "PID START" of a running process, or "" when `pid` runs no process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return f"{pid} {stat.rsplit(')', 1)[1].split()[19]}"


def alive(identity: str) -> bool:
    """Whether the process that wrote `identity` still runs."""
    pid = identity.split()[0] if identity else ""
    return pid.isdigit() and process_identity(int(pid)) == identity
