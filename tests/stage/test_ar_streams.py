"""An "ar" stage fed by chunks (a `stream_to` target, as the Higgs vocoder is): each step takes
what waits for its requests (`Request.take_stream()`, never blocking); the stage steps only
while some request has chunks or its end waiting, or its backend says work is left
(`has_work()`); a terminal one is paced by its caller's credits. Below the runtime: the inbox's
non-blocking read itself."""

from __future__ import annotations

import asyncio

import pytest

from omni_server.backend import RequestAborted
from omni_server.compiler.compiler import compile_repository
from omni_server.stage.streams import StreamInbox
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)


def _plan(root, **parameters: float):
    """ticker (ar) --stream_to--> gatherer (ar, terminal), each in its own process."""
    table = "".join(f"{key} = {value}\n" for key, value in parameters.items())
    make_repo(
        root,
        {
            "ticker": toml("""
                backend = "model.py:Ticker"
                stream_to = "gatherer"
                [scheduler]
                kind = "ar"
            """),
            "gatherer": toml("""
                backend = "model.py:Gatherer"
                terminal = true
                [scheduler]
                kind = "ar"
                [parameters]
            """)
            + table,
        },
        toml("""
            [models.m]
            entry = "ticker"
            tasks = ["chat"]
        """),
        {"ticker": FIXTURES / "ar_stages.py", "gatherer": FIXTURES / "ar_stages.py"},
    )
    return compile_repository(root)


async def _gather(runtime, inputs):
    handle = runtime.submit(runtime.plan.models["m"], inputs)
    chunks = [chunk async for chunk in handle]
    return chunks, await asyncio.wait_for(handle.result(), 60)


@pytest.mark.parametrize("inline", [False, True], ids=["process", "inline"])
async def test_it_steps_when_chunks_come_not_in_between(tmp_path, inline):
    async with running(_plan(tmp_path), inline=inline) as runtime:
        chunks, result = await _gather(runtime, {"n": 5, "gap": 0.05})
    assert (result["seen"], result["sum"]) == (5, 0 + 1 + 2 + 3 + 4)
    assert [c["seen"] for c in chunks] == sorted(c["seen"] for c in chunks)
    # one step a chunk (and its end) over 250 ms; a loop stepping without input makes thousands
    assert result["steps"] <= 5 + 2


async def test_one_step_takes_every_chunk_that_waits(tmp_path):
    async with running(_plan(tmp_path, step_s=0.05)) as runtime:
        chunks, result = await _gather(runtime, {"n": 30})
    assert result["seen"] == 30 and sum(c["took"] for c in chunks) == 30
    assert max(c["took"] for c in chunks) > 1  # the chunks of a 50 ms step, read at once
    assert result["steps"] < 30


async def test_work_left_without_new_chunks_is_stepped_through(tmp_path):
    """All ten chunks arrive together and the backend works one a step: only has_work() gets
    the last ones done (no chunk is left to wake the stage)."""
    async with running(_plan(tmp_path, per_step=1)) as runtime:
        chunks, result = await _gather(runtime, {"n": 10})
    assert [c["took"] for c in chunks] == [1] * 10
    assert (result["seen"], result["sum"]) == (10, 45)


async def test_a_terminal_one_reads_nothing_while_its_caller_reads_nothing(tmp_path):
    """Credit pacing: a caller that reads no chunk for a while stops the stage reading its
    stream after a window of chunks, though another request keeps the stage stepping; the
    chunks that came meanwhile are read in one step once the caller reads on, none lost."""
    async with running(_plan(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        paused = runtime.submit(model, {"n": 100, "gap": 0.005})
        busy = asyncio.ensure_future(_gather(runtime, {"n": 400, "gap": 0.005}))
        await asyncio.sleep(1.5)  # the ticker's 100 chunks (0.5 s) have all come
        chunks = [chunk async for chunk in paused]
        result = await asyncio.wait_for(paused.result(), 60)
        busy_chunks, _ = await busy
    assert result["seen"] == 100 and sum(c["took"] for c in chunks) == 100
    assert max(c["took"] for c in chunks) >= 20  # the chunks that waited out the pause
    assert max(c["took"] for c in busy_chunks) < 20  # the other one was read as it came


def test_the_inbox_read_that_never_blocks():
    inbox = StreamInbox("r", ["a", "b"])
    assert inbox.take() == ([], False) and not inbox.ready
    inbox.put({"i": 0})
    inbox.put({"i": 1})
    inbox.paused = True
    assert inbox.take() == ([], False) and inbox.ready  # paused: the chunks stay queued
    inbox.paused = False
    assert inbox.take() == ([{"i": 0}, {"i": 1}], False)
    inbox.end("a", [])
    assert inbox.take() == ([], False)  # b has not ended
    inbox.put({"i": 2})
    inbox.end("b", [])
    assert inbox.ready
    assert inbox.take() == ([{"i": 2}], True)
    assert not inbox.ready  # its end was reported: nothing is left to step for
    assert inbox.take() == ([], True)  # and it stays ended
    aborted = StreamInbox("x", ["a"])
    aborted.put({"i": 0})
    aborted.abort()
    with pytest.raises(RequestAborted):
        aborted.take()
