"""Single and dynamic-batch scheduling: execute(requests) on whatever has queued up.

"single" is a batch of one with no wait. A batch starts when the first request is queued and
closes when it is full or `max_queue_delay_ms` after that first request arrived, whichever comes
first; requests aborted while queued are never run, and outputs of requests aborted while their
batch ran are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time

from .base import Scheduler, StageCallbacks, WorkItem
from .calls import StageCalls


class BatchScheduler(Scheduler):
    def __init__(
        self,
        calls: StageCalls,
        callbacks: StageCallbacks,
        executor: concurrent.futures.ThreadPoolExecutor,
        *,
        max_batch_size: int = 1,
        max_queue_delay_ms: float = 0.0,
    ) -> None:
        super().__init__(calls, callbacks, executor)
        self.max_batch_size = max(1, max_batch_size)
        self.max_queue_delay = max(0.0, max_queue_delay_ms) / 1000.0
        self._queue: collections.OrderedDict[int, WorkItem] = collections.OrderedDict()
        self._running: dict[int, WorkItem] = {}

    @property
    def active_keys(self) -> frozenset[int]:
        return frozenset(self._queue.keys() | self._running.keys())

    def admit(self, item: WorkItem) -> None:
        self._queue[item.key] = item
        self._wakeup.set()

    def abort(self, key: int) -> None:
        self._queue.pop(key, None)
        self._running.pop(key, None)

    async def run(self) -> None:
        while True:
            batch = await self._next_batch()
            await self._run_batch(batch)

    async def _next_batch(self) -> list[WorkItem]:
        while not self._runnable():
            self._wakeup.clear()
            await self._wakeup.wait()
        if self.max_batch_size > 1 and self.max_queue_delay > 0:
            first = next(iter(self._queue.values()))
            deadline = first.admitted_at + self.max_queue_delay
            while len(self._queue) < self.max_batch_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
        batch: list[WorkItem] = []
        for key in list(self._queue):
            item = self._queue[key]
            if item.runnable:
                batch.append(self._queue.pop(key))
                if len(batch) == self.max_batch_size:
                    break
        return batch

    def _runnable(self) -> bool:
        return any(item.runnable for item in self._queue.values())

    async def _run_batch(self, batch: list[WorkItem]) -> None:
        if not batch:
            return
        for item in batch:
            self._running[item.key] = item
        requests = [item.request for item in batch]
        try:
            outcomes, start, seconds = await self._compute(self.calls.execute, requests)
        except Exception as exc:  # noqa: BLE001 - the whole call failed: fail every request in it
            outcomes, start, seconds = [exc] * len(batch), time.monotonic(), 0.0
        for item, outcome in zip(batch, outcomes, strict=True):
            if self._running.pop(item.key, None) is None:
                continue  # aborted while the batch ran
            item.started(start)
            item.compute_s += seconds
            if isinstance(outcome, BaseException):
                self.callbacks.fail(item, outcome)
            else:
                payload, targets = outcome
                self.callbacks.complete(item, payload, targets)
