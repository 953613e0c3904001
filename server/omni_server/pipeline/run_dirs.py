"""Run directories and shared-memory segments outlive a server killed with SIGKILL; the next
start removes what dead servers of this user left (never a live server's).

A run directory (`omni-run-*` in the temp dir, the ZMQ sockets and the pickled plan) names its
owner in its `owner` file (`identity.process_identity`); one whose owner no longer runs is
removed with the MPS daemon it may have left. Ring segments (`omni-RUNID-*` in /dev/shm) of runs
whose processes all died are unlinked through the transport (`unlink_leftovers` checks each
segment's users itself).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from omni_server.gpu import mps
from omni_server.identity import alive, process_identity
from omni_transport import unlink_leftovers

log = logging.getLogger(__name__)

RUN_DIR_PREFIX = "omni-run-"
OWNER_FILE = "owner"

_RUN_SEGMENT = re.compile(r"^omni-[0-9a-f]{8}-")


def claim(run_dir: Path) -> None:
    """Name this process the owner of `run_dir`: a later start removes it if we die unannounced."""
    (run_dir / OWNER_FILE).write_text(process_identity(os.getpid()))


def remove_dead_runs() -> None:
    """Remove the segments and run directories of our earlier servers that died without
    stopping."""
    _remove_dead_segments()
    _remove_dead_run_dirs()


def _remove_dead_run_dirs() -> None:
    root = Path(tempfile.gettempdir())
    for run_dir in root.glob(RUN_DIR_PREFIX + "*"):
        try:
            if run_dir.stat().st_uid != os.getuid():
                continue
            owner = (run_dir / OWNER_FILE).read_text().strip()
        except OSError:
            continue  # no owner file yet: a server being born, or not ours to judge
        if owner and not alive(owner):
            mps.remove_stale(run_dir)  # its MPS daemon outlived it
            shutil.rmtree(run_dir, ignore_errors=True)
            log.warning("removed the run directory %s of a dead server", run_dir)


def _remove_dead_segments() -> None:
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    runs = {m.group(0) for m in map(_RUN_SEGMENT.match, names) if m}
    removed = [name for run in sorted(runs) for name in unlink_leftovers(run)]
    if removed:
        log.warning("removed %d shared-memory segments of dead runs", len(removed))
