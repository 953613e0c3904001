"""The server process dies hard: its stage processes follow, and the next start cleans up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.pipelines import chain
from tests.helpers.proc import alive, run_segments
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

SERVER = textwrap.dedent(
    """
    import asyncio, json, sys
    from omni_server.compiler.compiler import compile_repository
    from omni_server.pipeline import Runtime

    async def main():
        runtime = Runtime(compile_repository(sys.argv[1]))
        await runtime.start()
        model = runtime.plan.models["m"]
        await runtime.submit(model, {"values": [0]}).result()  # every ring in use
        group = runtime.stage_processes
        print(json.dumps({"pids": list(runtime.processes().values()), "run_id": group.run_id,
                          "run_dir": str(group.run_dir)}), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


async def test_stage_processes_die_with_a_killed_server_and_leftovers_are_removed(tmp_path):
    plan = chain(tmp_path / "repo", "split")
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tmp_path / "repo")],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    info: dict = {}
    try:
        line = server.stdout.readline()
        assert line, "the server process exited before it reported its stage processes"
        info = json.loads(line)
        assert len(info["pids"]) == 3 and all(alive(p) for p in info["pids"])
        assert run_segments(info["run_id"])  # the run's rings exist
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in info["pids"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in info["pids"] if alive(p)], "stage processes outlived the server"
        assert run_segments(info["run_id"]), "nobody was left to clean up: segments remain"
        async with running(plan):  # a new server removes what the dead run left
            assert run_segments(info["run_id"]) == []
    finally:
        server.kill()
        server.wait()
        if info:
            shutil.rmtree(info["run_dir"], ignore_errors=True)
