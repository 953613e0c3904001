"""What /proc and /dev/shm say about processes and their shared-memory segments, for leak checks.

Every reader tolerates a process that ends while it looks: /proc entries vanish at any moment.
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Iterable
from pathlib import Path

from omni_server.identity import alive as identity_alive

SHM = Path("/dev/shm")
SEGMENT_PREFIX = "omni-"  # every segment of ours: `omni-RUN_ID-...` (see wire/channels.py)
RUN_DIR_PREFIX = "omni-run-"  # a runtime's run directory in the temp dir (pipeline/run_dirs.py)
OWNER_FILE = "owner"  # in a run directory: the identity of the process that owns it
PLAN_FILE = "plan.pkl"  # in a run directory: the plan its stage processes run
WORKER_MODULE = "omni_server.stage.worker"


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody reaped holds no resources but its pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def describe(pid: int) -> str:
    return " ".join(argv(pid)) or "?"


def worker_run_ids(pids: Iterable[int]) -> set[str]:
    """Run ids of the runtime workers among `pids` (`-m omni_server.stage.worker DIR RUN_ID
    ...`): a run names all its segments `omni-RUN_ID-*`."""
    ids = set()
    for pid in pids:
        args = argv(pid)
        if WORKER_MODULE in args[:-2]:
            ids.add(args[args.index(WORKER_MODULE) + 2])
    return ids


def run_segments(run_id: str) -> list[str]:
    """Names of the /dev/shm segments of one run."""
    return sorted(p.name for p in SHM.glob(f"{SEGMENT_PREFIX}{run_id}-*"))


def segments() -> set[str]:
    """Names of all our /dev/shm segments."""
    return {p.name for p in SHM.glob(f"{SEGMENT_PREFIX}*")} if SHM.is_dir() else set()


def mapped_segments(pids: Iterable[int] | None = None) -> set[str]:
    """Names of our /dev/shm segments that these processes (default: every process) map."""
    maps_files = (
        Path("/proc").glob("[0-9]*/maps")
        if pids is None
        else (Path(f"/proc/{pid}/maps") for pid in pids)
    )
    mapped = set()
    for maps in maps_files:
        try:
            text = maps.read_text()
        except OSError:  # the process ended while we looked
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith(f"{SHM}/{SEGMENT_PREFIX}"):
                mapped.add(Path(path.removesuffix(" (deleted)")).name)
    return mapped


def run_dirs() -> set[Path]:
    """The runtimes' run directories in the temp dir now (ours and other users' of the machine)."""
    return set(Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"))


def orphaned(run_dir: Path) -> bool:
    """A run directory whose owner no longer runs: left behind, not in use. One without an owner
    file is not judged (a runtime being born, or a directory a caller gave it)."""
    try:
        owner = (run_dir / OWNER_FILE).read_text().strip()
    except OSError:
        return False
    return not identity_alive(owner)


def served_repository(run_dir: Path) -> Path | None:
    """The repository whose plan a run directory holds: it tells whose run it was (a suite's
    own repositories live in its checkout or its pytest temp dir). None when unreadable."""
    try:
        with (run_dir / PLAN_FILE).open("rb") as f:
            return Path(pickle.load(f).repository)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return None  # half-written, or a plan of another checkout's code: not judged


def command_of(pid: int) -> str:
    """A process's command line, for messages ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return ""
