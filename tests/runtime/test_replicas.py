"""Replica binding: one replica per replicated process per request, sticky and balanced."""

from __future__ import annotations

import asyncio
import collections

import pytest

from tests.runtime.conftest import running
from tests.runtime.pipelines import stream

pytestmark = pytest.mark.timeout(120)


async def test_binding_is_sticky_across_payload_stream_completion_and_abort(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    plan = stream(tmp_path / "repo", "replicated", marker_dir=markers, front=2, back=3)
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]

        async def one(i):
            async with runtime.submit(model, {"values": [i], "n": 4}, f"r{i}") as handle:
                return [c async for c in handle], await handle.result()

        outcomes = await asyncio.gather(*(one(i) for i in range(12)))

        front, back = collections.Counter(), collections.Counter()
        for chunks, result in outcomes:
            assert len(chunks) == 4
            (a,) = {tuple(c["up"][0]) for c in chunks}  # a's replica, carried in the payload
            speak = {tuple(c["src"]) for c in chunks}  # every chunk came from one speak...
            voice = {tuple(c["where"]) for c in chunks}  # ...and went to one voice
            assert len(speak) == 1 and len(voice) == 1
            ((_, speak_replica, speak_pid),) = speak
            ((_, voice_replica, voice_pid),) = voice
            # speak and voice share process "back": the same replica, the same OS process
            assert (speak_replica, speak_pid) == (voice_replica, voice_pid)
            assert result["where"] == ["voice", voice_replica, voice_pid]  # completion too
            front[a[1]] += 1
            back[voice_replica] += 1
        assert front == {0: 6, 1: 6}  # round robin per process, chosen independently
        assert back == {0: 4, 1: 4, 2: 4}

        # abort: reaches the bound replica, whose generators close
        handle = runtime.submit(model, {"values": [0], "n": 1000, "delay": 0.01}, "gone")
        async with handle:
            first = await anext(aiter(handle))
        bound = first["where"][1]
        for _ in range(100):
            if len(list(markers.glob("*-gone"))) == 2:
                break
            await asyncio.sleep(0.05)
        closed = {p.name: p.read_text() for p in markers.glob("*-gone")}
        assert closed == {"speak-gone": str(bound), "voice-gone": str(bound)}
