"""Replica binding: one replica per replicated process per request, sticky and balanced; the
`binding` policies (round robin, least loaded) and the in-flight counts least_loaded reads."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import threading

import pytest

from omni_server.pipeline import PipelineError
from tests.helpers.pipelines import stream
from tests.helpers.runtime import running

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
        for _ in range(600):  # 30 s at most: the stage processes close them on their own time
            if len(list(markers.glob("*-gone"))) == 2:
                break
            await asyncio.sleep(0.05)
        closed = {p.name: p.read_text() for p in markers.glob("*-gone")}
        assert closed == {"speak-gone": str(bound), "voice-gone": str(bound)}


async def _replica_of(handle) -> int:
    """The `back` replica a streaming request runs on, from its first chunk."""
    first = await anext(aiter(handle))
    return first["where"][1]


@pytest.mark.parametrize(
    ("binding", "expected"),
    [("round_robin", [1, 0, 1, 0]), ("least_loaded", [1, 1, 1, 1])],
)
async def test_binding_policy_with_a_long_request_on_replica_0(tmp_path, binding, expected):
    plan = stream(tmp_path / "repo", "replicated", back=2, binding=binding)
    assert plan.processes["back"].binding == binding
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        load = runtime.coordinator.replica_load
        long = runtime.submit(model, {"values": [0], "n": 1000, "delay": 0.01}, "long")
        async with long:
            assert await _replica_of(long) == 0  # a fresh coordinator starts at replica 0
            assert load("back") == (1, 0)

            replicas = []
            for i in range(4):  # one after another, while `long` keeps replica 0 busy
                async with runtime.submit(model, {"values": [i], "n": 2}, f"s{i}") as short:
                    admitted = load("back")
                    replica = await _replica_of(short)
                    assert admitted == ((2, 0) if replica == 0 else (1, 1))
                    await short.result()
                replicas.append(replica)
                assert load("back") == (1, 0)  # completion lowered the count
            assert replicas == expected

            failing = runtime.submit(model, {"values": [9], "n": 3, "fail_chunk": 1}, "bad")
            with pytest.raises(PipelineError) as err:
                await failing.result()
            assert err.value.code == "stage_failed"
            assert load("back") == (1, 0)  # failure lowered it

            # inputs the transport refuses: admission fails, nothing stays counted
            with pytest.raises(TypeError, match="cannot pickle"):
                runtime.submit(model, {"values": [0], "n": 1, "bad": threading.Lock()}, "unsent")
            assert load("back") == (1, 0)
        # leaving `async with` aborted `long`
        with pytest.raises(PipelineError) as err:
            await long.result()
        assert err.value.code == "aborted"
        assert load("back") == (0, 0) and runtime.coordinator.in_flight == 0

        # a burst spreads evenly under either policy (least_loaded: ties rotate)
        handles = [runtime.submit(model, {"values": [i], "n": 2}, f"b{i}") for i in range(6)]
        assert load("back") == (3, 3)
        await asyncio.gather(*(h.result() for h in handles))
        assert load("back") == (0, 0)


async def test_least_loaded_counts_return_to_zero_after_process_death_and_stop(tmp_path):
    plan = stream(tmp_path / "repo", "replicated", back=2, binding="least_loaded")
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        load = runtime.coordinator.replica_load
        slow = {"values": [0], "n": 1000, "delay": 0.01}
        handles = [runtime.submit(model, slow, f"r{i}") for i in range(6)]
        assert load("back") == (3, 3)
        assert {await _replica_of(h) for h in handles} == {0, 1}

        os.kill(runtime.processes()["back@r1"], signal.SIGKILL)
        on_r1 = [h for h in handles if h.id in {"r1", "r3", "r5"}]
        for handle in on_r1:
            with pytest.raises(PipelineError) as err:
                await handle.result()
            assert err.value.code == "process_died"
        assert load("back") == (3, 0)

        await runtime.stop()  # fails the rest as unavailable
        for handle in handles:
            if handle not in on_r1:
                with pytest.raises(PipelineError) as err:
                    await handle.result()
                assert err.value.code == "unavailable"
        assert load("back") == (0, 0) and runtime.coordinator.in_flight == 0
