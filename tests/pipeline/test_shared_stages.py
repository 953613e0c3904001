"""Stages shared by several models, and stages fed by several upstreams: what a request waits
for follows from its model's reachable graph, and a stage runs once per request."""

from __future__ import annotations

import asyncio

import pytest

from omni_server.pipeline import PipelineError
from tests.helpers.pipelines import build, stage_toml
from tests.helpers.repo import toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

STREAM = """\
[scheduler]
kind = "stream"
"""
TWO_MODELS = """\
[models.first]
entry = "speak_a"
tasks = ["speech"]
[models.second]
entry = "speak_b"
tasks = ["speech"]
"""


@pytest.mark.parametrize("processes", [True, False], ids=["split", "one-process"])
async def test_a_stream_target_shared_by_two_models_waits_only_for_its_models_streamer(
    tmp_path, processes
):
    """voice streams from speak_a (model first) and speak_b (model second): a request of one
    model never reaches the other streamer, so its stream must end without it."""
    p = (lambda name: name) if processes else (lambda name: "p")
    stages = {
        "speak_a": stage_toml("Speak", 'stream_to = "voice"\n' + STREAM, p("speak_a")),
        "speak_b": stage_toml("Speak", 'stream_to = "voice"\n' + STREAM, p("speak_b")),
        "voice": stage_toml("Voice", "terminal = true\n" + STREAM, p("voice")),
    }
    async with running(build(tmp_path, stages, TWO_MODELS)) as runtime:

        async def one(model: str, n: int):
            handle = runtime.submit(runtime.plan.models[model], {"n": n})
            chunks = [c async for c in handle]
            return chunks, await handle.result()

        (chunks_a, a), (chunks_b, b) = await asyncio.wait_for(
            asyncio.gather(one("first", 2), one("second", 3)), 60
        )
    assert a["count"] == 2 and [c["audio"] for c in chunks_a] == [0, 10]
    assert b["count"] == 3 and [c["audio"] for c in chunks_b] == [0, 10, 20]
    assert {c["src"][0] for c in chunks_a} == {"speak_a"}
    assert {c["src"][0] for c in chunks_b} == {"speak_b"}


async def test_a_stage_fed_by_two_upstreams_without_wait_for_fails_the_second_payload(tmp_path):
    """pre hands its payload to left and right, both feed tail (no wait_for): tail must not run
    twice for one request; the second payload fails the request naming what to declare."""
    stages = {
        "pre": stage_toml(
            "Add",
            toml("""
                next = ["left", "right"]
                [parameters]
                k = 0
            """),
            "p",
        ),
        "left": stage_toml(
            "Add",
            toml("""
                next = "tail"
                [parameters]
                k = 1
            """),
            "p",
        ),
        "right": stage_toml(
            "Add",
            toml("""
                next = "tail"
                [parameters]
                k = 2
            """),
            "p",
        ),
        # a slow terminal: the second payload arrives while the first still runs
        "tail": stage_toml("Speak", "terminal = true\n" + STREAM, "p"),
    }
    model = toml("""
        [models.m]
        entry = "pre"
        tasks = ["speech"]
    """)
    async with running(build(tmp_path, stages, model)) as runtime:
        handle = runtime.submit(runtime.plan.models["m"], {"values": [], "n": 2, "delay": 0.5})
        with pytest.raises(PipelineError) as err:
            await asyncio.wait_for(handle.result(), 30)
    assert err.value.code == "stage_failed" and err.value.stage == "tail"
    assert "a second payload for one request" in err.value.message
    assert "declares wait_for and merge" in err.value.message


@pytest.mark.parametrize("processes", [True, False], ids=["split", "one-process"])
async def test_models_sharing_a_stage_follow_only_their_own_stages(tmp_path, processes):
    """speak is terminal and streams to voice (the thinker -> voice shape): the model `text`
    names stages = ["speak"] and ends there; the model `spoken` goes on into the voice, and its
    handle tells the two terminals' chunks apart."""
    p = (lambda name: name) if processes else (lambda name: "p")
    stages = {
        "speak": stage_toml(
            "Speak",
            toml("""
                terminal = true
                stream_to = "voice"
            """)
            + STREAM,
            p("speak"),
        ),
        "voice": stage_toml("Voice", "terminal = true\n" + STREAM, p("voice")),
    }
    models = toml("""
        [models.text]
        entry = "speak"
        stages = ["speak"]
        tasks = ["chat"]
        [models.spoken]
        entry = "speak"
        tasks = ["chat"]
    """)
    async with running(build(tmp_path, stages, models)) as runtime:

        async def one(model: str):
            handle = runtime.submit(runtime.plan.models[model], {"n": 2})
            pairs = [pair async for pair in handle.stream()]
            return pairs, await handle.result()

        (text_pairs, text), (spoken_pairs, spoken) = await asyncio.wait_for(
            asyncio.gather(one("text"), one("spoken")), 60
        )
        assert runtime.plan.models["text"].stages == ("speak",)
        assert runtime.plan.models["spoken"].stages == ("speak", "voice")
    assert [stage for stage, _ in text_pairs] == ["speak", "speak"]
    assert text["n"] == 2  # one terminal: its payload is the result
    assert sorted(stage for stage, _ in spoken_pairs) == ["speak", "speak", "voice", "voice"]
    assert set(spoken) == {"speak", "voice"} and spoken["voice"]["count"] == 2
