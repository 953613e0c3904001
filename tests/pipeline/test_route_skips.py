"""Route methods that leave out some `next` stages: the skipped branches tell their receivers,
so fan-in stages merge what came, terminals left out are not waited for, and nothing hangs."""

from __future__ import annotations

import asyncio

import pytest

from omni_server.pipeline import PipelineError
from tests.helpers.pipelines import build, stage_toml
from tests.helpers.repo import toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

MODEL = """\
[models.m]
entry = "pre"
tasks = ["speech"]
"""


def _omni(root, layout: str):
    """The Qwen3-Omni shape: pre routes to a subset of [image, audio, mm]; mm waits for all
    three and merges what arrived. layout: 'one' process, 'split', or 'replicated' encoders."""
    proc = {
        "one": dict.fromkeys(("pre", "image", "audio", "mm"), "p"),
        "split": {"pre": "pre", "image": "image", "audio": "audio", "mm": "mm"},
        "replicated": {"pre": "pre", "image": "enc", "audio": "enc", "mm": "mm"},
    }[layout]
    stages = {
        "pre": stage_toml(
            "Split",
            toml("""
                next = ["image", "audio", "mm"]
                route = "route"
            """),
            proc["pre"],
        ),
        "image": stage_toml(
            "Add",
            toml("""
                next = "mm"
                [parameters]
                k = 10
            """),
            proc["image"],
        ),
        "audio": stage_toml(
            "Add",
            toml("""
                next = "mm"
                [parameters]
                k = 20
            """),
            proc["audio"],
        ),
        "mm": stage_toml(
            "Merge",
            toml("""
                wait_for = ["pre", "image", "audio"]
                merge = "merge"
                terminal = true
            """),
            proc["mm"],
        ),
    }
    processes = (
        toml("""
            [processes.enc]
            num_replicas = 2
        """)
        if layout == "replicated"
        else ""
    )
    return build(root, stages, MODEL, processes)


ROUTES = [
    (["image", "mm"], ["image", "pre"]),
    (["audio", "mm"], ["audio", "pre"]),
    (["image"], ["image"]),  # even the direct edge pre -> mm is skipped
    ("mm", ["pre"]),
    (["image", "audio", "mm"], ["audio", "image", "pre"]),
]


@pytest.mark.parametrize("layout", ["one", "split", "replicated"])
async def test_fan_in_merges_only_the_branches_the_route_chose(tmp_path, layout):
    async with running(_omni(tmp_path, layout)) as runtime:
        model = runtime.plan.models["m"]
        handles = [
            runtime.submit(model, {"values": [i], "route": route, "trace": []})
            for i in range(4)
            for route, _ in ROUTES
        ]
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 60)
    k = {"pre": None, "image": 10, "audio": 20}
    for n, result in enumerate(results):
        i, (_, merged) = n // len(ROUTES), ROUTES[n % len(ROUTES)]
        assert result["merged"] == merged
        expected = [v for name in merged for v in ([i] if k[name] is None else [i, k[name]])]
        assert result["values"] == expected
        assert [t[0] for t in result["trace"]] == [*(m for m in merged if m != "pre"), "mm"]


def _two_terminals(root, processes: bool):
    """pre routes to [left, speak]: left -> tail (terminal); speak --stream_to--> voice
    (terminal, started by the stream). Leaving out one branch skips one terminal."""
    p = (lambda name: name) if processes else (lambda name: "p")
    stream = toml("""
        [scheduler]
        kind = "stream"
    """)
    stages = {
        "pre": stage_toml(
            "Split",
            toml("""
                next = ["left", "speak"]
                route = "route"
            """),
            p("pre"),
        ),
        "left": stage_toml(
            "Add",
            toml("""
                next = "tail"
                [parameters]
                k = 1
            """),
            p("left"),
        ),
        "tail": stage_toml(
            "Add",
            toml("""
                terminal = true
                [parameters]
                k = 2
            """),
            p("tail"),
        ),
        "speak": stage_toml("Speak", 'stream_to = "voice"\n' + stream, p("speak")),
        "voice": stage_toml("Voice", "terminal = true\n" + stream, p("voice")),
    }
    return build(root, stages, MODEL)


@pytest.mark.parametrize("processes", [True, False], ids=["split", "one-process"])
async def test_route_skipping_a_terminal_completes_with_the_others(tmp_path, processes):
    async with running(_two_terminals(tmp_path, processes)) as runtime:
        model = runtime.plan.models["m"]

        async def one(route):
            async with runtime.submit(model, {"values": [7], "n": 3, "route": route}) as handle:
                chunks = [c async for c in handle]
                return chunks, await handle.result()

        (left_chunks, left), (speak_chunks, speak), (_, both) = await asyncio.wait_for(
            asyncio.gather(one("left"), one(["speak"]), one(["left", "speak"])), 60
        )
        # all skipped: a clear failure, at once; the pipeline still serves afterwards
        with pytest.raises(PipelineError) as err:
            await asyncio.wait_for(runtime.submit(model, {"values": [0], "route": []}).result(), 30)
        again = await asyncio.wait_for(
            runtime.submit(model, {"values": [8], "route": "left"}).result(), 30
        )
    assert set(left) == {"tail"} and left["tail"]["values"] == [7, 1, 2] and left_chunks == []
    assert set(speak) == {"voice"} and speak["voice"]["count"] == 3
    assert [c["audio"] for c in speak_chunks] == [0, 10, 20]
    assert set(both) == {"tail", "voice"} and both["voice"]["count"] == 3
    assert err.value.code == "stage_failed"
    assert "skipped every terminal stage (tail, voice)" in err.value.message
    assert again == {"tail": {**again["tail"], "values": [8, 1, 2]}}


async def test_single_terminal_skipped_fails_without_hanging(tmp_path):
    async with running(_omni(tmp_path, "split")) as runtime:
        model = runtime.plan.models["m"]
        handle = runtime.submit(model, {"values": [1], "route": [], "trace": []})
        with pytest.raises(PipelineError) as err:
            await asyncio.wait_for(handle.result(), 30)
        ok = await asyncio.wait_for(
            runtime.submit(model, {"values": [2], "route": "mm", "trace": []}).result(), 30
        )
    assert err.value.code == "stage_failed"
    assert err.value.message == "no result: route methods skipped every terminal stage (mm)"
    assert ok["merged"] == ["pre"] and ok["values"] == [2]
