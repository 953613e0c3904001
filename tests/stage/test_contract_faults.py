"""A backend that breaks the contract fails its request with a message that says how, and the
pipeline (its processes included) keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import PipelineError
from tests.fixtures import FIXTURES
from tests.helpers.pipelines import build, stage_toml
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)


async def test_a_payload_that_cannot_cross_processes_fails_its_request_only(tmp_path):
    make_repo(
        tmp_path,
        {
            "make": toml("""
                backend = "model.py:Unpicklable"
                process = "a"
                next = "sink"
            """),
            "sink": toml("""
                backend = "Sink"
                process = "b"
                terminal = true
            """),
        },
        toml("""
            [models.m]
            entry = "make"
            tasks = ["speech"]
        """),
        {"make": FIXTURES / "faulty_stages.py"},
    )
    async with running(compile_repository(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        pids = runtime.processes()
        with pytest.raises(PipelineError) as err:
            await asyncio.wait_for(runtime.submit(model, {"unpicklable": True}).result(), 30)
        ok = await asyncio.wait_for(runtime.submit(model, {"value": 5}).result(), 30)
        assert runtime.processes() == pids and runtime.healthy
    assert err.value.code == "stage_failed" and err.value.stage == "make"
    assert "its output for sink cannot cross processes" in err.value.message
    assert ok == {"value": 5}


@pytest.mark.parametrize("chosen", [None, 3, ["left", 4]], ids=["none", "int", "mixed"])
async def test_a_route_returning_no_stage_names_fails_with_what_a_route_must_return(
    tmp_path, chosen
):
    stages = {
        "pre": stage_toml(
            "Split",
            toml("""
                next = ["left", "right"]
                route = "route"
            """),
            "p",
        ),
        "left": stage_toml(
            "Add",
            toml("""
                terminal = true
                [parameters]
                k = 1
            """),
            "p",
        ),
        "right": stage_toml(
            "Add",
            toml("""
                terminal = true
                [parameters]
                k = 2
            """),
            "p",
        ),
    }
    plan = build(
        tmp_path,
        stages,
        toml("""
            [models.m]
            entry = "pre"
            tasks = ["speech"]
        """),
    )
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        with pytest.raises(PipelineError) as err:
            await asyncio.wait_for(
                runtime.submit(model, {"values": [], "route": chosen}).result(), 30
            )
        ok = await asyncio.wait_for(
            runtime.submit(model, {"values": [], "route": "left"}).result(), 30
        )
    assert err.value.stage == "pre"
    assert "route() must return a stage name or a list of names among next" in err.value.message
    assert ok["left"]["values"] == [1]
