"""Every process's memory over a soak: RSS sampled on a timer, a least-squares slope per process.

A process is one series from its start to its end: a restarted stage process (a fault, or the
supervisor's kill) starts a new series under the same instance name, so a restart's fresh
memory is never read as growth or shrinkage. The slope is in MB per minute (10^6 bytes, as
the issue's figures are); a series shorter than `min_span_s` gets none (too short to say).

    sampler = RssSampler(lambda: {"server": pid, "voice@r0": ...}); task = sampler.start(5.0)
    ...; sampler.stop(); sampler.series() -> [Series(name, pid, [(t, bytes), ...])]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil


@dataclass
class Series:
    name: str
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)  # (monotonic s, RSS bytes)

    @property
    def span_s(self) -> float:
        return self.samples[-1][0] - self.samples[0][0] if self.samples else 0.0

    def slope_mb_per_min(self, min_span_s: float = 60.0) -> float | None:
        """Least-squares RSS growth over the series; None when it spans less than min_span_s."""
        if len(self.samples) < 3 or self.span_s < min_span_s:
            return None
        times = [t for t, _ in self.samples]
        mb = [rss / 1e6 for _, rss in self.samples]
        return statistics.linear_regression(times, mb).slope * 60.0

    def late_slope_mb_per_min(self, min_span_s: float = 60.0) -> float | None:
        """The slope over the second half of the series: a warm-up (pools and caches filling
        once) shows as a late slope near 0, a leak as one near the whole series'."""
        if not self.samples:
            return None
        middle = self.samples[0][0] + self.span_s / 2
        late = Series(self.name, self.pid, [s for s in self.samples if s[0] >= middle])
        return late.slope_mb_per_min(min_span_s / 2)

    def mib(self, index: int) -> float:
        return self.samples[index][1] / 2**20


class RssSampler:
    """Samples the RSS of `processes()` (name -> pid, asked at every tick) every interval."""

    def __init__(self, processes: Callable[[], dict[str, int]]) -> None:
        self._processes = processes
        self._series: dict[tuple[str, int], Series] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self, interval_s: float) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(interval_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sample()  # the last reading, after the load

    def sample(self) -> None:
        now = time.monotonic()
        for name, pid in self._processes().items():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue  # it died between the listing and the reading: its series ends
            key = (name, pid)
            if key not in self._series:
                self._series[key] = Series(name, pid)
            self._series[key].samples.append((now, rss))

    async def _run(self, interval_s: float) -> None:
        while True:
            self.sample()
            await asyncio.sleep(interval_s)

    def series(self) -> list[Series]:
        return sorted(self._series.values(), key=lambda s: (s.name, s.samples[0][0]))
