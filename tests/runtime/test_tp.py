"""Tensor parallelism on CPU: two ranks over gloo compute what one unsharded matmul does."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from omni_server.repository.plan import Plan
from tests.runtime.conftest import running
from tests.runtime.pipelines import _stage, build

pytestmark = pytest.mark.timeout(180)


def _cpu_tp(plan: Plan, size: int) -> Plan:
    """The plan with every stage tensor-parallel on CPU (gloo).

    The compiler accepts tp_size > 1 only with one GPU per rank; this machine has none, so the
    test widens the compiled plan itself: what the runtime gets is what a GPU plan looks like,
    minus the device ids.
    """
    stages = {n: dataclasses.replace(s, tp_size=size) for n, s in plan.stages.items()}
    processes = {n: dataclasses.replace(p, tp_size=size) for n, p in plan.processes.items()}
    instances = tuple(
        dataclasses.replace(i, tp_rank=rank, tp_size=size)
        for i in plan.instances
        for rank in range(size)
    )
    return dataclasses.replace(plan, stages=stages, processes=processes, instances=instances)


def _expected(x: list[list[float]]) -> torch.Tensor:
    weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return torch.tensor(x) @ weight.T


async def test_tp2_over_gloo_matches_the_unsharded_computation(tmp_path):
    stages = {
        "mm": _stage(
            "ShardedLinear",
            'next = "rows"\n[scheduler]\nkind = "batch"\n'
            "max_batch_size = 4\nmax_queue_delay_ms = 20\n",
        ),
        "rows": _stage("ShardedStream", 'terminal = true\n[scheduler]\nkind = "stream"\n'),
    }
    plan = _cpu_tp(build(tmp_path, stages, '[models.m]\nentry = "mm"\ntasks = ["speech"]\n'), 2)
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
