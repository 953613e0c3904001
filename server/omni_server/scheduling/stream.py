"""Per-request streaming: drive each request's generate() one chunk at a time.

At every step the scheduler advances the runnable request that has produced the FEWEST chunks
so far (ties: the oldest). A new request's first chunk therefore never waits behind other
requests' later chunks, which keeps time-to-first-chunk flat as concurrency grows (for TTS:
time to first audio). A request reading stream input is runnable only when a chunk or the end
marker is waiting for it, so one request waiting for upstream does not stall the others.

Steps run on the stage's compute thread one at a time; the loop thread handles admissions and
aborts between steps. An aborted request's generator is closed (its `finally` blocks run) on the
compute thread; an exception from one generator fails that request alone.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omni_server.backend import RequestAborted

from .base import Scheduler, StageCallbacks, WorkItem
from .calls import StageCalls


@dataclass(eq=False)
class _Active:
    item: WorkItem
    generator: Iterator[Any] | None = None
    chunks: int = 0


class StreamScheduler(Scheduler):
    def __init__(
        self,
        calls: StageCalls,
        callbacks: StageCallbacks,
        executor: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        super().__init__(calls, callbacks, executor)
        self._active: dict[int, _Active] = {}  # insertion order = admission order
        self._current: int | None = None  # the key whose step is running now

    def admit(self, item: WorkItem) -> None:
        self._active[item.key] = _Active(item)
        self._wakeup.set()

    def abort(self, key: int) -> None:
        active = self._active.pop(key, None)
        if active is not None and active.generator is not None and key != self._current:
            self._executor.submit(self.calls.close, active.item.request, active.generator)
        # a running step finds its request gone when it returns and closes the generator then

    async def run(self) -> None:
        while True:
            active = self._pick()
            if active is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._step(active)

    def _pick(self) -> _Active | None:
        best: _Active | None = None
        for active in self._active.values():  # oldest first, so ties go to the oldest
            if active.item.runnable and (best is None or active.chunks < best.chunks):
                best = active
        return best

    async def _step(self, active: _Active) -> None:
        item = active.item
        self._current = item.key
        try:
            outcome, start, seconds = await self._compute(self._advance, active)
        except RequestAborted:
            outcome, start, seconds = None, 0.0, 0.0
        except Exception as exc:  # noqa: BLE001 - the generator raised: fail this request only
            outcome, start, seconds = exc, 0.0, 0.0
        finally:
            self._current = None
        if self._active.get(item.key) is not active:  # aborted during the step
            if active.generator is not None:
                self._executor.submit(self.calls.close, active.item.request, active.generator)
            return
        if outcome is None:  # RequestAborted raised by the backend itself
            self._active.pop(item.key)
            return
        if isinstance(outcome, BaseException):
            self._active.pop(item.key)
            self.callbacks.fail(item, outcome)
            return
        item.started(start)
        item.compute_s += seconds
        if outcome[0] == "chunk":
            active.chunks += 1
            self.callbacks.chunk(item, outcome[1])
        else:
            self._active.pop(item.key)
            self.callbacks.complete(item, outcome[1], outcome[2])

    def _advance(self, active: _Active) -> Any:
        if active.generator is None:
            active.generator = self.calls.generate(active.item.request)
        return self.calls.step(active.item.request, active.generator)
