"""Tensor parallelism on CPU: two ranks over gloo compute what one unsharded matmul does."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import PipelineError
from tests.fixtures import FIXTURES
from tests.helpers.pipelines import build, stage_toml
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(180)


def _expected(x: list[list[float]]) -> torch.Tensor:
    weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return torch.tensor(x) @ weight.T


@pytest.mark.slow  # two torch processes over gloo
async def test_tp2_over_gloo_matches_the_unsharded_computation(tmp_path):
    # tp_size without `gpu`: the compiler places both ranks on the CPU (gloo)
    stages = {
        "mm": stage_toml(
            "ShardedLinear",
            toml("""
                next = "rows"
                tp_size = 2
                [scheduler]
                kind = "batch"
                max_batch_size = 4
                max_queue_delay_ms = 20
            """),
        ),
        "rows": stage_toml(
            "ShardedStream",
            toml("""
                terminal = true
                tp_size = 2
                [scheduler]
                kind = "stream"
            """),
        ),
    }
    plan = build(
        tmp_path,
        stages,
        toml("""
            [models.m]
            entry = "mm"
            tasks = ["speech"]
        """),
    )
    assert {(i.name, i.tp_size, i.devices[i.stages[0]]) for i in plan.instances} == {
        (f"{s}@r0/tp{rank}", 2, None) for s in ("mm", "rows") for rank in (0, 1)
    }
    async with running(plan) as runtime:
        assert sorted(runtime.processes()) == [
            "mm@r0/tp0",
            "mm@r0/tp1",
            "rows@r0/tp0",
            "rows@r0/tp1",
        ]
        model = runtime.plan.models["m"]
        xs = [[float(i), 1.0, -2.0, 0.5 * i] for i in range(6)]

        async def one(x):
            async with runtime.submit(model, {"x": x, "rows": [x, [1.0, 0, 0, 0]]}) as h:
                return [c["y"] async for c in h], await h.result()

        outcomes = await asyncio.gather(*(one(x) for x in xs))
    for x, (chunks, result) in zip(xs, outcomes, strict=True):
        assert result == {"rows": 2}
        expected = _expected([x, [1.0, 0, 0, 0]])
        assert torch.allclose(torch.tensor(chunks), expected, atol=1e-5)


def _collective_stream(root):
    stage = toml("""
        backend = "model.py:CollectiveStream"
        terminal = true
        tp_size = 2
        [scheduler]
        kind = "stream"
    """)
    make_repo(
        root,
        {"s": stage},
        toml("""
            [models.m]
            entry = "s"
            tasks = ["speech"]
        """),
        {"s": FIXTURES / "tp_stages.py"},
    )
    return compile_repository(root)


async def _three_chunks(runtime):
    async with runtime.submit(runtime.plan.models["m"], {"n": 3}) as h:
        chunks = [c async for c in h]
        result = await asyncio.wait_for(h.result(), timeout=30)
    assert result == {"chunks": 3}
    assert [c["sum"] for c in chunks] == [0.0, 3.0, 6.0]  # (1 + 2) * i over the two ranks


@pytest.mark.slow  # two torch processes over gloo
@pytest.mark.parametrize("rank", [1, 0])
async def test_a_stream_step_failing_on_one_rank_fails_on_both(tmp_path, rank):
    async with running(_collective_stream(tmp_path)) as runtime:
        handle = runtime.submit(runtime.plan.models["m"], {"n": 5, "fail_on_rank": rank})
        with pytest.raises(PipelineError) as caught:
            await asyncio.wait_for(handle.result(), timeout=30)
        assert caught.value.code == "stage_failed"
        assert f"rank {rank}" in str(caught.value) or f"rank(s) {rank}" in str(caught.value)
        await _three_chunks(runtime)  # the peer dropped its generator too: still in step


@pytest.mark.slow  # two torch processes over gloo
async def test_check_aborted_between_collectives_keeps_the_ranks_in_step(tmp_path):
    """The abort reaches every rank's request at the same step boundary: a backend checking it
    between all-reduces raises on both ranks or on neither, so the next request completes."""
    async with running(_collective_stream(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        for _ in range(3):
            handle = runtime.submit(model, {"n": 200, "sleep": 0.01})
            got = 0
            async for _chunk in handle:
                got += 1
                if got == 4:
                    break
            await handle.abort()  # lands mid-step: between the two checks, or in the sleep
        await _three_chunks(runtime)
