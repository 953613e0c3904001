"""Closed- and open-loop load (harness/timing.py): which jobs overlap (order, never time)."""

from __future__ import annotations

import asyncio

import pytest

from omni_bench.harness.timing import closed_loop, open_loop


@pytest.mark.parametrize("rate", [50.0, 400.0])
def test_open_loop_starts_every_job_without_waiting_for_earlier_ones_to_end(rate):
    started: list[int] = []
    ended: list[int] = []
    release = asyncio.Event()

    async def job(i: int) -> None:
        started.append(i)
        await release.wait()  # no job ends before the last one has started
        ended.append(i)

    async def main() -> float:
        async def opener() -> None:
            while len(started) < 20:
                await asyncio.sleep(0.001)
            release.set()

        opening = asyncio.create_task(opener())
        wall = await open_loop(range(20), rate, job, seed=7)
        await opening
        return wall

    wall = asyncio.run(main())
    assert started == list(range(20)) and sorted(ended) == list(range(20))
    assert wall > 0


def test_closed_loop_keeps_at_most_its_concurrency_in_flight():
    in_flight = 0
    peak = 0

    async def job(i: int) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0)
        in_flight -= 1

    asyncio.run(closed_loop(range(30), 4, job))
    assert peak == 4
