"""A stage process killed under load: its requests fail fast, nothing leaks, nothing hangs."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from omni_server.pipeline import PipelineError
from tests.helpers.pipelines import chain
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)


async def test_sigkill_under_load_fails_in_flight_requests_and_leaks_nothing(tmp_path):
    plan = chain(tmp_path, "split")
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        handles = [runtime.submit(model, {"values": [i], "sleep": 0.05}) for i in range(40)]
        await handles[0].result()  # the pipeline is busy: b works through a queue of ~40
        victim = runtime.processes()["b@r0"]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        outcomes = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
        failed_within = time.monotonic() - killed_at
        print(f"\nin-flight requests failed {failed_within * 1000:.0f} ms after SIGKILL")

        failures = [o for o in outcomes if isinstance(o, PipelineError)]
        assert failures, "no request was in flight when the process died"
        assert all(isinstance(o, dict | PipelineError) for o in outcomes)
        for error in failures:
            assert error.code == "process_died" and error.stage == "b"
            assert error.message == "process b@r0 exited with code -9"
        # no stage has a timeout here: without the death noticed they would wait forever; the
        # bound only catches that (measured well under a second), not the speed of a loaded CI
        assert failed_within < 30.0
        assert not runtime.healthy and runtime.ready
        with pytest.raises(PipelineError) as err:
            runtime.submit(model, {"values": [0]})
        assert err.value.code == "unavailable" and "b@r0" in err.value.message
    # running() checked on exit: every process gone, no segment, no run directory


async def test_stop_with_requests_in_flight_fails_them_and_leaves_nothing(tmp_path):
    plan = chain(tmp_path, "split")
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        handles = [runtime.submit(model, {"values": [i], "sleep": 0.05}) for i in range(20)]
        await handles[0].result()
        await runtime.stop()  # running() stops again on exit: stop is idempotent
        outcomes = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, PipelineError)]
        assert failed and all(e.code == "unavailable" for e in failed)
        assert not runtime.ready and runtime.processes() == {}
        with pytest.raises(PipelineError):
            runtime.submit(model, {"values": [0]})
