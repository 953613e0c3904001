"""End-to-end pipeline behaviour over real stage processes (and the inline placement)."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from omni_server.pipeline import PipelineError
from tests.helpers.pipelines import build, chain, stage_toml, stream
from tests.helpers.repo import toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

N = 24


async def _values(runtime, n: int = N) -> list[list[int]]:
    model = runtime.plan.models["m"]
    handles = [runtime.submit(model, {"values": [i]}) for i in range(n)]
    results = await asyncio.gather(*(h.result() for h in handles))
    return results


async def test_same_outputs_in_one_process_split_and_replicated(tmp_path):
    outputs = {}
    placements = {}
    for layout in ("one", "split", "replicated"):
        plan = chain(tmp_path / layout, layout)
        async with running(plan) as runtime:
            results = await _values(runtime)
        outputs[layout] = [r["values"] for r in results]
        placements[layout] = {(stage, pid) for r in results for stage, _, pid in r["trace"]}
    async with running(chain(tmp_path / "inline", "split"), inline=True) as runtime:
        outputs["inline"] = [r["values"] for r in await _values(runtime)]

    expected = [[i, 1, 2, 3] for i in range(N)]
    assert outputs == {k: expected for k in outputs}
    # the layouts really differ: 1 process, 3 processes, 1 + 3 replicas (b and c share a process)
    pids = {k: {pid for _, pid in v} for k, v in placements.items()}
    assert len(pids["one"]) == 1
    assert len(pids["split"]) == 3
    assert len(pids["replicated"]) == 5
    by_stage = collections.defaultdict(set)
    for stage, pid in placements["replicated"]:
        by_stage[stage].add(pid)
    assert by_stage["b"] == by_stage["c"] and len(by_stage["b"]) == 3


def _fan_in(root, processes: bool):
    p = (lambda name: name) if processes else (lambda name: "p")
    stages = {
        "split": stage_toml("Split", 'next = ["left", "right"]\n', p("split")),
        "left": stage_toml(
            "Add",
            toml("""
                next = "join"
                [parameters]
                k = 10
            """),
            p("left"),
        ),
        "right": stage_toml(
            "Add",
            toml("""
                next = "join"
                [parameters]
                k = 20
            """),
            p("right"),
        ),
        "join": stage_toml(
            "Merge",
            toml("""
                wait_for = ["left", "right"]
                merge = "merge"
                terminal = true
            """),
            p("join"),
        ),
    }
    return build(
        root,
        stages,
        toml("""
            [models.m]
            entry = "split"
            tasks = ["speech"]
        """),
    )


@pytest.mark.parametrize("processes", [True, False], ids=["split", "one-process"])
async def test_fan_in_merges_every_upstream_payload(tmp_path, processes):
    async with running(_fan_in(tmp_path, processes)) as runtime:
        model = runtime.plan.models["m"]
        results = await asyncio.gather(
            *(runtime.submit(model, {"values": [i]}).result() for i in range(8))
        )
    for i, result in enumerate(results):
        assert result["merged"] == ["left", "right"]
        assert result["values"] == [i, 10, i, 20]
        assert [t[0] for t in result["trace"]] == ["left", "right", "join"]


def _routes(root):
    stages = {
        "split": stage_toml(
            "Split",
            toml("""
                next = ["left", "right"]
                route = "route"
            """),
            "front",
        ),
        "left": stage_toml(
            "Add",
            toml("""
                terminal = true
                [parameters]
                k = 10
            """),
            "left",
        ),
        "right": stage_toml(
            "Add",
            toml("""
                terminal = true
                [parameters]
                k = 20
            """),
            "front",
        ),
    }
    return build(
        root,
        stages,
        toml("""
            [models.m]
            entry = "split"
            tasks = ["speech"]
        """),
    )


async def test_route_and_multi_terminal_merge(tmp_path):
    async with running(_routes(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        both = await runtime.submit(model, {"values": [0]}).result()
        left = await runtime.submit(model, {"values": [1], "route": "left"}).result()
        right = await runtime.submit(model, {"values": [2], "route": ["right"]}).result()
        bad = runtime.submit(model, {"values": [3], "route": "nowhere"})
        with pytest.raises(PipelineError) as err:
            await bad.result()
    assert set(both) == {"left", "right"}
    assert both["left"]["values"] == [0, 10] and both["right"]["values"] == [0, 20]
    assert set(left) == {"left"} and left["left"]["values"] == [1, 10]
    assert set(right) == {"right"} and right["right"]["values"] == [2, 20]
    assert err.value.code == "stage_failed" and err.value.stage == "split"
    assert "'nowhere'" in err.value.message and "stage split:" in err.value.message


@pytest.mark.parametrize("layout", ["split", "one"])
async def test_stream_to_chunks_arrive_in_order_with_end_marker(tmp_path, layout):
    async with running(stream(tmp_path, layout)) as runtime:
        model = runtime.plan.models["m"]

        async def one(n):
            async with runtime.submit(model, {"n": n}) as handle:
                chunks = [c async for c in handle]  # ends only at the terminal's end marker
                return chunks, await handle.result()

        outcomes = await asyncio.gather(*(one(n) for n in (0, 1, 7, 30)))
    for n, (chunks, result) in zip((0, 1, 7, 30), outcomes, strict=True):
        assert [c["audio"] for c in chunks] == [10 * i for i in range(n)]
        assert result["count"] == n


async def test_abort_mid_stream_frees_the_request_everywhere(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    plan = stream(tmp_path / "repo", "split", marker_dir=markers)
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        async with runtime.submit(model, {"n": 1000, "delay": 0.01}, "slow") as handle:
            got = 0
            async for _ in handle:
                got += 1
                if got == 3:
                    break
        # leaving the block aborted it: both generators get closed (their finally blocks ran)
        for _ in range(600):  # 30 s at most: the stage processes close them on their own time
            if {p.name for p in markers.iterdir()} == {"speak-slow", "voice-slow"}:
                break
            await asyncio.sleep(0.05)
        assert {p.name for p in markers.iterdir()} == {"speak-slow", "voice-slow"}
        with pytest.raises(PipelineError) as err:
            await handle.result()
        assert err.value.code == "aborted"
        assert runtime.coordinator.in_flight == 0
        # the pipeline still serves
        async with runtime.submit(model, {"n": 3}) as again:
            assert [c["audio"] async for c in again] == [0, 10, 20]


async def test_failing_request_fails_alone(tmp_path):
    plan = chain(tmp_path, "split")
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        handles = [
            runtime.submit(model, {"values": [i], **({"fail_at": "b"} if i == 3 else {})})
            for i in range(8)
        ]
        outcomes = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
    error = outcomes.pop(3)
    assert isinstance(error, PipelineError)
    assert error.code == "stage_failed" and error.stage == "b"
    assert error.message == "stage b: asked to fail request " + handles[3].id
    assert [o["values"] for o in outcomes] == [[i, 1, 2, 3] for i in range(8) if i != 3]


async def test_stream_failure_fails_its_stream_only(tmp_path):
    async with running(stream(tmp_path, "split")) as runtime:
        model = runtime.plan.models["m"]
        bad = runtime.submit(model, {"n": 5, "fail_chunk": 2})
        good = runtime.submit(model, {"n": 5})
        seen = []
        with pytest.raises(PipelineError) as err:
            async for chunk in bad:
                seen.append(chunk["audio"])
        assert err.value.stage == "speak" and "chunk 2 failed" in err.value.message
        assert seen == [0, 10][: len(seen)]  # what came before the failure, never an end marker
        assert [c["audio"] async for c in good] == [0, 10, 20, 30, 40]


async def test_raising_execute_fails_only_its_request_under_single_scheduling(tmp_path):
    stages = {
        "a": stage_toml("Raise", 'next = "b"\n', "a"),
        "b": stage_toml("Raise", "terminal = true\n", "b"),
    }
    plan = build(
        tmp_path,
        stages,
        toml("""
            [models.m]
            entry = "a"
            tasks = ["speech"]
        """),
    )
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        hs = [runtime.submit(model, {"raise_at": "b" if i % 2 else None}) for i in range(6)]
        outcomes = await asyncio.gather(*(h.result() for h in hs), return_exceptions=True)
    for i, outcome in enumerate(outcomes):
        if i % 2:
            assert isinstance(outcome, PipelineError)
            assert outcome.message == "stage b: backend exploded"
        else:
            assert [t[0] for t in outcome["trace"]] == ["a", "b"]


async def test_arrays_tensors_and_large_payloads_cross_processes(tmp_path):
    import torch

    stages = {
        "a": stage_toml("Tensor", 'next = "b"\n', "a"),
        "b": stage_toml("Tensor", "terminal = true\n", "b"),
    }
    plan = build(
        tmp_path,
        stages,
        toml("""
            [models.m]
            entry = "a"
            tasks = ["speech"]
        """),
    )
    # a ring smaller than the big payload: those messages spill over ZMQ, in order
    async with running(plan, ring_capacity=1 << 16) as runtime:
        model = runtime.plan.models["m"]
        small = np.arange(10, dtype=np.float32)
        big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
        tensor = torch.arange(6, dtype=torch.bfloat16)
        results = await asyncio.gather(
            runtime.submit(model, {"array": small, "blob": b"x"}).result(),
            runtime.submit(model, {"array": big}).result(),
            runtime.submit(model, {"array": tensor.float().numpy()}).result(),
        )
    assert np.array_equal(results[0]["array"], small * 4) and results[0]["blob"] == b"x!!"
    assert np.array_equal(results[1]["array"], big * 4)
    assert np.array_equal(results[2]["array"], np.arange(6) * 4)


async def test_config_error_in_initialize_fails_start_and_cleans_up(tmp_path):
    stages = {
        "a": stage_toml(
            "Add",
            toml("""
                next = "b"
                [parameters]
                k = 1
            """),
            "a",
        ),
        "b": stage_toml(
            "Add",
            toml("""
                terminal = true
                [parameters]
                wrong = 2
            """),
            "b",
        ),
    }
    plan = build(
        tmp_path,
        stages,
        toml("""
            [models.m]
            entry = "a"
            tasks = ["speech"]
        """),
    )
    from omni_server.pipeline import Runtime

    runtime = Runtime(plan)
    with pytest.raises(PipelineError) as err:
        await runtime.start()
    assert err.value.code == "unavailable"
    assert "stage b: parameter k is required, found ['wrong']" in err.value.message
    assert not runtime.ready and runtime.processes() == {}
    with pytest.raises(PipelineError):
        runtime.submit(plan.models["m"], {"values": []})
    await runtime.stop()
