"""Start a runtime for a test and prove that stopping it leaves nothing behind."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from omni_server.compiler.plan import Plan
from omni_server.pipeline import Runtime
from tests.helpers.proc import alive, run_segments


@contextlib.asynccontextmanager
async def running(plan: Plan, **kwargs: Any) -> AsyncIterator[Runtime]:
    """A started runtime; on exit it is stopped and checked for leaks (processes, segments,
    run directory)."""
    runtime = Runtime(plan, **kwargs)
    await runtime.start()
    pids = list(runtime.processes().values())
    group = runtime.stage_processes
    try:
        yield runtime
    finally:
        await runtime.stop()
        await runtime.stop()  # idempotent
        assert not [p for p in pids if alive(p)], "stage processes outlived stop()"
        if group is not None:
            assert run_segments(group.run_id) == [], "shared-memory segments outlived stop()"
            assert not group.run_dir.exists(), "run directory outlived stop()"
