"""Timing shared by every benchmark: closed-loop load, percentiles, and the machine a run saw.

All times are seconds on one monotonic clock (`time.perf_counter`). Percentiles are numpy's
linear interpolation between the two nearest samples, the same in every table of the tool.
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

PERCENTILES = (50, 95, 99)

T = TypeVar("T")


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) of `values`; NaN for an empty sample (nothing measured)."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


def percentiles(values: Sequence[float], ps: Iterable[int] = PERCENTILES) -> dict[str, float]:
    """{"mean", "p50", "p95", "p99"} (or the `ps` asked for); NaN for an empty sample."""
    mean = float(np.mean(values)) if len(values) else math.nan
    return {"mean": mean, **{f"p{p}": percentile(values, p) for p in ps}}


async def closed_loop(
    jobs: Iterable[T], concurrency: int, call: Callable[[T], Awaitable[object]]
) -> float:
    """Closed-loop load: `concurrency` workers share one queue of `jobs`, taken in order, and
    each starts its next job as soon as its previous one ended. Returns the wall seconds from
    the first start to the last end."""
    queue = list(jobs)
    queue.reverse()  # pop() from the end takes them in order

    async def worker() -> None:
        while queue:
            await call(queue.pop())

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


async def open_loop(
    jobs: Iterable[T], rate: float, call: Callable[[T], Awaitable[object]], seed: int = 0
) -> float:
    """Open-loop load: one job starts every exponential(1 / `rate`) seconds (Poisson
    arrivals at `rate` per second, seeded: every target sees the same schedule), whether or
    not earlier ones have ended. Returns the wall seconds from the first start to the last end."""
    gaps = np.random.default_rng(seed)

    async def one(job: T) -> None:
        await call(job)

    start = time.perf_counter()
    arrival = start
    async with asyncio.TaskGroup() as group:
        for job in jobs:
            delay = arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            group.create_task(one(job))
            arrival += float(gaps.exponential(1.0 / rate))
    return time.perf_counter() - start


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def machine() -> dict:
    """The machine and its load as a run starts (recorded beside the numbers it explains)."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }


def machine_line() -> str:
    """The machine in one line, for a table's caption."""
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} at start"
    )
