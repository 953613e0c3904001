"""A server killed with SIGKILL leaves its run directory behind; the next start removes it (and
only directories whose owner is dead: a live server's stays)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from omni_server.identity import process_identity
from omni_server.pipeline.run_dirs import OWNER_FILE, RUN_DIR_PREFIX
from tests.helpers.pipelines import chain
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)


def _run_dir(owner: str) -> Path:
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    (run_dir / OWNER_FILE).write_text(owner)
    (run_dir / "c.sock").write_text("")  # what a dead run leaves: sockets, the plan
    return run_dir


async def test_start_removes_run_directories_of_dead_servers_only(tmp_path):
    dead_pid = _run_dir("4194303 1")  # above any pid_max: never a live process
    reused_pid = _run_dir(f"{os.getpid()} 1")  # our pid, another start time: a reused pid
    live = _run_dir(process_identity(os.getpid()))
    try:
        async with running(chain(tmp_path, "split")):
            assert not dead_pid.exists() and not reused_pid.exists()
            assert live.exists()
    finally:
        for path in (dead_pid, reused_pid, live):
            if path.exists():
                for child in path.iterdir():
                    child.unlink()
                path.rmdir()
