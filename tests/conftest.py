"""Suite-wide guards: nothing the tests start may outlive them.

After the whole session: no child process of the test runner is left, and no shared-memory
segment of ours (`/dev/shm/omni-*`) remains. A leak fails the run loudly instead of hiding in CI.
A new segment that a live process still maps belongs to a server running beside the suite (a
developer's, another suite's), not to us: once our own processes are gone, none of ours is mapped.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
SEGMENT_PREFIX = "omni-"


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        found.extend(int(c) for c in children)
    return found


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody reaped holds no resources but its pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _describe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def _segments() -> set[str]:
    return {p.name for p in SHM.glob(f"{SEGMENT_PREFIX}*")} if SHM.is_dir() else set()


def _mapped_segments() -> set[str]:
    """Names of /dev/shm segments some live process maps."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended while we looked
            continue
        for line in text.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith(f"{SHM}/{SEGMENT_PREFIX}"):
                mapped.add(Path(path.split(" (deleted)")[0]).name)
    return mapped


@pytest.fixture(scope="session", autouse=True)
def no_leaks_after_suite():
    before = _segments()
    yield
    deadline = time.monotonic() + 10.0  # processes told to stop may take a moment to exit
    while time.monotonic() < deadline:
        alive = [p for p in _descendants(os.getpid()) if _running(p)]
        if not alive:
            break
        time.sleep(0.1)
    leaked_segments = sorted(_segments() - before - _mapped_segments())
    problems = [f"process {p}: {_describe(p)}" for p in alive]
    problems += [f"/dev/shm/{name}" for name in leaked_segments]
    assert not problems, "leaked after the test suite:\n  " + "\n  ".join(problems)
