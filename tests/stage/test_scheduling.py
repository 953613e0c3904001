"""Schedulers: dynamic batching limits, single scheduling, stream fairness (fewest chunks first).

These run inline (stage hosts in this process): the schedulers are the same objects as in a
stage process and start in milliseconds.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.pipelines import build, stage_toml, stream
from tests.helpers.repo import toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(60)


def _batching(root, scheduler: str):
    stages = {"b": stage_toml("Batch", "terminal = true\n" + scheduler, "p")}
    return build(
        root,
        stages,
        toml("""
            [models.m]
            entry = "b"
            tasks = ["speech"]
        """),
    )


async def test_batch_scheduler_fills_batches_up_to_the_limit(tmp_path):
    plan = _batching(
        tmp_path,
        toml("""
            [scheduler]
            kind = "batch"
            max_batch_size = 4
            max_queue_delay_ms = 50
        """),
    )
    async with running(plan, inline=True) as runtime:
        model = runtime.plan.models["m"]
        results = await asyncio.gather(
            *(runtime.submit(model, {"i": i}).result() for i in range(10))
        )
    sizes = [r["batch"] for r in results]
    assert [r["i"] for r in results] == list(range(10))
    assert max(sizes) == 4 and all(1 <= s <= 4 for s in sizes)


async def test_single_scheduler_runs_one_request_at_a_time(tmp_path):
    async with running(_batching(tmp_path, ""), inline=True) as runtime:
        model = runtime.plan.models["m"]
        results = await asyncio.gather(
            *(runtime.submit(model, {"i": i}).result() for i in range(5))
        )
    assert [r["batch"] for r in results] == [1] * 5


async def test_stream_scheduler_serves_fewest_chunks_first(tmp_path):
    """A new request's first chunks never queue behind an older request's later chunks."""
    async with running(stream(tmp_path, "one"), inline=True) as runtime:
        model = runtime.plan.models["m"]
        async with runtime.submit(model, {"n": 40, "delay": 0.005}) as old:
            old_chunks = []
            async for chunk in old:
                old_chunks.append(chunk)
                if len(old_chunks) == 5:
                    break
            async with runtime.submit(model, {"n": 5, "delay": 0.005}) as new:
                new_steps = [c["step"] async for c in new]
            old_chunks += [c async for c in old]
    # `step` numbers every generator step of the speak stage in the order they ran. The old
    # request had >= 5 chunks when the new one came, so the new one's 5 steps ran back to back.
    assert new_steps == list(range(new_steps[0], new_steps[0] + 5))
    assert [c["audio"] for c in old_chunks] == [10 * i for i in range(40)]


async def test_abort_leaves_no_request_state_in_any_stage(tmp_path):
    """Inline, the hosts can be inspected: an aborted stream is gone from every stage."""
    async with running(stream(tmp_path, "split"), inline=True) as runtime:
        model = runtime.plan.models["m"]
        async with runtime.submit(model, {"n": 1000, "delay": 0.005}) as handle:
            await anext(aiter(handle))
        done = await runtime.submit(model, {"n": 2}).result()  # the stages still serve
        assert done == {"count": 2, "where": done["where"]}
        for host in runtime.inline_pipeline.hosts:
            for name, stage in host.stages.items():
                assert stage.idle, f"stage {name} still holds request state"
        assert runtime.coordinator.in_flight == 0


async def test_broken_backend_contract_fails_the_request_with_a_clear_message(tmp_path):
    from omni_server.pipeline import PipelineError

    stages = {"b": stage_toml("Broken", "terminal = true\n", "p")}
    plan = build(
        tmp_path,
        stages,
        toml("""
            [models.m]
            entry = "b"
            tasks = ["speech"]
        """),
    )
    async with running(plan, inline=True) as runtime:
        model = runtime.plan.models["m"]
        messages = {}
        for how in ("short", "not-a-dict"):
            with pytest.raises(PipelineError) as err:
                await runtime.submit(model, {"how": how}).result()
            assert err.value.code == "stage_failed" and err.value.stage == "b"
            messages[how] = err.value.message
        assert await runtime.submit(model, {"how": "fine"}).result() == {"how": "fine"}
    assert messages["short"] == (
        "stage b: execute() must return a list with one output per request: 1 requests, got 0"
    )
    assert messages["not-a-dict"] == "stage b: execute() output must be a dict, got str"
