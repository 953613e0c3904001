"""The "ar" scheduler (continuous batching): requests join and leave a running batch between
steps, a refused request fails alone with the backend's 400-kind error, an abort reaches the
backend at once while the others go on, and a backend whose chunks are media has each request's
lead over its listener reported."""

from __future__ import annotations

import asyncio
import math

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import PipelineError
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

AR = """\
backend = "model.py:Counter"
terminal = true
[scheduler]
kind = "ar"
"""


def _plan(root):
    make_repo(
        root,
        {"counter": AR},
        toml("""
            [models.m]
            entry = "counter"
            tasks = ["chat"]
        """),
        {"counter": FIXTURES / "ar_stages.py"},
    )
    return compile_repository(root)


@pytest.mark.parametrize("inline", [False, True], ids=["process", "inline"])
async def test_requests_join_a_running_batch_and_leave_it(tmp_path, inline):
    async with running(_plan(tmp_path), inline=inline) as runtime:
        model = runtime.plan.models["m"]
        long = runtime.submit(model, {"n": 10**9}, request_id="long")
        chunks = aiter(long)
        first = await anext(chunks)  # the long request is running
        short = runtime.submit(model, {"n": 3}, request_id="short")
        short_chunks = [c async for c in short]
        result = await short.result()

        async def alone_again() -> dict:
            async for chunk in chunks:
                if "short" not in chunk["peers"]:
                    return chunk
            raise AssertionError("the long request ended")

        later = await asyncio.wait_for(alone_again(), 30)
        await long.abort()
    assert first["peers"] == ["long"]
    assert [c["i"] for c in short_chunks] == [0, 1, 2]
    # the short request joined the long one's batch, and left it when done
    assert all(c["peers"] == ["long", "short"] for c in short_chunks)
    assert later["peers"] == ["long"]
    assert result == {"count": 3, "aborted": []}


async def test_a_refused_request_fails_alone_as_the_callers_fault(tmp_path):
    async with running(_plan(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        good = runtime.submit(model, {"n": 5})
        bad = runtime.submit(model, {"n": -1})
        with pytest.raises(PipelineError) as err:
            await asyncio.wait_for(bad.result(), 30)
        assert (await asyncio.wait_for(good.result(), 30))["count"] == 5
    assert err.value.code == "invalid_request"
    assert (err.value.error_code, err.value.param) == ("bad_n", "n")
    assert err.value.message == "n must be >= 0, got -1"


async def test_an_abort_frees_the_request_in_the_backend_while_others_go_on(tmp_path):
    async with running(_plan(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        doomed = runtime.submit(model, {"n": 10**9}, request_id="doomed")
        await anext(aiter(doomed))
        await doomed.abort()
        with pytest.raises(PipelineError) as err:
            await doomed.result()
        # the abort travels as control, beside the data: later requests see it land
        for _ in range(200):
            after = await asyncio.wait_for(runtime.submit(model, {"n": 1}).result(), 30)
            if after["aborted"]:
                break
    assert err.value.code == "aborted"
    assert after["aborted"] == ["doomed"]  # the backend's abort() ran, exactly once


def _timed_plan(root):
    """Two ar stages with timeout_s 1: one whose backend can end a request early, one not."""
    stage = AR.replace("terminal = true\n", "terminal = true\ntimeout_s = 1\n")
    make_repo(
        root,
        {"finisher": stage.replace("Counter", "Finisher"), "counter": stage},
        toml("""
            [models.finishes]
            entry = "finisher"
            tasks = ["chat"]
            [models.fails]
            entry = "counter"
            tasks = ["chat"]
        """),
        {"finisher": FIXTURES / "ar_stages.py", "counter": FIXTURES / "ar_stages.py"},
    )
    return compile_repository(root)


@pytest.mark.parametrize("inline", [False, True], ids=["process", "inline"])
async def test_timeout_s_ends_a_request_early_where_the_backend_can(tmp_path, inline):
    """At its stage's timeout_s an ar request is ended by the backend's finish() (the answer so
    far is its result, as a length limit's); a backend without finish() fails it as timed out.
    Neither kills the process: the next request is served by the same one."""
    async with running(_timed_plan(tmp_path), inline=inline) as runtime:
        pids = runtime.processes()
        ended = runtime.submit(runtime.plan.models["finishes"], {"n": 10**9})
        chunks = [c async for c in ended]
        result = await ended.result()
        failed = runtime.submit(runtime.plan.models["fails"], {"n": 10**9})
        with pytest.raises(PipelineError) as timed_out:
            await failed.result()
        after = runtime.submit(runtime.plan.models["finishes"], {"n": 2})
        assert [c["i"] async for c in after] == [0, 1]
        assert runtime.processes() == pids and not runtime.restarts
    assert result["finish_reason"] == "length"
    assert result["count"] == len(chunks) > 0  # every chunk sent before the end, then the end
    assert timed_out.value.code == "timeout"


@pytest.mark.parametrize("inline", [False, True], ids=["process", "inline"])
async def test_a_media_backends_leads_are_reported_with_the_timings(tmp_path, inline):
    """A backend with `playback_seconds` has each request's smallest lead over a listener
    playing from its first chunk reported with its timings (what /metrics observes as
    omni_stage_stream_lead_seconds; below zero is an underrun); a plain one reports none."""
    make_repo(
        tmp_path,
        {"player": AR.replace("Counter", "Player"), "counter": AR},
        toml("""
            [models.plays]
            entry = "player"
            tasks = ["chat"]
            [models.plain]
            entry = "counter"
            tasks = ["chat"]
        """),
        {"player": FIXTURES / "ar_stages.py", "counter": FIXTURES / "ar_stages.py"},
    )
    leads: dict[str, list[float]] = {}
    async with running(compile_repository(tmp_path), inline=inline) as runtime:
        runtime.stage_observers.append(
            lambda stage, q, c, lead: leads.setdefault(stage, []).append(lead)
        )
        plays, plain = runtime.plan.models["plays"], runtime.plan.models["plain"]
        await asyncio.wait_for(runtime.submit(plays, {"n": 4, "plays": 30.0}).result(), 30)
        await asyncio.wait_for(runtime.submit(plays, {"n": 4, "plays": 0.001}).result(), 30)
        await asyncio.wait_for(runtime.submit(plain, {"n": 4}).result(), 30)
    ahead, behind = leads["player"]
    # its smallest lead: after its first chunk (30 s of audio), less the time until the second
    assert 0 < ahead < 30
    assert behind < 0  # 1 ms a chunk, 5 ms a step: the listener ran dry
    assert math.isnan(leads["counter"][0])
