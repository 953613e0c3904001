"""A process down makes unavailable only the models whose stages it hosts: a speech model keeps
serving while the thinker's only process is gone."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from omni_server.pipeline import PipelineError
from omni_server.pipeline.supervision import SupervisionPolicy
from tests.helpers.pipelines import build, stage_toml
from tests.helpers.repo import toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)


async def test_a_dead_process_stops_only_the_models_that_use_it(tmp_path):
    stages = {
        "a": stage_toml(
            "Add",
            toml("""
                terminal = true
                [parameters]
                k = 1
            """),
            "pa",
        ),
        "b": stage_toml(
            "Add",
            toml("""
                terminal = true
                [parameters]
                k = 2
            """),
            "pb",
        ),
    }
    models = toml("""
        [models.one]
        entry = "a"
        tasks = ["speech"]
        [models.two]
        entry = "b"
        tasks = ["chat"]
    """)
    plan = build(tmp_path, stages, models)
    async with running(plan, supervision=SupervisionPolicy(restart=False)) as runtime:
        one, two = runtime.plan.models["one"], runtime.plan.models["two"]
        pid = runtime.processes()["pb@r0"]
        os.kill(pid, signal.SIGKILL)
        while runtime.unavailable_for(two) is None:  # the death arrives through the pidfd
            await asyncio.sleep(0.01)
        assert runtime.unavailable_for(one) is None
        assert "no live replica of pb" in str(runtime.unavailable_for(two))
        result = await asyncio.wait_for(runtime.submit(one, {"values": []}).result(), 30)
        with pytest.raises(PipelineError) as err:
            runtime.submit(two, {"values": []})
    assert result["values"] == [1]
    assert err.value.code == "unavailable"
